"""`Fetcher`: runs a fetch through the pipeline, for a worker's client or for a KVNode's pull-through.

    fetch(chunks, sink, options) -> (result, FetchStats)

1. plan: `planner.plan_runs` (runs by holder, peer runs in batches);
2. pick each run's source: this node's slab for its own chunks; for other nodes', the local node (`coalesce`,
   "via"), the holder's DataServer ("tcp") or its actor ("ray");
3. begin every run at once: pins and pulls go out together, receives run on pool threads, so runs from different
   holders (and batches of one holder) proceed in parallel into their own places in the sink;
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

    @property
    def local_reads(self) -> bool:
        return self.env.slab is not None and self.env.local is not None

    def kind(self, run: Run, opts: FetchOptions) -> str:
        if run.local:
            return "slab"
        if opts.coalesce and opts.group and self.local_reads:
            return "via"
        return opts.transport

    def fetch(self, chunks: Sequence, sink, opts: FetchOptions):
        t0 = time.monotonic()
        env = self.env
        orphans = getattr(env.local, "orphans", None)
        if orphans is not None:
            orphans.reap()  # pins of earlier fetches that came after their deadline
        runs = plan_runs(chunks, env.here or None, self.local_reads, opts.per_batch) if chunks else []
        kinds = [self.kind(r, opts) for r in runs]
        sink.prepare([i for r, k in zip(runs, kinds) if k in ("tcp", "ray") for i in range(r.start, r.end)])
        transfers: list[sources.Transfer] = []
        delivered, error, corrupt, device = 0, "", 0, 0
        stats: list[RunStats] = []
        try:
            for r, k in zip(runs, kinds):
                if time.monotonic() >= opts.deadline:  # (beginning a run can wait: a holder's address, a pin)
                    transfers.append(sources.Failed(r, sink, k, "deadline"))
                    continue
                transfers.append(
                    sources.begin(env, r, k, sink, opts.chunk_bytes, opts.deadline, opts.group, opts.transport)
                )
            for t in transfers:
                landed = t.complete(opts.deadline)
                stats.append(RunStats(t.kind, _link(t.run), len(t.run.keys), landed.delivered, time.monotonic() - t0))
                delivered += landed.delivered
                corrupt += landed.corrupt
                device += landed.device
                if landed.delivered < len(t.run.keys):
                    error = landed.error or "peer_error"
                    break
        finally:
            for t in transfers:
                t.release()
        result = sink.finish(delivered)
        local = sum(s.delivered for s in stats if s.source == "slab")
        return result, FetchStats(
            local, delivered - local, time.monotonic() - t0, error, len(chunks), corrupt, tuple(stats), device
        )


def _link(run: Run) -> str:
    """The cost model's name for the link a run comes over."""
    where = "local" if run.local else "peer"
    return f"{where}-disk" if run.tiers and run.tiers[0] == TIER_DISK else where
