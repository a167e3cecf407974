"""`LocalAttachment`: a client's hold on its node. The local KVNode's handle, its slab as mapped here, the node table
it relays beside the slab (`nodeview.TableFile`), its GPU tier's pools mapped for reads (`GpuReads`), and the cache
of peers' handles with the incarnation each was looked up under. The fetcher's `Env` reads it (it is the Env's
`Attached`); only this part changes it, when its node restarts or is replaced (`follow_nodes`, `reattach`)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvmesh.clienttelemetry import ClientTelemetry
from kvmesh.dataplane.gpureads import GpuReads
from kvmesh.dataplane.sources import Attached
from kvmesh.handle import NodeHandle, Orphans
from kvmesh.nodeview import NodeView, TableFile
from kvmesh.tiers.cpu import SlabReader


class LocalAttachment(Attached):
    def __init__(
        self,
        node_id: str | None,
        local,
        local_slab: tuple[str, int, int] | None,
        peers: Callable | None,
        gpu_exports: tuple[bytes, ...],
        telemetry: ClientTelemetry,
    ) -> None:
        """`local`: a handle of this node's KVNode (`handle.NodeHandle`, or `LocalHandle` without Ray) or None;
        `local_slab`: its slab (path, bytes, slot bytes); `peers`: node id -> handle of another node's KVNode
        (None: found through Ray); `gpu_exports`: its GPU tier's pools, read device to device where CUDA IPC
        works here."""
        super().__init__(
            local,
            SlabReader.open(*local_slab[:2]) if local_slab else None,
            local_slab[2] if local_slab else 0,
            gpu=GpuReads.open(gpu_exports),
        )
        self.node_id = node_id
        self.telemetry = telemetry
        self.slab_path = local_slab[0] if local_slab else ""
        # the node table as this node's KVNode relays it (one reader of Redis per node)
        self.table_file = TableFile.beside(local_slab[0]) if local_slab else None
        orphans = getattr(local, "orphans", None)  # replies of this client's calls that came too late
        self.orphans: Orphans = orphans if orphans is not None else Orphans()
        self.view: NodeView | None = None  # the client's (set once, before the first fetch)
        self.on_replaced: Callable[[object], None] = lambda handle: None  # a new KVNode actor took this node's place
        self._peers_given = peers
        self._handles: dict[str, object] = {}
        self._incs: dict[str, int] = {}  # node id -> its incarnation when its handle was looked up
        self._lock = threading.Lock()  # a fetch's stale slab and the refresher may both find the restart

    def peer(self, node_id: str):
        """The handle of `node_id`'s KVNode (this node's own included), or None."""
        if node_id == self.node_id and self.local is not None:
            return self.local
        h = self._handles.get(node_id)
        if h is None:
            if self._peers_given is not None:
                h = self._peers_given(node_id)
            else:
                h = NodeHandle.find(node_id, self.node_id or "", self.orphans)
            if h is None:
                self.telemetry.counts["fetch_node_unknown"] += 1
                return None
            self._handles[node_id] = h
            if self._peers_given is None and self.view is not None:
                info = self.view.table().by_node().get(node_id)
                self._incs[node_id] = info.incarnation if info is not None else 0
        return h

    def follow_nodes(self) -> None:
        """(The refresher, with Ray.) A KVNode that Ray restarted keeps its actor handle but not its slab; one
        replaced by a new actor (`kvmesh.stop` and `start`, the keeper putting one back, a restart that failed)
        leaves this client's handle dead for good. The node table says when either happened: a node whose
        incarnation changed. This node's KVNode is then attached again (handle, slab, GPU pools) and a peer's
        handle looked up again when next needed."""
        if self._peers_given is not None or self.local is None or self.view is None:
            return
        nodes = self.view.table().by_node()
        for node_id, inc in list(self._incs.items()):
            info = nodes.get(node_id)
            if info is None or info.incarnation != inc:
                self._handles.pop(node_id, None)
                self._incs.pop(node_id, None)
        me = nodes.get(self.node_id or "")
        if me is not None and self.slab is not None and me.slab_path != self.slab_path:
            self.reattach(stale=False)

    def stale_slab(self) -> None:
        self.reattach()

    def reattach(self, stale: bool = True) -> None:
        """The local KVNode restarted or was replaced (a new slab): attach to it again and map its new slab."""
        if stale:
            self.telemetry.counts["fetch_stale_slab"] += 1
        with self._lock:  # (once: two at once mapped the new slab twice and closed the old one twice)
            self._reattach_once()

    def _reattach_once(self) -> None:
        assert self.local is not None, "only a client beside a KVNode reattaches"
        try:
            hello = self.local.hello(timeout=5)
        except Exception:  # the actor is gone: a new one may run under the same name
            me = self.node_id or ""
            found = NodeHandle.find(me, me, self.orphans) if self._peers_given is None and me else None
            if found is None:
                return
            try:
                hello = found.hello(timeout=5)
            except Exception:
                return
            self.local = found
            self.on_replaced(found)
            self.telemetry.counts["local_node_reattached"] += 1
        if self.slab is not None and hello.info.slab_path == self.slab_path:
            return
        old = self.slab
        self.slab = SlabReader.open(hello.info.slab_path, hello.info.slab_bytes)
        self.slab_path = hello.info.slab_path
        self.table_file = TableFile.beside(hello.info.slab_path)
        self.slot_bytes = hello.info.slot_bytes
        if old is not None:
            old.close()
        if self.gpu is not None:
            self.gpu.close()
        self.gpu = GpuReads.open(hello.gpu_exports)  # a restarted node has new pools

    def close(self) -> None:
        if self.slab is not None:
            self.slab.close()
            self.slab = None
        if self.gpu is not None:
            self.gpu.close()
