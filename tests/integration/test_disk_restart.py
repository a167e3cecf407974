"""A real Ray node whose KVNode is killed with SIGKILL while it writes to its disk tier, restarted by Ray on the
same node: it recovers what is intact on disk under a new incarnation, and nothing torn is ever served."""

import os
import signal

import ray
import torch

import kvmesh
from kvmesh import KVSpec
from kvmesh.mesh import node_actors
from tests.conftest import wait_until
from tests.integration.conftest import on_node

SPEC = KVSpec("disk-restart", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)


def prompt(i: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, 50_000, (32 * 6,), generator=g).tolist()


def kv(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + i)
    return torch.randn(SPEC.kv_shape(32 * 6), generator=g).to(torch.bfloat16)


def w_store_many(first: int, n: int) -> int:
    c = kvmesh.connect(SPEC)
    handed = sum(c.store(prompt(i), kv(i)) for i in range(first, first + n))  # no flush: the node is killed meanwhile
    c.close()
    return handed


def w_fetch_all(n: int) -> list[tuple[int, bool]]:
    c = kvmesh.connect(SPEC)
    out = []
    for i in range(n):
        got = c.fetch(c.lookup(prompt(i)))
        out.append((got.shape[2], torch.equal(got, kv(i)[:, :, :got.shape[2]])))
    c.close()
    return out


def test_kvnode_killed_mid_write_comes_back_with_only_intact_chunks(mesh, ray_cluster, tmp_path):
    node = ray_cluster.add_node(num_cpus=1)
    kvmesh.start(mesh.config.redis_url, key_prefix="it", cpu_bytes=4 * SPEC.chunk_bytes,
                     slot_bytes=SPEC.chunk_bytes, disk_dir=str(tmp_path), disk_bytes=256 * SPEC.chunk_bytes,
                     write_policy="write_through")
    d = node.node_id
    actor = node_actors()[d]
    before = ray.get(actor.stats.remote())
    assert before["disk_capacity_bytes"] == 256 * SPEC.chunk_bytes
    # kill it while disk writes are queued or running (stores land in the CPU tier first; write-through goes on in
    # the background): look, and store more until the node reports writes in flight
    stored = on_node(d, w_store_many, 0, 30)  # a first batch that reaches the disk in full
    wait_until(lambda: ray.get(actor.stats.remote())["disk_pending_io"] == 0, 30)
    for batch in range(1, 10):
        stored += on_node(d, w_store_many, 30 * batch, 30)
        if ray.get(actor.stats.remote())["disk_pending_io"] > 0:
            os.kill(before["pid"], signal.SIGKILL)
            break
    else:
        raise AssertionError("never saw a disk write in flight")
    assert stored > 0
    # Ray restarts the actor on its node; the new process recovers the disk tier under a new incarnation
    after = wait_until(lambda: _stats(actor, before["pid"]), 60, interval_s=0.5)
    assert after["incarnation"] != before["incarnation"]
    wait_until(lambda: _stats(actor, before["pid"])["disk_pending_io"] == 0, 30)
    after = ray.get(actor.stats.remote())
    assert after["disk_recovered"] > 0  # something survived, and was verified before being registered
    a = mesh.node_ids[0]
    results = on_node(a, w_fetch_all, 30 * (batch + 1))
    assert all(intact for _n, intact in results), "a fetched chunk differs from what was stored"
    assert sum(n for n, _ in results) > 0
    ray.get(actor.check_integrity.remote(False))
    # the session's cluster goes back to its three nodes (a later module places one replica per node)
    ray.kill(actor, no_restart=True)
    wait_until(lambda: d not in node_actors(), 30)
    ray_cluster.remove_node(node, graceful=True)


def _stats(actor, old_pid):
    try:
        s = ray.get(actor.stats.remote(), timeout=5)
    except Exception:
        return None
    return s if s["pid"] != old_pid else None
