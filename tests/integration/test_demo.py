"""The main job, end to end, as a user runs it (small settings to keep CI short)."""

import subprocess
import sys


def service_pids() -> set[int]:
    r = subprocess.run(["pgrep", "-f", "redis-server|raylet|gcs_server|kvmesh-"], capture_output=True, text=True)
    return {int(p) for p in r.stdout.split()}


def test_kvmesh_demo_runs_and_cleans_up(tmp_path):
    out = tmp_path / "demo.json"
    before = service_pids()
    cmd = [sys.executable, "-m", "kvmesh.cli", "demo", "--nodes", "3", "--docs", "2", "--questions", "3",
           "--doc-tokens", "512", "--chunk-tokens", "64", "--hidden-size", "128", "--layers", "2",
           "--new-tokens", "4", "--cpu-mib", "64", "--threads", "1", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert service_pids() - before == set(), "the demo left processes running"
    for row in ("requests", "prefix tokens reused", "from a peer node", "tokens recomputed",
                "wall time without kvmesh", "wall time with kvmesh", "output check"):
        assert row in r.stdout
    import json

    s = json.loads(out.read_text())
    assert s["requests"] == 6 and s["outputs_identical"] is True
    assert s["reused_peer_tokens"] > 0 and s["reused_tokens"] == s["reused_local_tokens"] + s["reused_peer_tokens"]
    # 2 documents x 3 questions: every request after a document's first reuses its 512 tokens
    assert s["reused_tokens"] == 4 * 512
    help_ = subprocess.run([sys.executable, "-m", "kvmesh.cli", "demo", "--help"], capture_output=True, text=True)
    assert help_.returncode == 0 and "--nodes" in help_.stdout
