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
