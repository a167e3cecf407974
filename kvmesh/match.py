"""Named results of the client's calls: what a lookup found (`Match`), what a fetch did (`FetchStats`; with its KV,
`Fetched`) and what a store did (`StoreResult`). Integrations read these, not counter deltas."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvmesh.cost import LoadPlan
from kvmesh.directory import Holder
from kvmesh.tiers import TIER_NAMES

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class ChunkMatch:
    hash: bytes
    holders: tuple[Holder, ...]  # live holders, the preferred one (this node first, then by tier) first

    @property
    def node_id(self) -> str:
        return self.holders[0].node_id

    @property
    def tier(self) -> str:
        return TIER_NAMES[self.holders[0].tier]


@dataclass(frozen=True, slots=True)
class Match:
    """The longest cached prefix of a prompt, in whole chunks: chunks [start, start + len(chunks)) of it."""

    namespace: bytes  # spec namespace the lookup was made for
    chunk_tokens: int
    chunks: tuple[ChunkMatch, ...]
    plan: LoadPlan | None = None  # the cost model's advice for this prompt, with its reason
    start: int = 0  # index of the first chunk (non-zero only for a part selected with `select`)
    why: str = ""  # why the match ends where it does: "" (the whole prompt's full chunks), "not_cached",
    # "holder_dead", "spec_mismatch" (another spec of this model has the prefix), "directory_error"
    group: bytes = b""  # the directory group of the prompt (its first chunk's hash): where pulled chunks register

    @property
    def num_tokens(self) -> int:
        return len(self.chunks) * self.chunk_tokens

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def truncate(self, num_chunks: int) -> Match:
        """The first `num_chunks` chunks of this match (all of them if it has fewer)."""
        num_chunks = _check_index("num_chunks", num_chunks)
        return replace(self, chunks=self.chunks[:num_chunks], plan=None)

    def select(self, first: int, end: int) -> Match:
        """Chunks [first, end) of this match (e.g. the part a split plan loads), 0 <= first <= end <= num_chunks:
        a range outside the match raises ValueError (a slice would shift `start` off the chunks it names)."""
        first, end = _check_index("first", first), _check_index("end", end)
        if not first <= end <= len(self.chunks):
            raise ValueError(f"select({first}, {end}) of a {len(self.chunks)}-chunk match: need first <= end <= that")
        return replace(self, chunks=self.chunks[first:end], start=self.start + first, plan=None)


def _check_index(name: str, value) -> int:
    """`value` as an int (numpy's integers too); TypeError for a bool or a non-integer, ValueError below 0."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class RunStats:
    """One run of a fetch: chunks asked of one holder through one source."""

    source: str  # "slab" (this node's shared memory), "via" (pulled through this node), "tcp", "ray"
    link: str  # the cost model's link: "local", "local-disk", "peer:<node id>", "peer-disk:<node id>"
    asked: int
    delivered: int
    seconds: float  # its own time (fetcher._timing): not what it waited on the runs before it
    error: str = ""  # why it ended short ("deadline", "not_held", ...), "" when it delivered all it was asked
    start: float = 0.0  # when its own time began, from the fetch's start


@dataclass(frozen=True, slots=True)
class FetchStats:
    """What one fetch did."""

    local_chunks: int  # delivered from this node's tiers
    peer_chunks: int  # delivered from other nodes (directly or pulled through this node)
    seconds: float
    # why it stopped short, "" if not: "not_held" (the holder no longer has the chunk: evicted since the lookup, or
    # dropped as corrupt or unreadable on its own disk or GPU tier), "checksum", "deadline", "peer_error",
    # "holder_unknown" (no address for it), "stale_slab" (this node restarted since the lookup), "gpu_unreachable"
    error: str = ""
    asked: int = 0  # chunks in the match
    corrupt: int = 0  # chunks that failed their checksum (reported to their holder)
    runs: tuple[RunStats, ...] = ()
    gpu_chunks: int = 0  # of the local chunks, those read device to device from the node's GPU tier (CUDA IPC)
    adopted_chunks: int = 0  # of the local chunks, slab slots a device sink read in place (DMA, no host copy)

    @property
    def chunks(self) -> int:
        return self.local_chunks + self.peer_chunks


@dataclass(frozen=True, slots=True)
class Fetched:
    """A fetch's KV with its own stats (`KVMeshClient.fetch_with_stats`): unlike `last_fetch`, which the client's
    latest fetch of any thread overwrites, these are this fetch's, whoever else fetches meanwhile."""

    kv: torch.Tensor
    stats: FetchStats


@dataclass(frozen=True, slots=True)
class StoreResult:
    """What one store did: of the full chunks given, how many were handed to the node, how many were already
    cached, and how many were dropped (too many stores in flight, or no node on this Ray node). `stored`: of the
    handed chunks, those the node stored and registered, where the store was waited for (`store_keys_waited`);
    None where it was not."""

    handed: int
    cached: int = 0
    dropped: int = 0
    reason: str = ""  # why chunks were dropped: "busy", "no_device_memory", "no_local_node"
    stored: int | None = None

    @property
    def ok(self) -> bool:
        """Every chunk given is cached now or on its way: none dropped, and (where waited for) the node refused
        none of those it received."""
        return self.dropped == 0 and (self.stored is None or self.stored == self.handed)


def link_observations(runs: Sequence[RunStats], chunk_bytes: int) -> list[tuple[str, int, float]]:
    """(link, bytes, seconds) per link of one fetch, for the cost model: the bytes each link delivered, in the span
    of its runs' own times (from the first one's start to the last one's end: a peer's batches run at once, on
    several threads, and the link took that long for them all, not the sum). A run its deadline cut short counts
    the bytes it was asked in the time it waited: the link is at least that slow, and a hung peer must not be
    planned again for every request (each of which would wait out its deadline, then recompute anyway)."""
    per: dict[str, tuple[int, float, float]] = {}
    for r in runs:
        n = r.asked if r.error == "deadline" else r.delivered
        if n <= 0 or r.seconds <= 0:
            continue
        nbytes, first, last = per.get(r.link, (0, math.inf, 0.0))
        per[r.link] = (nbytes + n * chunk_bytes, min(first, r.start), max(last, r.start + r.seconds))
    return [(link, nbytes, last - first) for link, (nbytes, first, last) in per.items()]
