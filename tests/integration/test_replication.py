"""Hot-prefix replication on the real 3-node Ray cluster: the session's KVNodes are replaced, for this module, by
ones that keep a pulled group only once 2 distinct nodes pulled it (and at most 6 chunks of replicas each), then
put back as they were. A group stored on node 0 is read through pull-throughs (`coalesce_pulls`) by nodes 1 and 2."""

import pytest
import ray
import torch

import kvmesh
from kvmesh import KVSpec
from kvmesh.mesh import node_actors
from tests.conftest import wait_until
from tests.integration.conftest import on_node

SPEC = KVSpec("replication", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)
CHUNK = SPEC.chunk_bytes
BOUND_CHUNKS = 6


def prompt(seed: int, n_chunks: int = 4) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 50_000, (SPEC.chunk_tokens * n_chunks,), generator=g).tolist()
    return toks, torch.randn(SPEC.kv_shape(len(toks)), generator=g).to(torch.bfloat16)


def w_store(seed: int) -> int:
    toks, kv = prompt(seed)
    c = kvmesh.connect(SPEC)
    try:
        c.store(toks, kv)
        return c.flush()
    finally:
        c.close()


def w_read(seed: int) -> tuple[bool, int, int, list[list[str]]]:
    """Fetch the prompt through this node's KVNode: (bit-exact, chunks, local chunks, each chunk's holders as the
    lookup saw them)."""
    toks, kv = prompt(seed)
    c = kvmesh.connect(SPEC, coalesce_pulls=True)
    try:
        m = c.lookup(toks, cost_model=False)
        got = c.fetch(m)
        n = got.shape[2] // SPEC.chunk_tokens
        exact = torch.equal(got.view(torch.int16), kv[:, :, :got.shape[2]].view(torch.int16))
        return exact, n, c.last_fetch.local_chunks, [sorted(h.node_id for h in ch.holders) for ch in m.chunks]
    finally:
        c.close()


def w_holders(seed: int) -> list[list[str]]:
    toks, _ = prompt(seed)
    c = kvmesh.connect(SPEC)
    try:
        return [sorted(h.node_id for h in ch.holders) for ch in c.lookup(toks, cost_model=False).chunks]
    finally:
        c.close()


def restart_nodes(config) -> None:
    actors = node_actors()
    for a in actors.values():
        ray.kill(a, no_restart=True)
    wait_until(lambda: not node_actors(), 30)
    kvmesh.start(config=config)


@pytest.fixture(scope="module")
def rep(mesh):
    cfg = mesh.config.replace(key_prefix="rep", replicate_min_readers=2, replicate_window_s=60.0,
                              replicate_max_bytes=BOUND_CHUNKS * CHUNK)
    restart_nodes(cfg)
    try:
        yield mesh.node_ids
    finally:
        restart_nodes(mesh.config)


def stats(node_id: str) -> dict:
    return ray.get(node_actors()[node_id].stats.remote(), timeout=30)


def no_transients(node_id: str) -> bool:
    s = stats(node_id)
    return s["transient_chunks"] == 0 and s["pinned"] == 0


def test_a_group_pulled_by_two_nodes_is_replicated_on_both_and_bit_exact(rep):
    a, b, c = rep
    assert on_node(a, w_store, 1) == 4
    # node 1 is the group's first reader: its pull serves the read, and nothing is kept
    exact, n, local, holders = on_node(b, w_read, 1)
    assert exact and n == 4 and local == 0 and holders == [[a]] * 4
    wait_until(lambda: no_transients(b), 10)
    s = stats(b)
    assert s["replicated_chunks"] == 0 and s["replication_refused_cold"] == 4 and s["chunks"] == 0
    assert on_node(a, w_holders, 1) == [[a]] * 4
    # node 2 makes two distinct readers: it keeps its copy, registered
    exact, n, local, _ = on_node(c, w_read, 1)
    assert exact and n == 4
    wait_until(lambda: on_node(a, w_holders, 1) == [sorted([a, c])] * 4, 10)
    # node 1 reads again: still two readers in the window, so now it keeps its copy too
    exact, n, _, _ = on_node(b, w_read, 1)
    assert exact and n == 4
    wait_until(lambda: on_node(a, w_holders, 1) == [sorted([a, b, c])] * 4, 10)
    for node in (b, c):
        s = stats(node)
        assert s["replicated_chunks"] == 4 and s["replicated_bytes"] == 4 * CHUNK and s["transient_chunks"] == 0
    # and their readers now read it from their own node, bit-exact
    exact, n, local, _ = on_node(b, w_read, 1)
    assert exact and n == 4 and local == 4


def test_replicas_stay_within_the_byte_bound(rep):
    a, b, c = rep
    assert on_node(a, w_store, 2) == 4
    before = {n: stats(n)["replicated_bytes"] for n in (b, c)}
    for reader in (b, c, b):
        exact, n, _, _ = on_node(reader, w_read, 2)
        assert exact and n == 4
    for node in (b, c):
        wait_until(lambda node=node: no_transients(node), 10)
        s = stats(node)
        assert s["replicated_bytes"] <= BOUND_CHUNKS * CHUNK
        kept = (s["replicated_bytes"] - before[node]) // CHUNK
        assert kept == min(4, BOUND_CHUNKS - before[node] // CHUNK)
        assert s["replication_refused_bytes"] >= 4 - kept
    # the leading chunks are the ones kept: what is listed is still a prefix on each node
    holders = on_node(a, w_holders, 2)
    assert [h.count(b) for h in holders] == sorted([h.count(b) for h in holders], reverse=True)
    assert all(a in h for h in holders)
