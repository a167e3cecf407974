"""`plan_runs`: the chunks of a match as runs of consecutive chunks from one holder. Pure.

A chunk comes from this node when it holds it (and the caller can read this node's slab), else from the holder of
the previous chunk when that one has it too (fewer, longer runs), else from its first-listed holder (the lookup
sorts holders by tier). Runs from another node are split into batches of at most `per_batch` chunks: batches are
separate requests that proceed in parallel and pipeline. A run from this node is one run, or windows of at most
`local_batch` chunks where one is given (a fetch larger than the slab can pin at once). Runs cover chunks 0..n-1 in
order, with no gaps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.directory import Holder
from kvmesh.wire import MAX_KEYS


@dataclass(frozen=True, slots=True)
class Run:
    holder: str  # node id the run is read from
    start: int  # index of its first chunk in the match
    keys: tuple[bytes, ...]
    tiers: tuple[int, ...]  # the holder's tier for each chunk (for the cost model and the metrics)
    local: bool  # the holder is the caller's own node
    incarnation: int = 0  # the holder's incarnation the lookup named (0: unknown)

    @property
    def end(self) -> int:
        return self.start + len(self.keys)

    @property
    def indices(self) -> range:
        """The indices of its chunks in the match."""
        return range(self.start, self.end)


def plan_runs(
    chunks: Sequence, here: str | None, local_reads: bool, per_batch: int, local_batch: int | None = None
) -> list[Run]:
    """`chunks`: items with `.hash` and `.holders` (a `Match`'s chunks). `here`: the caller's node id;
    `local_reads`: whether chunks held here can be read here (a worker with this node's slab mapped)."""
    if per_batch < 1:
        raise ValueError(f"per_batch must be at least 1, got {per_batch}")
    if local_batch is not None and local_batch < 1:
        raise ValueError(f"local_batch must be at least 1, got {local_batch}")
    # (a run is one message to its node: never more chunks than a message may name)
    per_batch = min(per_batch, MAX_KEYS)
    local_cap = min(local_batch or len(chunks), MAX_KEYS)
    runs: list[list] = []  # [holder, start, keys, tiers, incarnation]
    prev: str | None = None
    for i, ch in enumerate(chunks):
        holders: tuple[Holder, ...] = ch.holders
        assert holders, "a matched chunk has a holder"
        by_node = {h.node_id: h for h in holders}
        if local_reads and here in by_node:
            pick = here
        elif prev in by_node:
            pick = prev
        else:
            pick = holders[0].node_id
        last = runs[-1] if runs else None
        cap = local_cap if pick == here and local_reads else per_batch
        if last is not None and last[0] == pick and len(last[2]) < cap:
            last[2].append(ch.hash)
            last[3].append(by_node[pick].tier)
        else:
            runs.append([pick, i, [ch.hash], [by_node[pick].tier], by_node[pick].incarnation])
        prev = pick
    return [Run(h, s, tuple(k), tuple(t), local_reads and h == here, inc) for h, s, k, t, inc in runs]
