"""The live page, in a real headless Chromium, shows numbers from the running cluster."""

import json
import os
import shutil
import subprocess
import urllib.request

import pytest
import torch

import kvmesh
from kvmesh import KVSpec
from kvmesh.dashboard import Dashboard
from tests.conftest import wait_until
from tests.integration.conftest import on_node

SPEC = KVSpec("dashboard", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
         "--no-first-run", "--disable-component-update", "--disable-sync"]


def chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


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


def test_live_page_shows_the_running_cluster(mesh, tmp_path):
    browser = chromium()
    if browser is None:
        pytest.skip("no Chromium on this machine (make test installs Debian's chromium)")
    a, b = mesh.node_ids[:2]
    on_node(a, w_traffic, True, 1)
    on_node(b, w_traffic, False, 1)
    dash = Dashboard(mesh.config.redis_url, "it").start()
    try:
        def ready():
            s = dash.state()
            return s if s.get("lookups") and s.get("traffic") else None
        state = wait_until(ready, 10)
        api = json.load(urllib.request.urlopen(dash.url + "api/state"))
        assert api["lookups"] == state["lookups"] and len(api["nodes"]) >= 3
        env = dict(os.environ, HOME=str(tmp_path))
        dom = subprocess.run([browser, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                              "--virtual-time-budget=5000", "--dump-dom", dash.url],
                             capture_output=True, text=True, timeout=120, env=env).stdout
        assert "kvmesh" in dom and "connecting" not in dom, dom[:2000]
        for node in api["nodes"]:
            assert node["node_id"][:10] in dom  # every node, with its state
        assert f"{api['lookups']:,}" in dom  # the live lookup count from the cluster
        assert "alive" in dom and "not cached" in dom  # liveness, and a miss with its reason
        assert any(t["bytes"] > 0 for t in api["traffic"]) and "KiB" in dom  # traffic between nodes
        shot = tmp_path / "page.png"
        subprocess.run([browser, *FLAGS, f"--user-data-dir={tmp_path / 'profile2'}", "--virtual-time-budget=5000",
                        "--window-size=1400,1100", f"--screenshot={shot}", dash.url],
                       capture_output=True, timeout=120, env=env)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
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
