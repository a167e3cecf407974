"""A KVNode object behind its wire edge, in the test's own process: what a Ray actor runs, without Ray."""

from kvmesh.actor import KVNodeActor
from kvmesh.node import KVNode

WIRE = ("hello", "pin", "unpin", "pull", "pull_through", "store", "report_corrupt", "locate")


class WireNode:
    """Wire messages in and out (`pin(pack_keys(...))`), like the actor; everything else is the node's own."""

    def __init__(self, *args, **kwargs) -> None:
        self.node = args[0] if isinstance(args[0], KVNode) else KVNode(*args, **kwargs)
        self.edge = KVNodeActor.around(self.node)

    def __getattr__(self, name):
        return getattr(self.edge if name in WIRE else self.node, name)

    def __setattr__(self, name, value):
        if name in ("node", "edge"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.node, name, value)

    def die(self) -> None:
        """The process dies without a word: every thread stops, nothing is unregistered (the lease lapses), its
        files close."""
        n = self.node
        n._closed = True
        n._stop.set()
        n._thread.join(timeout=5)
        r = n.registrar
        with r._cv:
            r._stop = True
            r._cv.notify_all()
        r._thread.join(timeout=5)
        if n.data_server:
            n.data_server.shutdown()
        n.directory.close()
        if n.cascade.disk is not None:
            n.cascade.disk.close()
