"""The live page's data and the metrics it comes from (the page itself, in Chromium, is tested with the demo in
test_demo.py)."""

import json
import urllib.request

import torch

import kvmesh
from kvmesh import KVSpec
from kvmesh.dashboard import Dashboard
from tests.conftest import wait_until
from tests.integration.conftest import on_node

SPEC = KVSpec("dashboard", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)


def w_traffic(store: bool, seed: int) -> int:
    c = kvmesh.connect(SPEC)
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 50_000, (32 * 4 + 10,), generator=g).tolist()  # 4 full chunks + 10 tokens
    if store:
        c.store(toks, torch.randn(SPEC.kv_shape(len(toks)), generator=g).to(torch.bfloat16))
        c.flush()
    else:
        m = c.lookup(toks)
        c.fetch(m)
        c.record_request(0, m.num_tokens, len(toks) - m.num_tokens)
        c.lookup(toks[::-1])  # and a miss
    c.close()  # flushes its telemetry
    return 0


def test_the_page_and_its_messages_never_show_the_redis_password():
    dash = Dashboard("redis://kv:s3cret-pw@127.0.0.1:1/0", "it")  # nothing listens there
    try:
        dash._sample()
        state = json.dumps(dash.state())
        assert "unreachable" in state and "s3cret-pw" not in state and "kv:***@" in state
    finally:
        dash.stop()


def test_metrics_reach_rays_prometheus_endpoint(mesh):
    """What Grafana plots is really exported: scrape the Ray nodes' metrics endpoints after some traffic."""
    import ray

    a, b = mesh.node_ids[:2]
    on_node(a, w_traffic, True, 2)
    on_node(b, w_traffic, False, 2)
    ports = [n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]]

    want = {"ray_kvmesh_lookups_total", "ray_kvmesh_hits_total", "ray_kvmesh_misses_total",
            "ray_kvmesh_reused_tokens_total", "ray_kvmesh_recomputed_tokens_total", "ray_kvmesh_tier_used_bytes",
            "ray_kvmesh_tier_capacity_bytes", "ray_kvmesh_served_bytes_total", "ray_kvmesh_transfer_seconds_bucket",
            "ray_kvmesh_directory_rtt_seconds_bucket"}
    seen: set = set()

    def scraped():
        for port in ports:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                continue
            seen.update(line.split("{")[0].split(" ")[0] for line in text.splitlines()
                        if line.startswith("ray_kvmesh_"))
        return want <= seen
    try:
        wait_until(scraped, 60, interval_s=2)
    except AssertionError:
        raise AssertionError(f"not exported: {sorted(want - seen)}") from None
