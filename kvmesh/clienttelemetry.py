"""`ClientTelemetry`: what a client counts and learns. Its counters (`counts`), its cost model (`cost`, learned from
its fetches), the latency samples and failure events its exporter drains, and the exporter itself. The client's
parts (lookups, stores, the local attachment) count through it; `share(other)` makes an engine's clients (one per
LoRA adapter or KV cache group) report as one."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvmesh.cost import CostModel, LinkModel, LoadPlan, measure_memcpy_bps
from kvmesh.directory import Holder
from kvmesh.match import FetchStats, link_observations
from kvmesh.telemetry import ClientExporter
from kvmesh.tiers import TIER_DISK, TIER_NAMES

if TYPE_CHECKING:
    import torch

    from kvmesh.match import Match
    from kvmesh.spec import KVSpec


def default_cost() -> CostModel:
    """sources: "local" = this node's slab (calibrated here), "peer" = another node (learned from pulls)"""
    return CostModel(
        {
            "local": LinkModel(measure_memcpy_bps() / 2, 1e-3),
            "peer": LinkModel(1e9, 2e-3),
            "local-disk": LinkModel(5e8, 5e-3),
            "peer-disk": LinkModel(4e8, 6e-3),
        }
    )


class ClientTelemetry:
    def __init__(self, exporter: ClientExporter, spec: KVSpec, node_id: str | None, count_fetches: bool) -> None:
        self.counts: Counter[str] = Counter()
        self.cost = default_cost()
        self.exporter = exporter
        self.spec, self.node_id = spec, node_id
        self.count_fetches = count_fetches  # whether a fetch counts its tokens as reused (record_request says why)
        self.samples: list = []  # (kind, source, seconds) for the latency histograms, drained by the exporter
        self.events: list = []  # (kind, reason, detail) failures for the live page, drained by the exporter
        self._errors_counted = 0  # of the view's errors, added to counts["directory_errors_total"] so far

    def share(self, other: ClientTelemetry, cost: bool = False) -> None:
        """Count into `other`'s counters from now on, through its exporter, so that each change is exported once
        (each client exported every change of the shared counters, its own and the others'). The parts that count
        through this one (stores included) follow. `cost`: learn into `other`'s cost model too (an adapter barely
        changes the prefill and not the links)."""
        self.counts = other.counts
        self.exporter = other.exporter
        if cost:
            self.cost = other.cost

    def flush(self, view_errors: int) -> None:
        """Export what changed. `view_errors`: the client's view's directory error count (a delta is counted:
        clients that share counts each have their own view and its own error count)."""
        samples, self.samples = self.samples, []
        events, self.events = self.events, []
        self.counts["directory_errors_total"] += view_errors - self._errors_counted
        self._errors_counted = view_errors
        self.exporter.flush(self.counts, samples, events)

    def link(self, holder: Holder) -> str:
        """The link a chunk comes over, for the cost model: this node or a peer (each its own: one slow peer does
        not make the plan recompute what a fast one holds), and whether from its disk."""
        if holder.node_id == self.node_id:
            return "local-disk" if holder.tier == TIER_DISK else "local"
        return f"{'peer-disk' if holder.tier == TIER_DISK else 'peer'}:{holder.node_id}"

    def plan(self, match: Match, prompt_tokens: int, allow_split: bool, count: bool) -> LoadPlan:
        """The cost model's plan for `match` in a prompt of `prompt_tokens` tokens (`KVMeshClient.plan`)."""
        links = [self.link(ch.holders[0]) for ch in match.chunks]
        s = self.spec
        plan = self.cost.plan(prompt_tokens, s.chunk_tokens, s.chunk_bytes, links, allow_split=allow_split)
        if count:
            self.counts[f"plan_{plan.reason.replace(' ', '_')}"] += 1
        return plan

    def record_request(self, reused_local: int, reused_peer: int, recomputed: int) -> None:
        """See `KVMeshClient.record_request`: reuse is counted here only when fetches do not count it."""
        if not self.count_fetches:
            self.counts["reused_tokens_local"] += reused_local
            self.counts["reused_tokens_peer"] += reused_peer
        self.counts["recomputed_tokens"] += recomputed

    def record_fetch(self, match: Match, st: FetchStats, device: torch.device) -> None:
        """Metrics at the edge: counters, the live page's events, the cost model's link observations."""
        counts, spec = self.counts, self.spec
        cb, got, n = spec.chunk_bytes, st.chunks, match.num_chunks
        counts["fetched_chunks_local"] += st.local_chunks
        counts["fetched_chunks_gpu_tier_d2d"] += st.gpu_chunks
        counts["fetched_chunks_peer"] += st.peer_chunks
        counts["fetched_bytes_local"] += st.local_chunks * cb
        counts["fetched_bytes_peer"] += st.peer_chunks * cb
        if device.type != "cpu":
            counts["fetched_chunks_to_device"] += got
        if self.count_fetches and spec.tp_rank == 0:  # (every TP rank fetches its shard of the same tokens)
            counts["reused_tokens_local"] += st.local_chunks * spec.chunk_tokens
            counts["reused_tokens_peer"] += st.peer_chunks * spec.chunk_tokens
        for c in match.chunks[:got]:  # by the holder the lookup named first (the one a fetch tries first)
            h = c.holders[0]
            source = "local" if h.node_id == self.node_id else "peer"
            counts[f"fetched_bytes:{source}:{TIER_NAMES[h.tier]}:{device.type}"] += cb
        for link, nbytes, seconds in link_observations(st.runs, cb):
            self.cost.observe_transfer(link, nbytes, seconds)
            self.samples.append(("transfer", link.split(":")[0], seconds))  # (metrics: by kind of link)
        if st.corrupt:
            counts["fetch_checksum_failures"] += st.corrupt
        if got < n:
            counts["fetch_truncated"] += 1
            counts[f"miss_{st.error}"] += 1
            counts[f"pull_failure_{st.error}"] += 1
            self.events.append(("fetch_truncated", st.error, f"{got} of {n} chunks"))
