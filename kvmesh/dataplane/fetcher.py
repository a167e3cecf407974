"""`Fetcher`: runs a fetch through the pipeline, for a worker's client or for a KVNode's pull-through.

    fetch(chunks, sink, options) -> (result, FetchStats)

1. plan: `planner.plan_runs` (runs by holder, peer runs in batches);
2. pick each run's source (`Fetcher.source`, a `sources.Source`): this node's slab for its own chunks; for other
   nodes', the local node (`coalesce`, "via"), the holder's DataServer ("tcp") or its actor ("ray");
3. begin every run at once: pins and pulls go out together, receives run on pool threads, so runs from different
   holders (and batches of one holder) proceed in parallel into their own places in the sink. Except where a
   node must bring more chunks into its slab for the fetch than half of it (chunks on its disk or GPU tier, or
   pulled through it; this node for "slab" and "via" runs, which it pins for the reader, a holder for the batches
   it pins to send): that node's runs come in windows, each begun once the ones before it are released, so that
   at most half its slab is pinned for the fetch at a time, and this node's are copied into the sink (never
   adopted: an adopted slot stays pinned until the sink lets go). Without that, a prompt larger than a slab could
   never be read whole. (Chunks already in a slab need no room: pinned where they lie, adopted zero-copy.)
4. complete the runs in order; the first one that comes up short ends the fetch there: later runs are stopped,
   and the result is the leading run of chunks that arrived intact;
5. release every run, whatever happened (pins, receiving threads), then `sink.finish(delivered)`.

The options mean the same on every path: `transport` ("tcp" or "ray") for direct peer pulls and for the local
node's own pulls in "via" runs, `coalesce` for whether peer chunks come through the local node, `deadline` (a
monotonic time) for the whole fetch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.dataplane import sources
from kvmesh.dataplane.planner import Run, plan_runs
from kvmesh.match import FetchStats, RunStats
from kvmesh.tiers import TIER_DISK


@dataclass(frozen=True, slots=True)
class FetchOptions:
    chunk_bytes: int
    deadline: float  # time.monotonic() by which the fetch ends, whatever it got
    transport: str = "tcp"  # "tcp" | "ray"
    coalesce: bool = False  # peer chunks come through this node's KVNode (needs `group`)
    group: bytes = b""  # the prompt's directory group: where chunks pulled through this node register
    per_batch: int = 8  # chunks per peer request


class Fetcher:
    def __init__(self, env: sources.Env) -> None:
        self.env = env
        self._slabs: dict[tuple[str, int], int] = {}  # (node id, incarnation) -> slots in its slab

    @property
    def local_reads(self) -> bool:
        return self.env.slab is not None and self.env.local is not None

    def source(self, run: Run, opts: FetchOptions) -> sources.Source:
        """Where `run` comes from: this node's slab for its own chunks; else through this node (`coalesce`), the
        holder's DataServer or its actor, as `opts.transport` says."""
        if run.local:
            return sources.SLAB
        if opts.coalesce and opts.group and self.local_reads:
            return sources.VIA
        if opts.transport == "tcp":
            info = self.env.view.info(run.holder, run.incarnation)
            if info is not None and not info.data_addr:  # a holder that serves pulls through Ray only (its node
                return sources.RAY  # was started with peer_transport="ray"): every KVNode answers Ray pulls
        return sources.BY_TRANSPORT[opts.transport]

    def budget(self, node: str, incarnation: int = 0) -> int:
        """Chunks one fetch may have pinned at a time in `node`'s slab (this node's for "slab" and "via" runs, the
        holder's for "tcp" and "ray" ones): half of it; the rest serves other readers, stores and the node's own
        reads. Unbounded for a node this view does not know (its runs fail as they begin). `incarnation`: the one
        the lookup named (a node that restarted may have another slab)."""
        env = self.env
        if node == env.here and env.slab is not None and env.slot_bytes > 0:
            return max(1, env.slab.size // env.slot_bytes // 2)
        slots = self._slabs.get((node, incarnation))
        if slots is None:  # (once per incarnation: the table is walked whole to find it)
            info = env.view.table().by_node().get(node)
            if info is None or info.slot_bytes <= 0:
                return 1 << 30
            slots = info.slab_bytes // info.slot_bytes
            if incarnation and info.incarnation == incarnation:
                self._slabs[(node, incarnation)] = slots
        return max(1, slots // 2)

    def plan(self, chunks: Sequence, opts: FetchOptions) -> tuple[list[Run], list[sources.Source], dict[str, int]]:
        """The runs, their sources, and the nodes whose share of the fetch is more than they may pin at once, with
        their budgets: those nodes' runs come in windows (this node's runs cut to half its budget, peers' batches
        to at most theirs), begun as the earlier ones are released."""
        here = self.env.here or None
        runs = plan_runs(chunks, here, self.local_reads, opts.per_batch) if chunks else []
        srcs = [self.source(r, opts) for r in runs]
        load: dict[str, int] = {}  # node -> chunks the fetch pins in its slab
        brings: dict[str, int] = {}  # node -> of those, the chunks it must bring into its slab first
        incarnations: dict[str, int] = {}
        for r, k in zip(runs, srcs):
            # a node brings into its slab all of a "via" run (pulled from its holder) and, of a run it holds, what
            # is not in its slab already (on its disk or GPU tier, as the lookup found it). Chunks already in a slab
            # are pinned where they lie: a fetch of nothing else is never windowed, whatever its size, and adopted
            # zero-copy. One that also brings chunks in needs room beside all it pins: windowed beyond the budget
            node = self._pins_on(r, k)
            load[node] = load.get(node, 0) + len(r.keys)
            brings[node] = brings.get(node, 0) + k.brings(r)
            incarnations[node] = r.incarnation
        budgets = {
            node: b for node, n in load.items() if brings[node] and n > (b := self.budget(node, incarnations[node]))
        }
        if budgets:
            local = budgets.get(self.env.here)
            window = max(1, local // 2) if local else None  # two in flight
            # (a "via" run is a peer batch that this node pins: a window too)
            per_batch = min([opts.per_batch, *(b for node, b in budgets.items() if node != self.env.here)])
            runs = plan_runs(chunks, here, self.local_reads, min(per_batch, window or per_batch), window)
            srcs = [self.source(r, opts) for r in runs]
        return runs, srcs, budgets

    def _pins_on(self, run: Run, source: sources.Source) -> str:
        return self.env.here if source.pinned else run.holder

    def fetch(self, chunks: Sequence, sink, opts: FetchOptions):
        t0 = time.monotonic()
        env = self.env
        orphans = getattr(env.local, "orphans", None)
        if orphans is not None:
            orphans.reap()  # pins of earlier fetches that came after their deadline
        runs, srcs, budgets = self.plan(chunks, opts)
        # this node's windows are copied into the sink (unpinned as each is done). Otherwise its slab slots are
        # adopted (read in place: a device sink DMAs from the page-locked slab), whatever the deadline: pins are
        # held until the deadline (`sources.Slab.begin`), so no slot an adopting sink reads is reused under it
        copy = env.here in budgets
        sink.prepare([i for r, k in zip(runs, srcs) if k.staged or copy and k.pinned for i in r.indices])
        transfers: list[sources.Transfer | None] = [None] * len(runs)
        begun = [t0] * len(runs)  # when each run was begun (windows begin as earlier ones are released)
        issued = [t0] * len(runs)  # when its begin returned (an in-process holder pins inside it)
        waiting: dict[str, list[int]] = {}  # node -> its windows not begun yet, in order
        pinned = dict.fromkeys(budgets, 0)  # node -> chunks of its begun windows not released yet

        def begin(j: int) -> None:
            r, k = runs[j], srcs[j]
            begun[j] = time.monotonic()
            if time.monotonic() >= opts.deadline:  # (beginning a run can wait: a holder's address, a pin)
                transfers[j] = sources.Failed(r, sink, k.kind, "deadline")
            else:
                transfers[j] = k.begin(env, r, sink, opts, copy)
            issued[j] = time.monotonic()

        def begin_windows() -> None:
            for node, queue in waiting.items():
                while queue and (not pinned[node] or pinned[node] + len(runs[queue[0]].keys) <= budgets[node]):
                    j = queue.pop(0)
                    pinned[node] += len(runs[j].keys)
                    begin(j)

        delivered, error, corrupt, device, adopted = 0, "", 0, 0, 0
        stats: list[RunStats] = []
        try:
            for j, (r, k) in enumerate(zip(runs, srcs)):
                node = self._pins_on(r, k)
                if node in budgets:
                    waiting.setdefault(node, []).append(j)
                else:
                    begin(j)
            begin_windows()
            for j, r in enumerate(runs):
                t = transfers[j]
                assert t is not None, "windows are begun in order, as the ones before them are released"
                called = time.monotonic()
                landed = t.complete(opts.deadline)
                start, seconds = _timing(t, begun[j], issued[j], called, time.monotonic(), landed.error)
                stats.append(
                    RunStats(t.kind, _link(r), len(r.keys), landed.delivered, seconds, landed.error, start - t0)
                )
                delivered += landed.delivered
                corrupt += landed.corrupt
                device += landed.device
                adopted += landed.adopted
                if landed.delivered < len(r.keys):
                    error = landed.error or "peer_error"
                    break
                node = self._pins_on(r, srcs[j])
                if node in budgets:
                    t.release()  # (a window is never adopted: nothing of it stays pinned)
                    pinned[node] -= len(r.keys)
                    begin_windows()
        finally:
            for t in transfers:
                if t is not None:
                    t.release()
        result = sink.finish(delivered)
        local = sum(s.delivered for s in stats if s.source == "slab")
        return result, FetchStats(
            local, delivered - local, time.monotonic() - t0, error, len(chunks), corrupt, tuple(stats), device, adopted
        )


def _timing(t, begun: float, issued: float, called: float, end: float, error: str) -> tuple[float, float]:
    """(start, seconds) of a run's own work, for its link's cost model. Runs overlap and are completed in order,
    so the time to a run's completion includes waiting on the runs before it: a fast slab run behind a slow peer
    would be charged the peer's time. Its own: from its begin (a TCP pull: from when a pool thread took it up) to
    when its bytes were in (TCP: its thread's end; else the reply's arrival, then the copy `complete` did). A reply
    that was in before `complete` asked came at the latest when it asked, at the earliest when `begin` returned
    (an in-process holder answers inside it): the earliest is taken, the pin's time hidden behind earlier runs
    is not charged. A run cut short by its deadline is charged all it waited."""
    if isinstance(t, sources.Failed):  # never went out (no holder address, or begun past the deadline)
        return begun, 0.0
    if error == "deadline":
        return begun, max(0.0, end - begun)
    if t.ready_at is not None:
        start = t.started_at if t.started_at is not None else begun
        return start, max(0.0, min(t.ready_at, end) - start)
    reply = t.reply_at if t.reply_at is not None else issued
    return begun, max(0.0, reply - begun) + max(0.0, end - max(called, reply))


def _link(run: Run) -> str:
    """The cost model's name for the link a run comes over (`ClientTelemetry.link`: a peer's is its own)."""
    disk = bool(run.tiers) and run.tiers[0] == TIER_DISK
    if run.local:
        return "local-disk" if disk else "local"
    return f"{'peer-disk' if disk else 'peer'}:{run.holder}"
