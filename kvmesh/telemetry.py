"""Telemetry at the edges: the core keeps plain counters (`client.counts`, `KVNode.stats()`); exporters here turn
them into Ray metrics (Prometheus and the Ray dashboard's metrics view) and into the small records in Redis that
kvmesh's live page reads. Nothing here is on a request's path: exporters run on the existing background threads.

Redis records (same `{n}` hash tag as the node table; sizes are bounded):

    P:{n}:stats     hash  node_id -> msgpack KVNode stats snapshot (tiers, counts, traffic, top prefixes)
    P:{n}:totals    hash  counter -> cluster-wide total, HINCRBY'd by every client
    P:{n}:events    list  msgpack [ts, node, kind, reason, detail], newest first, trimmed to EVENTS_KEPT
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import msgpack
import redis

log = logging.getLogger("kvmesh.telemetry")
EVENTS_KEPT = 200

# Every metric kvmesh exports, with its kind, tag keys and meaning. The Grafana dashboard may only use these.
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "kvmesh_lookups_total": ("counter", ("node",), "prefix lookups"),
    "kvmesh_hits_total": ("counter", ("node",), "lookups that found a usable cached prefix"),
    "kvmesh_misses_total": (
        "counter",
        ("node", "reason"),
        "lookups or fetches that fell back to recompute, by reason: not_cached, holder_dead, "
        "spec_mismatch, directory_error, cost_model (lookups); not_held, deadline, checksum, peer_error, "
        "holder_unknown, stale_slab, gpu_unreachable (fetches cut short)",
    ),
    "kvmesh_reused_tokens_total": (
        "counter",
        ("node", "source"),
        "prompt tokens whose KV was reused (local, peer): fetched, or reported by vLLM's connector",
    ),
    "kvmesh_recomputed_tokens_total": ("counter", ("node",), "prompt tokens prefilled"),
    "kvmesh_fetched_bytes_total": (
        "counter",
        ("node", "source", "tier", "dst"),
        "bytes fetched by workers: source local|peer, the holder's tier, the destination device type (cpu, cuda)",
    ),
    "kvmesh_transfer_seconds": ("histogram", ("node", "source"), "time of one fetch run (a batch of chunks)"),
    "kvmesh_directory_rtt_seconds": ("histogram", ("node",), "directory lookup round trip"),
    "kvmesh_pull_failures_total": ("counter", ("node", "cause"), "failed pulls by cause"),
    "kvmesh_stored_chunks_total": ("counter", ("node",), "chunks stored into the node's tiers"),
    "kvmesh_served_bytes_total": ("counter", ("node", "peer"), "bytes a node served, by requesting node"),
    "kvmesh_evictions_total": ("counter", ("node", "tier"), "chunks evicted from a tier"),
    "kvmesh_tier_moves_total": (
        "counter",
        ("node", "src", "dst"),
        "chunks copied between a node's tiers (demotions gpu->cpu, cpu->disk; promotions "
        "cpu->gpu; disk hits disk->cpu)",
    ),
    "kvmesh_tier_moved_bytes_total": ("counter", ("node", "src", "dst"), "bytes copied between a node's tiers"),
    "kvmesh_demotions_total": ("counter", ("node",), "chunks moved down a tier instead of dropped"),
    "kvmesh_promotions_total": ("counter", ("node",), "chunks copied up a tier on a hit"),
    "kvmesh_drops_total": ("counter", ("node",), "chunks that left the node"),
    "kvmesh_corrupt_chunks_total": ("counter", ("node",), "chunks dropped for failing their checksum"),
    "kvmesh_disk_errors_total": ("counter", ("node", "errno"), "failed disk writes and reads"),
    "kvmesh_tier_capacity_bytes": ("gauge", ("node", "tier"), "capacity of a tier"),
    "kvmesh_tier_used_bytes": ("gauge", ("node", "tier"), "bytes held in a tier"),
    "kvmesh_tier_chunks": ("gauge", ("node", "tier"), "chunks held in a tier"),
    "kvmesh_tier_slots": ("gauge", ("node", "tier"), "chunks a tier can hold (one a slot, whatever its size)"),
    "kvmesh_replicated_bytes": ("gauge", ("node",), "bytes of hot-prefix replicas a node keeps (pulled, registered)"),
    "kvmesh_replicated_chunks": ("gauge", ("node",), "hot-prefix replica chunks a node keeps"),
    "kvmesh_replications_total": ("counter", ("node",), "chunks a node's pull-throughs kept as replicas"),
    "kvmesh_replication_refused_total": (
        "counter",
        ("node", "reason"),
        "pulled chunks not kept as replicas, by reason: cold (fewer distinct "
        "readers than replicate_min_readers), bytes (replicate_max_bytes reached)",
    ),
    "kvmesh_saved_last_copies_total": (
        "counter",
        ("node", "how"),
        "last copies of chunks other nodes read that eviction kept in the cluster: "
        "how disk (demoted to the node's disk) or handoff (pushed to a peer)",
    ),
    "kvmesh_handoffs_total": (
        "counter",
        ("node", "outcome"),
        "evicted last copies queued for a handoff, by outcome: ok, not_last (another node "
        "holds it), no_target, refused (the target did not store it), failed, busy (too many "
        "bytes waiting: dropped at once)",
    ),
    "kvmesh_handoff_bytes_total": ("counter", ("node",), "bytes handed to peers by cluster eviction"),
}

_HIST_BOUNDS = [0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0]


class RayExporter:
    """Ray metrics, created on first use; a no-op outside a Ray worker (or if Ray's metrics are unavailable)."""

    def __init__(self) -> None:
        self._m: dict[str, object] = {}
        self._ok: bool | None = None  # whether Ray's metrics can be used here; None: not known yet

    def _metric(self, name: str):
        if self._ok is None:
            try:
                import ray
                from ray.util import metrics  # noqa: F401 (imported only to learn whether Ray's metrics load here)

                self._ok = ray.is_initialized()
            except Exception:
                self._ok = False
        if not self._ok:
            return None
        m = self._m.get(name)
        if m is None:
            from ray.util import metrics

            kind, tags, desc = METRICS[name]
            if kind == "counter":
                m = metrics.Counter(name, description=desc, tag_keys=tags)
            elif kind == "gauge":
                m = metrics.Gauge(name, description=desc, tag_keys=tags)
            else:
                m = metrics.Histogram(name, description=desc, boundaries=_HIST_BOUNDS, tag_keys=tags)
            self._m[name] = m
        return m

    def inc(self, name: str, value: float, **tags) -> None:
        m = self._metric(name)
        if m is not None and value > 0:
            m.inc(value, tags={k: str(v) for k, v in tags.items()})

    def set(self, name: str, value: float, **tags) -> None:
        m = self._metric(name)
        if m is not None:
            m.set(value, tags={k: str(v) for k, v in tags.items()})

    def observe(self, name: str, value: float, **tags) -> None:
        m = self._metric(name)
        if m is not None:
            m.observe(value, tags={k: str(v) for k, v in tags.items()})


class Records:
    """The Redis side: what the live page reads."""

    def __init__(self, r: redis.Redis, prefix: str) -> None:
        self.r = r
        n = f"{prefix}:{{n}}"
        self.k_stats, self.k_totals, self.k_events = f"{n}:stats", f"{n}:totals", f"{n}:events"

    def event(self, node: str, kind: str, reason: str, detail: str = "", pipe=None) -> None:
        p = pipe or self.r.pipeline(transaction=False)
        p.lpush(self.k_events, msgpack.packb([time.time(), node, kind, reason, detail[:200]]))
        p.ltrim(self.k_events, 0, EVENTS_KEPT - 1)
        if pipe is None:
            p.execute()

    def add_totals(self, deltas: dict[str, int], pipe=None) -> None:
        p = pipe or self.r.pipeline(transaction=False)
        for k, v in deltas.items():
            if v:
                p.hincrby(self.k_totals, k, int(v))
        if pipe is None:
            p.execute()

    def node_stats(self, node: str, stats: dict) -> None:
        self.r.hset(self.k_stats, node, msgpack.packb(stats, use_bin_type=True))

    def read(self) -> tuple[dict, dict, list]:
        p = self.r.pipeline(transaction=False)
        p.hgetall(self.k_stats)
        p.hgetall(self.k_totals)
        p.lrange(self.k_events, 0, 99)
        stats, totals, events = p.execute()
        return (
            {k.decode(): msgpack.unpackb(v, raw=False) for k, v in stats.items()},
            {k.decode(): int(v) for k, v in totals.items()},
            [msgpack.unpackb(e, raw=False) for e in events],
        )


# client counter name -> (metric, tags) it feeds
CLIENT_EXPORTS = {
    "lookups": ("kvmesh_lookups_total", {}),
    "hits": ("kvmesh_hits_total", {}),
    "reused_tokens_local": ("kvmesh_reused_tokens_total", {"source": "local"}),
    "reused_tokens_peer": ("kvmesh_reused_tokens_total", {"source": "peer"}),
    "recomputed_tokens": ("kvmesh_recomputed_tokens_total", {}),
}


class ClientExporter:
    """Ships a client's counter deltas (and failure events) every interval, from the client's own thread."""

    def __init__(self, records: Records | None, node: str) -> None:
        self.records = records
        self.node = node or "driver"
        self.ray = RayExporter()
        self._last: Counter[str] = Counter()
        self._lock = threading.Lock()

    def flush(self, counts: Counter, samples: list, events: list) -> None:
        now = dict(counts)  # one copy (in C, under the GIL): other threads add counters while this runs
        with self._lock:
            deltas = {k: v - self._last.get(k, 0) for k, v in now.items() if v != self._last.get(k, 0)}
            self._last = Counter(now)
        for k, v in deltas.items():
            if k in CLIENT_EXPORTS:
                name, tags = CLIENT_EXPORTS[k]
                self.ray.inc(name, v, node=self.node, **tags)
            elif k.startswith("miss_"):
                self.ray.inc("kvmesh_misses_total", v, node=self.node, reason=k[5:])
            elif k.startswith("fetched_bytes:"):  # fetched_bytes:<source>:<tier>:<dst>
                _, source, tier, dst = k.split(":")
                self.ray.inc("kvmesh_fetched_bytes_total", v, node=self.node, source=source, tier=tier, dst=dst)
            elif k.startswith("pull_failure_"):
                self.ray.inc("kvmesh_pull_failures_total", v, node=self.node, cause=k[13:])
        for name, source, seconds in samples:
            if name == "transfer":
                self.ray.observe("kvmesh_transfer_seconds", seconds, node=self.node, source=source)
            else:
                self.ray.observe("kvmesh_directory_rtt_seconds", seconds, node=self.node)
        if self.records is None or not (deltas or events):
            return
        try:
            p = self.records.r.pipeline(transaction=False)
            self.records.add_totals({k: v for k, v in deltas.items() if v > 0}, pipe=p)
            for kind, reason, detail in events:
                self.records.event(self.node, kind, reason, detail, pipe=p)
            p.execute()
        except redis.RedisError as e:  # telemetry never gets in the way
            log.debug("telemetry flush failed: %s", e)


def export_node_stats(ray_exp: RayExporter, node: str, stats: dict, last: dict) -> None:
    """A KVNode's stats snapshot -> Ray gauges and counter deltas (`last` holds the previous snapshot)."""
    for tier, n in stats.get("evictions_by_tier", {}).items():
        ray_exp.inc("kvmesh_evictions_total", n - last.get("evictions_by_tier", {}).get(tier, 0), node=node, tier=tier)
    before = {(a, b): (n, nb) for a, b, n, nb in last.get("tier_flows", [])}
    for src, dst, n, nbytes in stats.get("tier_flows", []):
        n0, b0 = before.get((src, dst), (0, 0))
        ray_exp.inc("kvmesh_tier_moves_total", n - n0, node=node, src=src, dst=dst)
        ray_exp.inc("kvmesh_tier_moved_bytes_total", nbytes - b0, node=node, src=src, dst=dst)
    for name, key in (
        ("kvmesh_demotions_total", "demotions"),
        ("kvmesh_promotions_total", "promotions"),
        ("kvmesh_drops_total", "drops"),
        ("kvmesh_corrupt_chunks_total", "corrupt_dropped"),
        ("kvmesh_stored_chunks_total", "stored_chunks"),
    ):
        ray_exp.inc(name, stats.get(key, 0) - last.get(key, 0), node=node)
    ray_exp.inc(
        "kvmesh_replications_total",
        stats.get("replicated_chunks_added", 0) - last.get("replicated_chunks_added", 0),
        node=node,
    )
    for reason in ("cold", "bytes"):
        key = f"replication_refused_{reason}"
        ray_exp.inc("kvmesh_replication_refused_total", stats.get(key, 0) - last.get(key, 0), node=node, reason=reason)
    for how, key in (("disk", "last_copy_saved_disk"), ("handoff", "handoff_ok")):
        ray_exp.inc("kvmesh_saved_last_copies_total", stats.get(key, 0) - last.get(key, 0), node=node, how=how)
    for outcome in ("ok", "not_last", "no_target", "refused", "failed"):
        key = f"handoff_{outcome}"
        ray_exp.inc("kvmesh_handoffs_total", stats.get(key, 0) - last.get(key, 0), node=node, outcome=outcome)
    ray_exp.inc(
        "kvmesh_handoffs_total",
        stats.get("handoff_refused_busy", 0) - last.get("handoff_refused_busy", 0),
        node=node,
        outcome="busy",
    )
    ray_exp.inc("kvmesh_handoff_bytes_total", stats.get("handoff_bytes", 0) - last.get("handoff_bytes", 0), node=node)
    ray_exp.set("kvmesh_replicated_bytes", stats.get("replicated_bytes", 0), node=node)
    ray_exp.set("kvmesh_replicated_chunks", stats.get("replicated_chunks", 0), node=node)
    for tier in stats.get("tiers", []):
        ray_exp.set("kvmesh_tier_capacity_bytes", tier["capacity_bytes"], node=node, tier=tier["tier"])
        ray_exp.set("kvmesh_tier_used_bytes", tier["used_bytes"], node=node, tier=tier["tier"])
        ray_exp.set("kvmesh_tier_chunks", tier["chunks"], node=node, tier=tier["tier"])
        if "slots" in tier:  # (an earlier release's stats have none)
            ray_exp.set("kvmesh_tier_slots", tier["slots"], node=node, tier=tier["tier"])
    for peer, nbytes in stats.get("served_bytes", {}).items():
        prev = last.get("served_bytes", {}).get(peer, 0)  # (a reader forgotten, then back: counted from 0 again)
        ray_exp.inc("kvmesh_served_bytes_total", nbytes - prev if nbytes >= prev else nbytes, node=node, peer=peer)
    for key, v in stats.items():
        if key.startswith("disk_write_E") or key.startswith("disk_read_E"):
            ray_exp.inc("kvmesh_disk_errors_total", v - last.get(key, 0), node=node, errno=key.split("_")[-1])
