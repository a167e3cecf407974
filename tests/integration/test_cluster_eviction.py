"""Cluster eviction on the real 3-node Ray cluster: the session's KVNodes are replaced, for this module, by ones
with 8-slot CPU tiers (node 0 also a disk tier) and a slow model's recompute cost, then put back as they were.
The last copy of a chunk other nodes read survives its eviction, on the node's disk or handed to a peer (a replica
too, once its original is gone); a chunk nobody else read, or of which another copy lives, is dropped as before; a
dead target makes a handoff a drop."""

import time

import pytest
import ray
import torch

import kvmesh
from kvmesh import KVSpec
from kvmesh.mesh import node_actors
from kvmesh.tiers import TIER_NAMES
from tests.conftest import wait_until
from tests.integration.conftest import on_node

SPEC = KVSpec("cluster-eviction", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)


def prompt(seed: int, n_chunks: int = 2) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 50_000, (SPEC.chunk_tokens * n_chunks,), generator=g).tolist()
    return toks, torch.randn(SPEC.kv_shape(len(toks)), generator=g).to(torch.bfloat16)


def w_store(*seeds: int) -> int:
    c = kvmesh.connect(SPEC)
    try:
        n = 0
        for seed in seeds:
            toks, kv = prompt(seed, 2 if seed < 1000 else 4)
            c.store(toks, kv)
            n += c.flush()
        return n
    finally:
        c.close()


def w_read(seed: int, coalesce: bool = False) -> tuple[bool, int]:
    toks, kv = prompt(seed)
    c = kvmesh.connect(SPEC, coalesce_pulls=coalesce)
    try:
        got = c.fetch(c.lookup(toks, cost_model=False))
        return torch.equal(got.view(torch.int16), kv[:, :, :got.shape[2]].view(torch.int16)), got.shape[2] // 32
    finally:
        c.close()


def w_where(seed: int) -> list[list[tuple[str, str]]]:
    toks, _ = prompt(seed)
    c = kvmesh.connect(SPEC)
    try:
        return [sorted((h.node_id, TIER_NAMES[h.tier]) for h in ch.holders)
                for ch in c.lookup(toks, cost_model=False).chunks]
    finally:
        c.close()


def restart_nodes(config) -> None:
    for a in node_actors().values():
        ray.kill(a, no_restart=True)
    wait_until(lambda: not node_actors(), 30)
    kvmesh.start(config=config)


@pytest.fixture(scope="module")
def nodes(mesh, tmp_path_factory):
    slot = mesh.config.slot_bytes
    cfg = mesh.config.replace(key_prefix="ce", cpu_bytes=8 * slot, lease_s=6.0, recompute_bytes_per_s=1 << 20)
    restart_nodes(cfg)
    a = mesh.node_ids[0]
    try:
        ray.kill(node_actors()[a], no_restart=True)  # node 0 again, with a disk tier
        wait_until(lambda: a not in node_actors(), 30)
        kvmesh.start(config=cfg.replace(disk_bytes=32 * slot, disk_dir=str(tmp_path_factory.mktemp("ce-disk"))))
        wait_until(lambda: a in node_actors(), 30)
        yield mesh.node_ids
    finally:
        restart_nodes(mesh.config)


_fill = iter(range(1000, 100_000, 3))


def fill(node: str) -> float:
    """Store 12 fresh chunks on `node` (its CPU tier holds 8): everything stored there before is evicted."""
    t0 = time.monotonic()
    seed = next(_fill)
    assert on_node(node, w_store, seed, seed + 1, seed + 2) == 12
    return time.monotonic() - t0


def stats(node_id: str) -> dict:
    return ray.get(node_actors()[node_id].stats.remote(), timeout=30)


def test_the_last_copy_others_read_is_handed_to_a_peer_and_an_unread_one_dropped(nodes):
    a, b, c = nodes
    assert on_node(b, w_store, 10, 11) == 4
    assert on_node(c, w_read, 10) == (True, 2)  # node 2 reads group 10 from node 1; nobody reads group 11
    fill(b)
    wait_until(lambda: stats(b).get("handoff_ok", 0) == 2, 15)
    where = on_node(c, w_where, 10)
    assert len(where) == 2 and all(b not in {n for n, _ in w} and w for w in where)
    assert on_node(c, w_read, 10) == (True, 2)  # from its new holder, bit-exact
    assert on_node(c, w_where, 11) == []  # dropped as before
    s = stats(b)
    assert s["handoffs_queued"] == 2 and s["saved_last_copies"] == 2


def test_a_chunk_with_a_replica_elsewhere_is_dropped_normally(nodes):
    a, b, c = nodes
    before = stats(b)
    assert on_node(b, w_store, 20) == 2
    assert on_node(c, w_read, 20, True) == (True, 2)  # through node 2's KVNode, which keeps a replica
    wait_until(lambda: all(c in {n for n, _ in w} for w in on_node(c, w_where, 20)), 10)
    fill(b)
    wait_until(lambda: stats(b).get("handoff_not_last", 0) == before.get("handoff_not_last", 0) + 2, 15)
    assert stats(b).get("handoff_ok", 0) == before.get("handoff_ok", 0)
    assert [{n for n, _ in w} for w in on_node(a, w_where, 20)] == [{c}, {c}]
    assert on_node(a, w_read, 20) == (True, 2)  # node 0 now reads the replica, the cluster's last copy
    # ... which is handed off in its turn, not dropped as "a replica" (its original went above)
    ok = stats(c).get("handoff_ok", 0)
    fill(c)
    wait_until(lambda: stats(c).get("handoff_ok", 0) == ok + 2, 15)
    where = on_node(a, w_where, 20)
    assert len(where) == 2 and all(w and c not in {n for n, _ in w} for w in where)
    assert on_node(a, w_read, 20) == (True, 2)


def test_the_last_copy_others_read_survives_on_the_node_s_own_disk(nodes):
    a, b, c = nodes
    assert on_node(a, w_store, 30) == 2
    assert on_node(c, w_read, 30) == (True, 2)
    fill(a)
    wait_until(lambda: on_node(c, w_where, 30) == [[(a, "disk")]] * 2, 15)
    assert stats(a)["last_copy_saved_disk"] >= 2 and stats(a).get("handoff_ok", 0) == 0
    assert on_node(c, w_read, 30) == (True, 2)


def test_a_dead_handoff_target_makes_it_a_drop_without_holding_up_eviction(nodes):
    a, b, c = nodes
    assert on_node(b, w_store, 40) == 2
    assert on_node(c, w_read, 40) == (True, 2)
    before = stats(b)
    for n in (a, c):  # both possible targets die; their leases still look live for a few seconds
        ray.kill(node_actors()[n], no_restart=True)
    assert fill(b) < 10
    wait_until(lambda: stats(b).get("handoff_failed", 0) == before.get("handoff_failed", 0) + 2, 15)
    assert stats(b).get("handoff_ok", 0) == before.get("handoff_ok", 0)
    assert on_node(b, w_where, 40) == []
