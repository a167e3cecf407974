"""Sources: how one run of chunks (`planner.Run`) reaches a sink. The `Fetcher` picks one per run (`Fetcher.source`);
each is two-phase:

    Source.begin(env, run, sink, opts) -> Transfer   phase 1: the request goes out now (a pin, a pull); returns at
                                                     once (`transfers`: phase 2, complete, and release)

Sources, by `kind`:
    slab    this node's shared-memory slab: the local KVNode pins the chunks (disk- or GPU-only chunks are first
            brought into the slab by the node), the bytes are read here at memory bandwidth
    via     through this node: the local KVNode pulls what it lacks from the holder (one transfer per chunk for
            all its readers, kept there), then as `slab`
    tcp     another node's DataServer: the bytes are received straight into the sink, checked as they arrive
    ray     another node's actor, through Ray's object store (the fallback transport)

`slab` and `via` are `pinned`: this node answers them with slab slots pinned for the reader, so their chunks count
against this node's slab in the fetcher's windows; `tcp` and `ray` are `staged`: they land through the sink's
`segments`/`put`, for which a device sink needs staging.

`Env` is what sources read: the caller's node, the node view, the data client and pools, and its local side
(`Attached`: the local KVNode's handle, its slab as mapped here, its GPU tier's pools, peers' handles). A fetch
never rewrites the local side; it tells it (`stale_slab`, `drop_gpu`), and its owner (a client's
`attachment.LocalAttachment`) decides.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING

from kvmesh.dataplane.planner import Run
from kvmesh.dataplane.transfers import Failed, Landed, PinnedTransfer, RayTransfer, TcpTransfer, Transfer
from kvmesh.nodeview import NodeView
from kvmesh.tiers import TIER_CPU
from kvmesh.transport import DataClient
from kvmesh.wire import MAX_DEADLINE_MS, PullThrough

if TYPE_CHECKING:
    from kvmesh.dataplane.fetcher import FetchOptions
    from kvmesh.dataplane.gpureads import GpuReads
    from kvmesh.handle import LocalHandle, NodeHandle
    from kvmesh.tiers.cpu import SlabReader

__all__ = ["Attached", "Env", "Source", "SLAB", "VIA", "TCP", "RAY", "Landed", "Transfer", "Failed"]


class Attached:
    """The local side of a fetch, fixed: a KVNode's own pull-throughs have none (no handle, no slab), and read
    peers through `peers`. A client's `attachment.LocalAttachment` is one that follows its node's restarts."""

    def __init__(
        self,
        local: NodeHandle | LocalHandle | None = None,
        slab: SlabReader | None = None,
        slot_bytes: int = 0,
        peers: Callable[[str], NodeHandle | LocalHandle | None] = lambda node_id: None,
        on_stale_slab: Callable[[], None] = lambda: None,
        gpu: GpuReads | None = None,
    ) -> None:
        self.local, self.slab, self.slot_bytes, self.gpu = local, slab, slot_bytes, gpu
        self._peers, self._on_stale_slab = peers, on_stale_slab

    def peer(self, node_id: str) -> NodeHandle | LocalHandle | None:
        """The handle of `node_id`'s KVNode, or None."""
        return self._peers(node_id)

    def stale_slab(self) -> None:
        """A pin named another slab than the one mapped here: the local node restarted."""
        self._on_stale_slab()

    def drop_gpu(self, gpu: GpuReads) -> None:
        """`gpu` (the pools mapped here) cannot be read any more: GPU-tier chunks come through the slab."""
        if self.gpu is gpu:
            self.gpu = None


class Env:
    """What sources need, owned by the `Fetcher`; its local side is `attached`'s, read here, never written.
    `Env(here, local, slab, slot_bytes, peers, view, data, pool, ...)` makes a fixed one (`Attached`)."""

    def __init__(
        self,
        here: str,  # the caller's node id ("" outside a node)
        local: NodeHandle | LocalHandle | None,  # a handle of this node's KVNode
        slab: SlabReader | None,  # this node's slab, mapped here
        slot_bytes: int,
        peers: Callable[[str], NodeHandle | LocalHandle | None],  # node id -> handle of its KVNode, or None
        view: NodeView,
        data: DataClient,
        pool: Executor,  # threads for the blocking receives of `tcp` runs
        on_stale_slab: Callable[[], None] = lambda: None,  # the local node's slab moved (it restarted)
        gpu: GpuReads | None = None,  # this node's GPU tier mapped here, or None
        verify: Executor | None = None,  # threads that check slab chunks while the next ones are copied
        attached: Attached | None = None,  # the local side instead of local, slab, slot_bytes, peers, ..., gpu
    ) -> None:
        self.here, self.view, self.data, self.pool, self.verify = here, view, data, pool, verify
        self.attached = attached or Attached(local, slab, slot_bytes, peers, on_stale_slab, gpu)

    @classmethod
    def of(cls, here: str, attached: Attached, view: NodeView, data: DataClient, pool: Executor, verify=None) -> Env:
        return cls(here, None, None, 0, attached.peer, view, data, pool, verify=verify, attached=attached)

    @property
    def local(self) -> NodeHandle | LocalHandle | None:
        return self.attached.local

    @property
    def slab(self) -> SlabReader | None:
        return self.attached.slab

    @property
    def slot_bytes(self) -> int:
        return self.attached.slot_bytes

    @property
    def gpu(self) -> GpuReads | None:
        return self.attached.gpu

    def peers(self, node_id: str) -> NodeHandle | LocalHandle | None:
        return self.attached.peer(node_id)


class Source:
    kind = ""
    pinned = False  # answered with slots of this node's slab, pinned for the reader
    staged = False  # lands through the sink's segments/put

    def brings(self, run: Run) -> int:
        """Of `run`'s chunks, those its node must bring into its slab first (on its disk or GPU tier, as the
        lookup found them): chunks already in a slab are pinned where they lie."""
        return sum(t != TIER_CPU for t in run.tiers)

    def begin(self, env: Env, run: Run, sink, opts: FetchOptions, copy: bool = False) -> Transfer:
        """Phase 1 of `run`. `copy`: a pinned run is copied into the sink (the sink has staging for it), never
        adopted, so that its pins go as soon as it is released."""
        raise NotImplementedError


class Slab(Source):
    kind, pinned = "slab", True

    def begin(self, env: Env, run: Run, sink, opts: FetchOptions, copy: bool = False) -> Transfer:
        # a device sink on a GPU reads GPU-tier chunks device to device where it can map them
        assert env.local is not None, "the planner gives slab runs only to a reader beside its KVNode"
        gpu = not copy and env.gpu is not None and getattr(sink, "device_reads", False)
        # held while the sink may read the slots: an adopting sink reads them until the fetch ends, so the pin
        # must not lapse before the deadline however long it is (the node's pin TTL runs from there)
        hold = max(0.0, opts.deadline - time.monotonic())
        pending = env.local.pin(list(run.keys), gpu, hold)
        return PinnedTransfer(env, run, sink, opts.chunk_bytes, self.kind, pending, copy)


class Via(Source):
    kind, pinned = "via", True

    def brings(self, run: Run) -> int:
        return len(run.keys)  # (pulled from its holder, all of it)

    def begin(self, env: Env, run: Run, sink, opts: FetchOptions, copy: bool = False) -> Transfer:
        assert env.local is not None, "pull-throughs go through this node's KVNode"
        ms = max(0, min(MAX_DEADLINE_MS, int((opts.deadline - time.monotonic()) * 1000)))
        cb = opts.chunk_bytes
        req = PullThrough(list(run.keys), opts.group, cb, run.holder, opts.transport, ms, run.incarnation)
        return PinnedTransfer(env, run, sink, cb, self.kind, env.local.pull_through(req), copy)


class Tcp(Source):
    kind, staged = "tcp", True

    def begin(self, env: Env, run: Run, sink, opts: FetchOptions, copy: bool = False) -> Transfer:
        info = env.view.info(run.holder, run.incarnation)
        if info is None or not info.data_addr:
            return Failed(run, sink, self.kind, "holder_unknown")
        return TcpTransfer(env, run, sink, opts.chunk_bytes, info.data_addr, opts.deadline)


class Ray(Source):
    kind, staged = "ray", True

    def begin(self, env: Env, run: Run, sink, opts: FetchOptions, copy: bool = False) -> Transfer:
        holder = env.peers(run.holder)
        if holder is None:
            return Failed(run, sink, self.kind, "holder_unknown")
        return RayTransfer(env, run, sink, opts.chunk_bytes, holder)


SLAB, VIA, TCP, RAY = Slab(), Via(), Tcp(), Ray()
BY_TRANSPORT = {"tcp": TCP, "ray": RAY}
