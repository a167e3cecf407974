"""Writes kvmesh.json, the Grafana dashboard for kvmesh's metrics (as Ray exports them to Prometheus: each
`kvmesh_*` metric appears as `ray_kvmesh_*`). Run after changing the panels: python cluster/grafana/make_dashboard.py"""

import json
from pathlib import Path

DS = {"type": "prometheus", "uid": "${datasource}"}


def panel(pid, title, exprs, unit="short", x=0, y=0, w=12, h=8, kind="timeseries"):
    return {"id": pid, "type": kind, "title": title, "datasource": DS, "gridPos": {"x": x, "y": y, "w": w, "h": h},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(65 + i), "datasource": DS, "expr": e, "legendFormat": legend}
                        for i, (e, legend) in enumerate(exprs)]}


panels = [
    panel(1, "Hit rate", [("sum(rate(ray_kvmesh_hits_total[1m])) / sum(rate(ray_kvmesh_lookups_total[1m]))",
                           "hit rate")], "percentunit", 0, 0),
    panel(2, "Misses by reason", [("sum by (reason) (rate(ray_kvmesh_misses_total[1m]))", "{{reason}}")],
          "ops", 12, 0),
    panel(3, "Prompt tokens: reused by source, and recomputed",
          [("sum by (source) (rate(ray_kvmesh_reused_tokens_total[1m]))", "reused ({{source}})"),
           ("sum(rate(ray_kvmesh_recomputed_tokens_total[1m]))", "recomputed")], "short", 0, 8),
    panel(4, "Traffic: bytes served by node to each reader",
          [("sum by (node, peer) (rate(ray_kvmesh_served_bytes_total[1m]))", "{{node}} -> {{peer}}")],
          "Bps", 12, 8),
    panel(5, "Bytes fetched by workers: source, holder's tier, destination",
          [("sum by (source, tier, dst) (rate(ray_kvmesh_fetched_bytes_total[1m]))", "{{source}} {{tier}} -> {{dst}}")],
          "Bps", 0, 16),
    panel(6, "Transfer latency (one fetch run)",
          [("histogram_quantile(0.5, sum by (le, source) (rate(ray_kvmesh_transfer_seconds_bucket[5m])))",
            "p50 {{source}}"),
           ("histogram_quantile(0.99, sum by (le, source) (rate(ray_kvmesh_transfer_seconds_bucket[5m])))",
            "p99 {{source}}")], "s", 12, 16),
    panel(7, "Directory round trip",
          [("histogram_quantile(0.5, sum by (le) (rate(ray_kvmesh_directory_rtt_seconds_bucket[5m])))", "p50"),
           ("histogram_quantile(0.99, sum by (le) (rate(ray_kvmesh_directory_rtt_seconds_bucket[5m])))", "p99")],
          "s", 0, 24),
    # (slots taken, not bytes: a chunk takes a whole slot whatever its size)
    panel(8, "Tier occupancy", [("sum by (node, tier) (ray_kvmesh_tier_chunks) / "
                                 "sum by (node, tier) (ray_kvmesh_tier_slots)", "{{node}} {{tier}}")],
          "percentunit", 12, 24),
    panel(9, "Tier contents", [("sum by (tier) (ray_kvmesh_tier_used_bytes)", "used {{tier}}"),
                               ("sum by (tier) (ray_kvmesh_tier_capacity_bytes)", "capacity {{tier}}"),
                               ("sum by (tier) (ray_kvmesh_tier_chunks)", "chunks {{tier}}")], "bytes", 0, 32),
    panel(10, "Evictions, demotions, promotions, drops",
          [("sum by (tier) (rate(ray_kvmesh_evictions_total[1m]))", "evictions from {{tier}}"),
           ("sum(rate(ray_kvmesh_demotions_total[1m]))", "demotions"),
           ("sum(rate(ray_kvmesh_promotions_total[1m]))", "promotions"),
           ("sum(rate(ray_kvmesh_drops_total[1m]))", "drops"),
           ("sum(rate(ray_kvmesh_stored_chunks_total[1m]))", "stored")], "ops", 12, 32),
    panel(11, "Failures: pulls by cause, corrupt chunks, disk errors",
          [("sum by (cause) (rate(ray_kvmesh_pull_failures_total[5m]))", "pull {{cause}}"),
           ("sum(rate(ray_kvmesh_corrupt_chunks_total[5m]))", "corrupt chunks"),
           ("sum by (errno) (rate(ray_kvmesh_disk_errors_total[5m]))", "disk {{errno}}")], "ops", 0, 40, 24),
    panel(12, "Moves between tiers (demotions, promotions, disk hits)",
          [("sum by (src, dst) (rate(ray_kvmesh_tier_moved_bytes_total[1m]))", "{{src}} -> {{dst}}")], "Bps", 0, 48),
    panel(13, "Chunks moved between tiers",
          [("sum by (src, dst) (rate(ray_kvmesh_tier_moves_total[1m]))", "{{src}} -> {{dst}}")], "ops", 12, 48),
    panel(14, "Hot-prefix replicas kept per node",
          [("sum by (node) (ray_kvmesh_replicated_bytes)", "{{node}}")], "bytes", 0, 56),
    panel(15, "Replication: chunks kept, and refused by reason",
          [("sum(rate(ray_kvmesh_replications_total[1m]))", "kept"),
           ("sum by (reason) (rate(ray_kvmesh_replication_refused_total[1m]))", "refused ({{reason}})")],
          "ops", 12, 56),
    panel(16, "Cluster eviction: last copies saved (disk, handoff) and handoff outcomes",
          [("sum by (how) (rate(ray_kvmesh_saved_last_copies_total[5m]))", "saved ({{how}})"),
           ("sum by (outcome) (rate(ray_kvmesh_handoffs_total[5m]))", "handoff {{outcome}}")], "ops", 0, 64),
    panel(17, "Bytes handed to peers by cluster eviction",
          [("sum by (node) (rate(ray_kvmesh_handoff_bytes_total[5m]))", "{{node}}")], "Bps", 12, 64),
]

dashboard = {
    "uid": "kvmesh", "title": "kvmesh", "tags": ["kvmesh", "ray"], "timezone": "browser", "schemaVersion": 39,
    "version": 1, "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
    "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}]},
    "panels": panels,
}

if __name__ == "__main__":
    out = Path(__file__).with_name("kvmesh.json")
    out.write_text(json.dumps(dashboard, indent=2) + "\n")
    print(f"wrote {out}")
