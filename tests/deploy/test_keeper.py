"""cluster/kvmesh_keeper.py (the chart's head keeper, also run by bare-metal.sh and ray-up.yaml) against a real Ray
cluster of raylets on 127.0.0.1 and a real redis-server: a KVNode on every node, then on a node that joins later;
the live page it serves shows them; SIGTERM stops it cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from kvmesh.local import LocalRayCluster, RedisServer, free_port
from tests.conftest import wait_until
from tests.deploy.conftest import ROOT

MiB = 1 << 20


def live_nodes(url: str) -> set[str]:
    try:
        with urllib.request.urlopen(url + "api/state", timeout=5) as r:
            state = json.loads(r.read())
    except OSError:
        return set()
    return {n["node_id"] for n in state.get("nodes", []) if n.get("alive")}


@pytest.mark.timeout(240)
def test_keeper_places_kvnodes_on_nodes_that_join_later():
    import kvmesh

    with RedisServer() as redis_server:
        cluster = LocalRayCluster(2, num_cpus=1, object_store_bytes=80 * MiB)
        keeper = None
        try:
            port = free_port()
            env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")},
                   "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "KVMESH_REDIS_URL": redis_server.url,
                   "KVMESH_KEY_PREFIX": "keeper-test", "KVMESH_CPU_BYTES": "16MiB", "KVMESH_SLOT_BYTES": "1MiB"}
            keeper = subprocess.Popen(
                [sys.executable, str(ROOT / "cluster" / "kvmesh_keeper.py"), "--address", cluster.address,
                 "--interval", "1", "--dashboard-port", str(port)], env=env, cwd=ROOT,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            page = f"http://127.0.0.1:{port}/"
            first = set(cluster.node_ids())
            wait_until(lambda: live_nodes(page) >= first or keeper.poll() is not None, 120, 0.5)
            assert keeper.poll() is None, keeper.stdout.read()
            assert live_nodes(page) == first
            with urllib.request.urlopen(page, timeout=5) as r:
                assert r.status == 200 and b"kvmesh" in r.read()
            node = cluster.add_node(num_cpus=1, object_store_bytes=80 * MiB)
            wait_until(lambda: node.node_id in live_nodes(page) or keeper.poll() is not None, 90, 0.5)
            assert live_nodes(page) == first | {node.node_id}
            assert set(kvmesh.mesh.node_actors()) == first | {node.node_id}  # one KVNode per node, no more
            keeper.send_signal(signal.SIGTERM)
            assert keeper.wait(timeout=60) == 0
            out = keeper.stdout.read()
            assert "KVNodes on 2 of 2" in out and "KVNodes on 3 of 3" in out, out
        finally:
            if keeper and keeper.poll() is None:
                keeper.kill()
                keeper.wait()
            try:
                kvmesh.stop()
            finally:
                cluster.shutdown()
