"""A KVNode's stats, typed (`NodeStats`), and its telemetry edge (`Telemetry`). The snapshot becomes a dict only
at the edges: the wire (`KVNode.stats()`, what the actor and `LocalHandle` return) and telemetry (the live page's
record in Redis, Ray metrics). Its keys are what the dashboard, the CLI, tests and benchmarks read.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis

from kvmesh.cascade import Cascade
from kvmesh.lastcopy import LastCopies
from kvmesh.replication import Replicas
from kvmesh.serving import Serving
from kvmesh.telemetry import RayExporter, Records, export_node_stats
from kvmesh.tiers import TIER_NAMES

MAX_PENDING_EVENTS = 200  # live-page events kept while Redis is away (it keeps the last 200 anyway)


@dataclass
class NodeStats:
    node_id: str
    incarnation: int
    fenced: bool
    counts: dict[str, int]  # the node's counters and the cascade's (each counted in one place)
    evictions_by_tier: dict[str, int]
    tier_flows: list  # [from, to, chunks, bytes] per route between this node's tiers
    chunks: int  # in the CPU slab
    used_bytes: int
    capacity_bytes: int  # (less the slots /dev/shm has no memory for now: a peer handing a chunk off looks for room)
    free_bytes: int  # (in free slots: what a handoff looks for; see SlotPool.free_bytes)
    pinned: int
    slab_devsums_queued: int
    slab_unbacked_refusals: int
    slab_unbacked_slots: int
    disk: dict[str, Any]  # disk_* gauges, where there is a disk tier
    gpu: dict[str, Any]  # gpu_* gauges, where there is a GPU tier
    tiers: list[dict]
    last_copies: dict[str, int]
    replicated_chunks: int
    replicated_bytes: int
    transient_chunks: int
    served_bytes: dict[str, int]
    top_prefixes: list
    pid: int = field(default_factory=os.getpid)
    time: float = field(default_factory=time.time)

    @classmethod
    def collect(
        cls,
        node_id: str,
        incarnation: int,
        fenced: bool,
        counts: Counter,
        cascade: Cascade,
        serving: Serving,
        devsums_queued: int,
        disk_pending_io: int,
        last_copies: LastCopies,
        replicas: Replicas,
    ) -> NodeStats:
        """Caller holds the node's lock."""
        c, cpu, disk, gpu = cascade, cascade.cpu, cascade.disk, cascade.gpu
        disk_gauges: dict[str, Any] = {}
        if disk is not None:
            disk_gauges = dict(
                disk_chunks=len(disk),
                disk_used_bytes=disk.used_bytes,
                disk_capacity_bytes=(disk.num_slots - disk.unbacked_slots) * disk.slot_bytes,
                disk_free_bytes=disk.free_bytes,
                disk_unbacked_slots=disk.unbacked_slots,
                disk_direct_io=disk.direct_io,
                disk_pending_io=disk_pending_io,  # (queued, and those an I/O thread is doing)
            )
        gpu_gauges: dict[str, Any] = {}
        if gpu is not None:
            gpu_gauges = dict(
                gpu_chunks=len(gpu), gpu_used_bytes=gpu.used_bytes, gpu_capacity_bytes=gpu.num_slots * gpu.slot_bytes
            )
        tiers = [
            {
                "tier": TIER_NAMES[t.tier_id],
                "chunks": len(t),
                "used_bytes": t.used_bytes,
                "capacity_bytes": (t.num_slots - t.unbacked_slots) * t.slot_bytes,
                # a chunk takes a whole slot whatever its size: how full a tier is (what evicts) is chunks of
                # slots, not bytes of capacity (a tier full of a small model's chunks holds few bytes)
                "slots": t.num_slots - t.unbacked_slots,
            }
            for t in c.tiers()
        ]
        return cls(
            node_id=node_id,
            incarnation=incarnation,
            fenced=fenced,
            counts={**counts, **c.counts},
            evictions_by_tier=dict(c.evictions),
            tier_flows=[[src, dst, n, c.flow_bytes[(src, dst)]] for (src, dst), n in c.flows.items()],
            chunks=len(cpu),
            used_bytes=cpu.used_bytes,
            capacity_bytes=(cpu.num_slots - cpu.unbacked_slots) * cpu.slot_bytes,
            free_bytes=cpu.free_bytes,
            pinned=serving.pinned_chunks(),
            slab_devsums_queued=devsums_queued,
            slab_unbacked_refusals=cpu.unbacked_refusals,
            slab_unbacked_slots=cpu.unbacked_slots,
            disk=disk_gauges,
            gpu=gpu_gauges,
            tiers=tiers,
            last_copies=dict(last_copies.counts),
            replicated_chunks=replicas.replicated_chunks,
            replicated_bytes=replicas.replicated_bytes,
            transient_chunks=replicas.transient_chunks,
            served_bytes=dict(serving.served),
            top_prefixes=[[g.hex(), n] for g, n in serving.group_hits.most_common(10)],
        )

    @property
    def saved_last_copies(self) -> int:
        return self.last_copies["last_copy_saved_disk"] + self.counts.get("handoff_ok", 0)

    def as_dict(self) -> dict[str, Any]:
        """The wire and telemetry form (the keys `KVNode.stats()` always had)."""
        d: dict[str, Any] = dict(self.counts)
        d.update(
            evictions=sum(self.evictions_by_tier.values()),
            evictions_by_tier=self.evictions_by_tier,
            tier_flows=self.tier_flows,
            node_id=self.node_id,
            pid=self.pid,
            incarnation=self.incarnation,
            chunks=self.chunks,
            used_bytes=self.used_bytes,
            capacity_bytes=self.capacity_bytes,
            free_bytes=self.free_bytes,
            pinned=self.pinned,
            fenced=self.fenced,
            slab_devsums_queued=self.slab_devsums_queued,
            slab_unbacked_refusals=self.slab_unbacked_refusals,
            slab_unbacked_slots=self.slab_unbacked_slots,
        )
        d.update(self.disk, **self.gpu)
        d["tiers"] = self.tiers
        d.update(self.last_copies)
        d["saved_last_copies"] = self.saved_last_copies
        d.update(
            replicated_chunks=self.replicated_chunks,
            replicated_bytes=self.replicated_bytes,
            transient_chunks=self.transient_chunks,
            served_bytes=self.served_bytes,
            top_prefixes=self.top_prefixes,
            time=self.time,
        )
        return d


class Telemetry:
    """The node's telemetry edge, on its maintenance thread: each round's stats snapshot to Redis (the live page)
    and to Ray metrics (counter deltas from the previous snapshot), and the live page's events, kept (at most
    MAX_PENDING_EVENTS) while Redis is away."""

    def __init__(self, records: Records, node_id: str) -> None:
        self.records, self.node_id = records, node_id
        self.ray_metrics = RayExporter()
        self._last: dict = {}
        self._events: list[tuple[str, str, str]] = []

    def event(self, kind: str, reason: str, detail: str = "") -> None:
        if len(self._events) < MAX_PENDING_EVENTS:  # (Redis away: the live page keeps no more than that)
            self._events.append((kind, reason, detail))

    def publish(self, stats: dict) -> None:
        export_node_stats(self.ray_metrics, self.node_id, stats, self._last)
        self._last = stats
        try:
            self.records.node_stats(self.node_id, stats)
            events, self._events = self._events, []
            for kind, reason, detail in events:
                self.records.event(self.node_id, kind, reason, detail)
        except redis.RedisError:
            pass
