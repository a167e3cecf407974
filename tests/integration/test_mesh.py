"""The system on a real 3-node Ray cluster and a real redis-server: workers on different nodes share chunks."""

import os
import time

import numpy as np
import pytest
import ray
import torch

import kvmesh
from kvmesh import KVSpec
from kvmesh.mesh import node_actors
from kvmesh.wire import pack_keys, unpack_pin_reply
from tests.conftest import wait_until
from tests.integration.conftest import on_node


def spec(model="m", dtype="bfloat16", **kw) -> KVSpec:
    return KVSpec(model, num_layers=2, num_kv_heads=2, head_dim=16, dtype=dtype, chunk_tokens=32, **kw)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n,), generator=g).tolist()


def random_kv(s: KVSpec, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s.kv_shape(n), generator=g).to(s.torch_dtype)


# -- worker bodies (run inside Ray tasks on a chosen node) -------------------------------------------------------
def w_store(s, toks, kv, salt=None):
    c = kvmesh.connect(s, cache_salt=salt)
    n = c.store(toks, kv)
    stored = c.flush()
    c.close()
    return n, stored


def w_lookup(s, toks, salt=None):
    c = kvmesh.connect(s, cache_salt=salt)
    m = c.lookup(toks)
    c.close()
    return m


def w_fetch(s, toks, salt=None, deadline_s=None, transport="tcp"):
    c = kvmesh.connect(s, cache_salt=salt, peer_transport=transport)
    m = c.lookup(toks)
    kv = c.fetch(m, deadline_s=deadline_s)
    stats = c.last_fetch
    c.close()
    return m.num_tokens, kv, stats


def w_fetch_match(s, match, deadline_s):
    c = kvmesh.connect(s)
    t0 = time.monotonic()
    kv = c.fetch(match, deadline_s=deadline_s)
    c.close()
    return kv.shape[2], time.monotonic() - t0


def w_lookup_then_store(s, toks, kv):
    c = kvmesh.connect(s)
    m = c.lookup(toks)
    n = c.store(toks, kv)
    c.flush()
    counts = dict(c.counts)
    c.close()
    return m.num_tokens, n, counts


# -- tests ---------------------------------------------------------------------------------------------------------
def test_start_is_idempotent_with_one_kvnode_per_node(mesh, ray_cluster):
    # (earlier tests may have added nodes, and killed and revived KVNodes: compare with what runs now)
    first = kvmesh.start(mesh.config.redis_url, key_prefix="it")
    before = {n: h._actor_id for n, h in node_actors().items()}
    again = kvmesh.start(mesh.config.redis_url, key_prefix="it")
    assert sorted(first.node_ids) == sorted(again.node_ids) == sorted(ray_cluster.node_ids())
    # the same actor processes, not new ones (an incarnation may move on if a lease lapsed under load; the actor
    # and its data listener do not)
    assert {n: h._actor_id for n, h in node_actors().items()} == before
    addr = {n.node_id: n.data_addr for n in again.nodes}
    assert all(addr[n.node_id] == n.data_addr for n in first.nodes)
    assert sorted(node_actors()) == sorted(ray_cluster.node_ids())


def test_start_again_with_another_directory_is_refused_naming_it(mesh):
    # before: the KVNodes that ran kept their directory, nodes added since got the new one, and the returned Mesh
    # claimed the new one for all: a cache split in two without a word
    before = {n: ray.get(h.stats.remote(), timeout=30)["incarnation"] for n, h in node_actors().items()}
    with pytest.raises(ValueError, match="key_prefix"):
        kvmesh.start(mesh.config.redis_url, key_prefix="another-prefix")
    other_db = mesh.config.redis_url.rsplit("/", 1)[0] + "/3"
    with pytest.raises(ValueError, match="redis_url"):
        kvmesh.start(other_db, key_prefix=mesh.config.key_prefix)
    assert {n: ray.get(h.stats.remote(), timeout=30)["incarnation"] for n, h in node_actors().items()} == before


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_chunk_stored_on_node_a_is_fetched_bit_exact_on_node_b(mesh, dtype):
    a, b, _ = mesh.node_ids
    s = spec(f"bitexact-{dtype}", dtype)
    toks = tokens(32 * 5 + 7, seed=1)  # 5 full chunks and a partial one
    kv = random_kv(s, len(toks), seed=2)
    assert on_node(a, w_store, s, toks, kv) == (5, 5)
    for transport in ("tcp", "ray"):  # the KVNodes' TCP data servers, and Ray's object store
        n, got, stats = on_node(b, w_fetch, s, toks, transport=transport)
        assert n == 160 and stats.peer_chunks == 5 and stats.local_chunks == 0
        assert got.dtype == kv.dtype
        assert torch.equal(got.view(torch.uint8), kv[:, :, :160].contiguous().view(torch.uint8))
    # a worker on the holder's own node reads the same bytes through shared memory
    n, got, stats = on_node(a, w_fetch, s, toks)
    assert stats.local_chunks == 5 and torch.equal(got, kv[:, :, :160])
    # storing again stores nothing: every chunk is cached somewhere
    assert on_node(b, w_store, s, toks, kv) == (0, 0)


def test_longer_prompt_reuses_the_shared_prefix_and_stores_only_new_chunks(mesh):
    a, b, c = mesh.node_ids
    s = spec("prefix")
    doc = tokens(32 * 4, seed=3)
    q1, q2 = doc + tokens(64, seed=4), doc + tokens(64, seed=5)
    on_node(a, w_store, s, q1, random_kv(s, len(q1), 6))
    m = on_node(c, w_lookup, s, q2)
    assert m.num_tokens == 128 and {ch.node_id for ch in m.chunks} == {a}
    assert on_node(b, w_store, s, q2, random_kv(s, len(q2), 7)) == (2, 2)
    m = on_node(c, w_lookup, s, q2)
    assert m.num_tokens == 192 and [ch.node_id for ch in m.chunks] == [a] * 4 + [b] * 2
    n, got, stats = on_node(c, w_fetch, s, q2)
    assert n == 192 and got.shape[2] == 192 and stats.peer_chunks == 6


def test_other_model_dtype_or_salt_misses(mesh):
    a, b, _ = mesh.node_ids
    base = spec("tenant-model", "bfloat16")
    toks = tokens(32 * 3, seed=8)
    on_node(a, w_store, base, toks, random_kv(base, len(toks), 9), salt="tenant-1")
    assert on_node(b, w_lookup, base, toks, salt="tenant-1").num_tokens == 96
    assert on_node(b, w_lookup, base, toks, salt="tenant-2").num_tokens == 0
    assert on_node(b, w_lookup, base, toks).num_tokens == 0
    assert on_node(b, w_lookup, spec("tenant-model@rev2", "bfloat16"), toks, salt="tenant-1").num_tokens == 0
    assert on_node(b, w_lookup, spec("tenant-model", "float16"), toks, salt="tenant-1").num_tokens == 0
    assert on_node(b, w_lookup, spec("tenant-model", "bfloat16", lora_id="a"), toks, salt="tenant-1").num_tokens == 0


def corrupt_chunk(mesh, node_id: str, s: KVSpec, toks, index: int) -> None:
    """Flip a byte of one chunk in the node's shared-memory slab, as a memory error would."""
    c = kvmesh.connect(s)  # the driver, only to compute hashes
    key = c.hashes(toks)[index]
    c.close()
    actor = node_actors()[node_id]
    pin_id, rows, path, _ = unpack_pin_reply(ray.get(actor.pin.remote(pack_keys([key]))))
    ray.get(actor.unpin.remote(pin_id))
    with open(path, "r+b") as f:
        f.seek(rows[0].slot * mesh.config.slot_bytes + 1000)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))


def test_a_corrupted_chunk_is_never_served(mesh):
    a, b, _ = mesh.node_ids
    dropped_before = ray.get(node_actors()[a].stats.remote()).get("corrupt_dropped", 0)  # the mesh is shared
    s = spec("corrupt")
    toks = tokens(32 * 6, seed=10)
    kv = random_kv(s, len(toks), 11)
    on_node(a, w_store, s, toks, kv)
    corrupt_chunk(mesh, a, s, toks, 3)
    n, got, _ = on_node(b, w_fetch, s, toks)  # peer pull over TCP: the receiver checks, the holder re-verifies
    assert n == 192 and got.shape[2] == 96 and torch.equal(got, kv[:, :, :96])
    wait_until(lambda: on_node(b, w_lookup, s, toks).num_tokens == 96, 5)  # and it was unregistered
    corrupt_chunk(mesh, a, s, toks, 2)
    n, got, _ = on_node(b, w_fetch, s, toks, transport="ray")  # through Ray: the holder checks before sending
    assert n == 96 and got.shape[2] == 64 and torch.equal(got, kv[:, :, :64])
    wait_until(lambda: on_node(b, w_lookup, s, toks).num_tokens == 64, 5)
    corrupt_chunk(mesh, a, s, toks, 1)
    n, got, stats = on_node(a, w_fetch, s, toks)  # same-node read: the reader checks what it copied
    assert n == 64 and got.shape[2] == 32 and torch.equal(got, kv[:, :, :32])
    wait_until(lambda: on_node(b, w_lookup, s, toks).num_tokens == 32, 5)
    assert ray.get(node_actors()[a].stats.remote())["corrupt_dropped"] - dropped_before == 3


def test_bad_inputs_raise_typed_errors(mesh):
    s = spec("bad-inputs")
    with pytest.raises(TypeError, match="spec"):
        kvmesh.connect("not a spec")
    with pytest.raises(ValueError, match="chunk_tokens"):
        kvmesh.connect(KVSpec("big", 64, 8, 128, "float32", chunk_tokens=256))
    c = kvmesh.connect(s)
    try:
        for bad in ("abc", 3.0, [1.5], {"a": 1}, None):
            with pytest.raises(TypeError, match="tokens"):
                c.lookup(bad)
        with pytest.raises(ValueError, match="tokens"):
            c.lookup([-5])
        toks = tokens(64, seed=12)
        with pytest.raises(TypeError, match="kv"):
            c.store(toks, "kv")
        with pytest.raises(ValueError, match="kv"):
            c.store(toks, torch.zeros(s.kv_shape(64), dtype=torch.float16))  # wrong dtype
        with pytest.raises(ValueError, match="kv"):
            c.store(toks, torch.zeros((2, 2, 64, 3, 16), dtype=torch.bfloat16))  # wrong heads
        with pytest.raises(ValueError, match="kv"):
            c.store(toks, torch.zeros(s.kv_shape(10), dtype=torch.bfloat16))  # fewer tokens than tokens
        with pytest.raises(TypeError, match="match"):
            c.fetch([1, 2, 3])
        other = kvmesh.connect(spec("bad-inputs-2"))
        with pytest.raises(ValueError, match="KVSpec"):
            c.fetch(other.lookup(toks))
        other.close()
        for deadline in (-1, 0, float("inf"), float("nan"), 1e12):  # (inf once overflowed a wait, uncaught)
            with pytest.raises(ValueError, match="deadline_s"):
                c.fetch(c.lookup(toks), deadline_s=deadline)
        for device in ("bogus", None, "meta"):  # (and "cuda" on a machine without CUDA)
            with pytest.raises(ValueError, match="device"):
                c.fetch(c.lookup(toks), device=device)
        with pytest.raises(TypeError, match="cache_salt"):
            c.lookup(toks, cache_salt=12)
        # tensors without data, or not dense (once a NotImplementedError or RuntimeError from deep inside)
        with pytest.raises(ValueError, match="tokens"):
            c.lookup(torch.tensor(toks).to("meta"))
        for kv in (torch.zeros(s.kv_shape(64), dtype=torch.bfloat16, device="meta"),
                   torch.zeros(s.kv_shape(64), dtype=torch.bfloat16).to_sparse()):
            with pytest.raises(ValueError, match="kv"):
                c.store(toks, kv)
        assert c.lookup(toks, max_chunks=np.int64(1)).num_chunks <= 1
        for timeout in (-1, float("nan"), "soon"):
            with pytest.raises(ValueError, match="timeout_s"):
                c.flush(timeout)
    finally:
        c.close()


def test_a_kvnode_that_cannot_start_is_said_in_one_line(mesh, ray_cluster, tmp_path):
    # before: Ray's ActorDiedError, the KVNode's own error buried in a traceback of its creation task
    (tmp_path / "file").write_text("x")
    node = ray_cluster.add_node(num_cpus=1)
    try:
        with pytest.raises(RuntimeError, match=f"{node.node_id[:8]}.*NotADirectoryError"):
            kvmesh.start(config=mesh.config.replace(disk_dir=str(tmp_path / "file" / "sub"), disk_bytes=1 << 20))
    finally:
        ray_cluster.remove_node(node)
    wait_until(lambda: node.node_id not in node_actors(), 30)


def test_removed_node_truncates_planned_fetches_and_is_dropped_after_its_lease(mesh, ray_cluster):
    node = ray_cluster.add_node(num_cpus=1)
    m2 = kvmesh.start(mesh.config.redis_url, key_prefix="it")  # idempotent: adds a KVNode on the new node only
    d = node.node_id
    assert d in m2.node_ids and sorted(m2.node_ids) == sorted(ray_cluster.node_ids())
    a = mesh.node_ids[0]
    s = spec("removed")
    doc = tokens(32 * 3, seed=13)
    toks = doc + tokens(32 * 3, seed=14)
    kv = random_kv(s, len(toks), 15)
    on_node(a, w_store, s, doc, kv[:, :, :96])
    on_node(d, w_store, s, toks, kv)  # D holds chunks 3..5 only
    match = on_node(a, w_lookup, s, toks)
    assert [ch.node_id for ch in match.chunks] == [a] * 3 + [d] * 3
    pid = ray.get(node_actors()[d].stats.remote())["pid"]
    ray_cluster.remove_node(node)
    wait_until(lambda: not pid_alive(pid), 30)  # its processes die with the raylet, not all at the same instant
    n, took = on_node(a, w_fetch_match, s, match, 3.0)
    assert n == 96 and took < 5.0  # the prefix held by the live node, no hang, no exception
    lease = mesh.config.lease_s
    t0 = time.monotonic()
    wait_until(lambda: on_node(a, w_lookup, s, toks).num_tokens == 96, 2 * lease + 2)
    assert time.monotonic() - t0 <= 2 * lease + 2


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_redis_restart_empty_never_returns_stale_holders_and_the_directory_rebuilds(mesh, redis_server):
    a, b, _ = mesh.node_ids
    s = spec("redis-restart")
    toks = tokens(32 * 4, seed=16)
    kv = random_kv(s, len(toks), 17)
    on_node(a, w_store, s, toks, kv)
    before = ray.get(node_actors()[a].stats.remote())["incarnation"]
    redis_server.restart()
    m = on_node(b, w_lookup, s, toks)
    after = ray.get(node_actors()[a].stats.remote())["incarnation"]
    # either nothing, or entries registered by the node's new incarnation: never the old one
    assert all(h.incarnation != before for ch in m.chunks for h in ch.holders)
    assert all(h.incarnation == after for ch in m.chunks for h in ch.holders)
    wait_until(lambda: on_node(b, w_lookup, s, toks).num_tokens == 128, 10)
    n, got, _ = on_node(b, w_fetch, s, toks)
    assert torch.equal(got, kv)
    assert ray.get(node_actors()[a].stats.remote())["incarnation"] != before


def test_a_kvnode_that_dies_while_the_directory_is_away_comes_back_once_it_answers(mesh, redis_server):
    # Ray restarts the actor at once, and its creation met no directory: a creation that fails is never retried,
    # whatever max_restarts says, so the node had no KVNode for good, even once Redis was back
    import signal

    a, b, _ = mesh.node_ids
    actor = node_actors()[a]
    pid = ray.get(actor.stats.remote(), timeout=30)["pid"]
    redis_server.kill()
    try:
        os.kill(pid, signal.SIGKILL)
        time.sleep(3.0)  # (the restart is under way meanwhile, and waits)
    finally:
        redis_server.start()

    def up():
        try:
            return ray.get(actor.stats.remote(), timeout=5)["pid"] != pid
        except Exception:
            return False

    wait_until(up, 60, 0.5)
    s = spec("restart-without-directory")
    toks = tokens(32 * 3, seed=77)
    kv = random_kv(s, len(toks), 78)
    on_node(a, w_store, s, toks, kv)
    wait_until(lambda: on_node(b, w_lookup, s, toks).num_tokens == 96, 10)
    n, got, _ = on_node(b, w_fetch, s, toks)
    assert n == 96 and torch.equal(got, kv)


def test_a_store_after_its_lookup_needs_no_directory_round_trip(mesh):
    a, b, _ = mesh.node_ids
    s = spec("lookup-then-store")
    toks = tokens(32 * 5, seed=40)
    kv = random_kv(s, len(toks), 41)
    on_node(a, w_store, s, toks[:64], kv[:, :, :64])  # the first 2 chunks are cached on A
    cached, stored, counts = on_node(b, w_lookup_then_store, s, toks, kv)
    assert cached == 64 and stored == 3  # B stores only the 3 chunks its lookup saw missing
    assert counts["store_checked_by_lookup"] == 1
    # (a store waits for its registration a bounded time only: on a loaded machine the registrar may finish later)
    wait_until(lambda: on_node(a, w_lookup, s, toks).num_tokens == 160, 10)
    n, got, _ = on_node(a, w_fetch, s, toks)
    assert n == 160 and torch.equal(got, kv)


class LongLived:
    """A worker that keeps one client for its life, as an engine does."""

    def __init__(self, s, transport="tcp"):
        self.c = kvmesh.connect(s, peer_transport=transport)

    def store(self, toks, kv):
        self.c.store(toks, kv)
        return self.c.flush()

    def fetch(self, toks):
        m = self.c.lookup(toks, cost_model=False)
        return m.num_tokens, self.c.fetch(m), self.c.last_fetch.error

    def reattached(self):
        return self.c.counts["local_node_reattached"]


def test_long_lived_clients_follow_a_kvnode_replaced_by_a_new_actor(mesh):
    # a KVNode put back as a new actor (kvmesh.stop and start, the keeper after ray.kill): before, a client made
    # earlier kept calling the dead actor for good (its stores lost, counted only as store_failures), and a peer's
    # client kept its dead handle (every pull over Ray a peer_error)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    a, b, _ = mesh.node_ids
    s = spec("replaced-kvnode")

    def on(node, *args):
        strategy = NodeAffinitySchedulingStrategy(node, soft=False)
        return ray.remote(num_cpus=0)(LongLived).options(scheduling_strategy=strategy).remote(s, *args)

    writer, reader = on(a), on(b, "ray")
    first, kv1 = tokens(32 * 2, seed=90), random_kv(s, 64, 91)
    assert ray.get(writer.store.remote(first, kv1), timeout=60) == 2
    n, got, _ = ray.get(reader.fetch.remote(first), timeout=60)  # (the reader now holds A's handle)
    assert n == 64 and torch.equal(got, kv1)
    actor = node_actors()[a]
    pid = ray.get(actor.stats.remote(), timeout=30)["pid"]
    ray.kill(actor, no_restart=True)
    wait_until(lambda: not pid_alive(pid), 30)
    wait_until(lambda: a not in node_actors(), 30)
    kvmesh.start(config=mesh.config)  # a new KVNode on A, as the keeper puts one back
    wait_until(lambda: ray.get(writer.reattached.remote(), timeout=30) >= 1, 30)
    then, kv2 = tokens(32 * 3, seed=92), random_kv(s, 96, 93)
    assert ray.get(writer.store.remote(then, kv2), timeout=60) == 3
    assert ray.get(node_actors()[a].stats.remote(), timeout=30)["chunks"] >= 3
    # (once the reader's node table has A's new incarnation: a refresh or two)
    wait_until(lambda: ray.get(reader.fetch.remote(then), timeout=60)[::2] == (96, ""), 20)
    n, got, error = ray.get(reader.fetch.remote(then), timeout=60)
    assert (n, error) == (96, "") and torch.equal(got, kv2)
    for w in (writer, reader):
        ray.kill(w)
