"""KVMeshStorage driven through SGLang's own classes, no engine: SGLang's MHATokenToKVPool (device "cpu") and its
MHATokenToKVPoolHost, with the backend built by SGLang's StorageBackendFactory ("dynamic"), each "engine" a Ray
actor pinned to its node of a real 3-node Ray cluster, against a real redis-server.

The path under test is SGLang's: device pool -> host pool (backup_from_device_all_layer) -> kvmesh (batch_set_v1)
-> kvmesh (batch_exists, batch_get_v1) -> fresh host slots -> device pool (load_to_device_per_layer), bit-exact.
"""

import os
import time

import pytest
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tests.conftest import dead_directory, says_directory_unreachable, wait_until

PAGE = 16
PAGES = 8
TOKENS = PAGE * PAGES


def extra(**kw) -> dict:
    return {"backend_name": "kvmesh", "module_path": "kvmesh.integrations.sglang", "class_name": "KVMeshStorage",
            "interface_v1": 1, "generation_refresh_s": 0.2, **kw}


class Engine:
    """What one SGLang engine's HiCache holds: a device KV pool, its host pool, and the L3 backend."""

    def __init__(self, seed: int, model: str = "tiny@r1", dtype=torch.bfloat16, tp=(0, 1), layout="layer_first",
                 heads: int = 2, head_dim: int = 64, layers: int = 2, **options) -> None:
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.storage import StorageBackendFactory

        torch.manual_seed(seed)
        self.layers = layers
        self.dev = MHATokenToKVPool(size=1024, page_size=PAGE, dtype=dtype, head_num=heads, head_dim=head_dim,
                                    layer_num=layers, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
        for buf in (*self.dev.k_buffer, *self.dev.v_buffer):
            buf.copy_(torch.randn(buf.shape).to(dtype))
        cls, info, kw = _mha_host_inputs(self.dev)
        self.host = cls(info, 2.0, 0, PAGE, layout, **kw)
        self.config = HiCacheStorageConfig(
            tp_rank=tp[0], tp_size=tp[1], pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=False, is_page_first_layout=layout != "layer_first", model_name="tiny",
            extra_config=extra(model_id=model, **options))
        self.be = StorageBackendFactory.create_backend("dynamic", self.config, self.host)
        self.be.register_mem_pool_host(self.host)
        self.be.register_mem_host_pool_v2(self.host, "kv")

    def node(self) -> str:
        return self.be.client.node_id

    def kv(self, dev_idx: torch.Tensor) -> torch.Tensor:
        """KV of device slots `dev_idx`: [layers, 2, n, heads, head_dim]."""
        return torch.stack([torch.stack([self.dev.k_buffer[i][dev_idx], self.dev.v_buffer[i][dev_idx]])
                            for i in range(self.layers)])

    def write(self, keys: list[str], first_token: int) -> tuple[list[bool], torch.Tensor]:
        """Device slots [first_token, +len(keys) pages) -> host -> kvmesh; returns the results and their KV."""
        dev_idx = torch.arange(first_token, first_token + len(keys) * PAGE, dtype=torch.int64)
        h_idx = self.host.alloc(len(dev_idx))
        self.host.backup_from_device_all_layer(self.dev, h_idx, dev_idx, "direct")
        ok = self.be.batch_set_v1(keys, h_idx)
        self.host.free(h_idx)
        return ok, self.kv(dev_idx)

    def read(self, keys: list[str]) -> dict:
        """batch_exists, then batch_get_v1 of the hit pages into fresh host slots, then into fresh device slots."""
        hit = self.be.batch_exists(keys)
        h_idx = self.host.alloc(len(keys) * PAGE)
        ok = self.be.batch_get_v1(keys, h_idx)
        n = sum(ok)
        dst = torch.arange(512, 512 + n * PAGE, dtype=torch.int64)
        for layer in range(self.layers):
            self.host.load_to_device_per_layer(self.dev, h_idx[: n * PAGE], dst, layer, "direct")
        self.host.free(h_idx)
        return {"exists": hit, "ok": ok, "kv": self.kv(dst), "fetch": self.be.client.last_fetch,
                "counts": dict(self.be.counts)}

    def call(self, name: str, *args):
        return getattr(self.be, name)(*args)

    def unregistered_calls(self, keys: list[str]) -> dict:
        """Every call of a backend SGLang built but has not handed its host pool yet."""
        from sglang.srt.mem_cache.storage import StorageBackendFactory

        be = StorageBackendFactory.create_backend("dynamic", self.config, None)
        idx = torch.arange(len(keys) * PAGE, dtype=torch.int64)
        page = self.host.get_dummy_flat_data_page()
        out = {"exists": be.batch_exists(keys), "exists_one": be.exists(keys[0]),
               "get_v1": be.batch_get_v1(keys, idx), "set_v1": be.batch_set_v1(keys, idx),
               "get": be.get(keys[0], page), "set": be.set(keys[0], page),
               "batch_set": be.batch_set(keys, [page] * len(keys)), "batch_get": be.batch_get(keys, [page] * len(keys))}
        out["counts"] = dict(be.counts)
        be.clear()
        be.close()
        return out

    def page_first_check(self, keys: list[str]):
        from kvmesh.integrations.sglang import chunk_view

        h = self.host
        h.kv_buffer.copy_(torch.randn(h.kv_buffer.shape).to(h.kv_buffer.dtype))
        idx = h.alloc(len(keys) * PAGE)
        ok = self.be.batch_set_v1(keys, idx)
        p0 = int(idx[0])
        view = chunk_view(h.get_data_page(p0, flat=False), h.layout)
        exact = all(torch.equal(view[l, kv, t], h.kv_buffer[kv, p0 + t, l])
                    for l in range(2) for kv in range(2) for t in range(PAGE))
        pages = [h.kv_buffer[:, int(idx[i * PAGE]):int(idx[i * PAGE]) + PAGE].clone() for i in range(len(keys))]
        h.kv_buffer.zero_()
        got = self.be.batch_get_v1(keys, idx)
        restored = all(torch.equal(h.kv_buffer[:, int(idx[i * PAGE]):int(idx[i * PAGE]) + PAGE], pages[i])
                       for i in range(len(keys)))
        return ok, exact, got, restored

    def flat_round_trip(self, keys: list[str], first_token: int) -> tuple[bool, list[bool], bool, bool]:
        """SGLang's older interface: batch_set/batch_get of flat pages, and get/set/exists of one."""
        dev_idx = torch.arange(first_token, first_token + len(keys) * PAGE, dtype=torch.int64)
        h_idx = self.host.alloc(len(dev_idx))
        self.host.backup_from_device_all_layer(self.dev, h_idx, dev_idx, "direct")
        pages = [self.host.get_data_page(int(h_idx[i * PAGE])).clone() for i in range(len(keys))]
        stored = self.be.batch_set(keys, pages)
        got = self.be.batch_get(keys, [self.host.get_dummy_flat_data_page() for _ in keys])
        same = [g is not None and torch.equal(g, p) for g, p in zip(got, pages)]
        single_set = self.be.set("single-" + keys[0], pages[0])
        single = self.be.get("single-" + keys[0], self.host.get_dummy_flat_data_page())
        self.host.free(h_idx)
        return stored, same, single_set and self.be.exists("single-" + keys[0]), torch.equal(single, pages[0])


def engine_on(node_id: str, *args, **kwargs):
    actor = ray.remote(num_cpus=0)(Engine).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(*args, **kwargs)
    return actor


def keys_for(tag: str, n: int = PAGES) -> list[str]:
    import hashlib

    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


@pytest.fixture(scope="module")
def engines(sgl_cluster):
    cluster, _ = sgl_cluster
    _, a, b = cluster.node_ids()  # head first: the driver's node stays
    ea, eb = engine_on(a, seed=1), engine_on(b, seed=2)
    assert ray.get([ea.node.remote(), eb.node.remote()], timeout=120) == [a, b]
    return ea, eb


def test_a_page_written_on_node_a_is_read_bit_exact_on_a_and_on_node_b(engines):
    ea, eb = engines
    keys = keys_for("doc1")
    ok, ref = ray.get(ea.write.remote(keys, 0), timeout=60)
    assert ok == [True] * PAGES
    local = ray.get(ea.read.remote(keys), timeout=60)
    assert local["exists"] == PAGES and local["ok"] == [True] * PAGES
    assert local["fetch"].local_chunks == PAGES and local["fetch"].peer_chunks == 0
    assert torch.equal(local["kv"], ref)  # L1 -> L2 -> L3 -> L2 -> L1, same bits
    peer = ray.get(eb.read.remote(keys), timeout=60)
    assert peer["exists"] == PAGES and peer["ok"] == [True] * PAGES
    assert peer["fetch"].peer_chunks == PAGES and peer["fetch"].local_chunks == 0
    assert torch.equal(peer["kv"], ref)
    # B's own KV differs (the comparison above is not trivially true)
    _, b_own = ray.get(eb.write.remote(keys_for("b-own", 1), 0), timeout=60)
    assert not torch.equal(b_own, ref[:, :, :PAGE])


def test_exists_is_a_prefix_and_a_partial_hit_reads_only_the_prefix(engines):
    ea, eb = engines
    keys = keys_for("doc2")
    ok, ref = ray.get(ea.write.remote(keys[:5], 0), timeout=60)
    assert ok == [True] * 5
    r = ray.get(eb.read.remote(keys), timeout=60)
    assert r["exists"] == 5 and r["ok"] == [True] * 5 + [False] * 3
    assert torch.equal(r["kv"], ref)
    assert ray.get(eb.call.remote("batch_exists", [keys_for("nothing", 1)[0]] + keys[:5]), timeout=60) == 0
    assert r["counts"]["sglang_get_pages_ok"] >= 5


def test_a_read_counts_one_lookup_and_its_hit(engines):
    # SGLang asks batch_exists, then batch_get_v1 of the pages it found: before, both counted a lookup and a hit,
    # so a hit request counted twice against a miss's once (a 67 % hit rate for one hit in two requests)
    ea, eb = engines
    keys = keys_for("doc-count")
    assert ray.get(ea.write.remote(keys, 0), timeout=60)[0] == [True] * PAGES
    before = ray.get(eb.read.remote(keys), timeout=60)["counts"]
    after = ray.get(eb.read.remote(keys), timeout=60)["counts"]
    assert (after["lookups"] - before["lookups"], after["hits"] - before["hits"]) == (1, 1)


def test_engines_with_another_spec_or_salt_never_share(sgl_cluster, engines):
    cluster, _ = sgl_cluster
    _, _, b = cluster.node_ids()
    ea, _ = engines
    keys = keys_for("doc3")
    assert ray.get(ea.write.remote(keys, 0), timeout=60)[0] == [True] * PAGES
    others = [engine_on(b, seed=2, model="tiny@r2"),  # another revision
              engine_on(b, seed=2, dtype=torch.float16),  # another dtype
              engine_on(b, seed=2, tp=(0, 2)),  # another TP shard
              engine_on(b, seed=2, cache_salt="tenant-x")]  # another tenant
    same = engine_on(b, seed=3)  # same spec: shares
    got = ray.get([e.call.remote("batch_exists", keys) for e in others + [same]], timeout=180)
    assert got == [0, 0, 0, 0, PAGES]
    # the pages are there and would be misread by another spec: it is not allowed to fetch them
    assert ray.get(others[0].call.remote("batch_get_v1", keys, torch.arange(PAGES * PAGE)), timeout=60) == \
        [False] * PAGES
    for e in others + [same]:
        ray.kill(e)


def test_older_interface_round_trips_flat_pages(engines):
    _, eb = engines
    stored, same, single_exists, single_same = ray.get(eb.flat_round_trip.remote(keys_for("doc4", 3), 64),
                                                       timeout=60)
    assert stored and same == [True, True, True] and single_exists and single_same


def test_page_first_layout_maps_pages_onto_chunks(sgl_cluster):
    # a page_first host pool (kv_buffer [2, tokens, layers, heads, head_dim]): chunk [layer, kv, t] is the
    # pool's kv_buffer[kv, page + t, layer], and a page written and read back lands where it was
    cluster, _ = sgl_cluster
    e = engine_on(cluster.node_ids()[1], seed=5, layout="page_first", model="tiny-pf@r1")
    ok, exact, got, restored = ray.get(e.page_first_check.remote(keys_for("doc5", 2)), timeout=120)
    ray.kill(e)
    assert ok == [True, True] and exact and got == [True, True] and restored


def test_clear_forgets_the_pages_cluster_wide(sgl_cluster):
    cluster, _ = sgl_cluster
    _, a, b = cluster.node_ids()
    ea, eb = engine_on(a, seed=6, model="tiny-clear@r1"), engine_on(b, seed=7, model="tiny-clear@r1")
    keys = keys_for("doc6", 4)
    assert ray.get(ea.write.remote(keys, 0), timeout=120)[0] == [True] * 4
    assert ray.get(eb.call.remote("batch_exists", keys), timeout=60) == 4
    ray.get(ea.call.remote("clear"), timeout=60)
    assert ray.get(ea.call.remote("batch_exists", keys), timeout=60) == 0
    wait_until(lambda: ray.get(eb.call.remote("batch_exists", keys), timeout=60) == 0, 10)
    # and the new generation works: write again, read again (B sees A's generation within generation_refresh_s;
    # until then it looks in the old, deleted group: misses, never stale pages)
    ok, ref = ray.get(ea.write.remote(keys, 0), timeout=60)
    wait_until(lambda: ray.get(eb.call.remote("batch_exists", keys), timeout=60) == 4, 10)
    r = ray.get(eb.read.remote(keys), timeout=60)
    assert ok == [True] * 4 and r["exists"] == 4 and torch.equal(r["kv"], ref)
    stats = ray.get(eb.call.remote("get_stats"), timeout=60)
    assert stats.prefetch_pgs and sum(stats.prefetch_pgs) >= 4
    ray.kill(ea)
    ray.kill(eb)


def test_a_generation_the_directory_forgot_is_never_reused(sgl_cluster, redis_server):
    """`clear` moves to a new generation; the counter lives in Redis. A Redis that lost it (its data, or an older
    snapshot) sent every engine back to generation 0, whose pages the nodes still held and re-register after such
    a loss (cleared pages back), and the next clear reused generation 1. An engine that knows a later generation
    puts it back, and a clear never takes a number seen before."""
    import redis

    cluster, _ = sgl_cluster
    _, a, b = cluster.node_ids()
    ea, eb = engine_on(a, seed=8, model="tiny-gen@r1"), engine_on(b, seed=9, model="tiny-gen@r1")
    # (both registered before the counter goes: a B that registered after found no counter and started one at a
    # random number, which A then took whenever it was the larger: a fresh generation, right, but not this test's)
    assert ray.get([ea.node.remote(), eb.node.remote()], timeout=120) == [a, b]
    keys = keys_for("doc8", 2)
    assert ray.get(ea.write.remote(keys, 0), timeout=120)[0] == [True] * 2
    ray.get(ea.call.remote("clear"), timeout=60)
    key = ray.get(ea.call.remote("generation_key"), timeout=60)
    r = redis.Redis.from_url(redis_server.url)
    try:
        gen = int(r.get(key))
        assert gen >= 1
        r.delete(key)  # the directory forgets it
        # A's next refresh (within generation_refresh_s) puts back the generation it knows (30 s: on a loaded
        # machine a Redis call over lookup_timeout_s opens the client's breaker for 5 s, and no refresh runs then)
        wait_until(lambda: ray.get(ea.call.remote("batch_exists", keys), timeout=60) == 0
                   and int(r.get(key) or 0) == gen, 30)
        ray.get(eb.call.remote("clear"), timeout=60)  # B never saw A's clear: still, no generation is reused
        assert int(r.get(key)) == gen + 1
    finally:
        r.close()
        ray.kill(ea)
        ray.kill(eb)


def test_engines_that_all_restarted_after_redis_lost_the_counter_never_meet_cleared_pages(sgl_cluster, redis_server):
    """Pages written, then cleared (a weight update): the nodes still hold their bytes until evicted. Redis then
    loses its data (here: the generation counter and the directory's epoch, so every node re-joins and registers
    all it holds again, the cleared pages' group too) and every engine that knew the generation restarts. Before,
    a missing counter read as generation 0: the new engines were back in the cleared pages' generation, and read
    KV of the old weights. A counter that is not there now starts at a random number."""
    import redis

    cluster, _ = sgl_cluster
    _, a, b = cluster.node_ids()
    model = "tiny-lost@r1"
    ec = engine_on(a, seed=10, model=model)
    keys = keys_for("doc9", 2)
    assert ray.get(ec.write.remote(keys, 0), timeout=120)[0] == [True] * 2
    old = ray.get(ec.call.remote("_refresh_generation", True), timeout=60)
    gen_key = ray.get(ec.call.remote("generation_key"), timeout=60)
    prefix = gen_key.split(":sglang:")[0]
    ray.get(ec.call.remote("clear"), timeout=60)
    ray.kill(ec)
    r = redis.Redis.from_url(redis_server.url)
    old_group = f"{prefix}:g:{{{old.hex()}}}"
    try:
        assert not r.exists(old_group)  # clear deleted it
        r.delete(gen_key, f"{prefix}:{{n}}:epoch")  # the directory lost its data: nodes re-join and re-register
        wait_until(lambda: r.exists(old_group), 20)  # the cleared pages are listed again
        ed = engine_on(b, seed=11, model=model)  # a restarted engine of the same model
        out = ray.get(ed.read.remote(keys), timeout=120)
        assert out["exists"] == 0 and out["ok"] == [False, False]
        assert ray.get(ed.call.remote("_refresh_generation", True), timeout=60) != old
        ray.kill(ed)
    finally:
        r.close()


def test_an_engine_idle_since_a_clear_never_puts_back_the_generation_that_clear_left(sgl_cluster, redis_server):
    """A writes pages; B reads them; both go idle. A clears (a weight update), and Redis then loses its data: the
    counter goes, and the nodes register all they hold again, the cleared pages too. Before, B, the first engine
    to look, put back the generation it knew, the one A cleared, and read its pages (KV of the old weights); so did
    A, at its next read. An engine idle for longer than `_trust_s` cannot vouch that no clear came meanwhile: B
    misses until A, which read the counter lately, puts back the current generation."""
    import redis

    cluster, _ = sgl_cluster
    _, a, b = cluster.node_ids()
    model = "tiny-idle@r1"
    ea, eb = engine_on(a, seed=12, model=model), engine_on(b, seed=13, model=model)
    assert ray.get([ea.node.remote(), eb.node.remote()], timeout=120) == [a, b]
    keys = keys_for("doc10", 2)
    assert ray.get(ea.write.remote(keys, 0), timeout=120)[0] == [True] * 2
    assert ray.get(eb.call.remote("batch_exists", keys), timeout=60) == 2
    old = ray.get(eb.call.remote("_refresh_generation", True), timeout=60)
    gen_key = ray.get(ea.call.remote("generation_key"), timeout=60)
    prefix = gen_key.split(":sglang:")[0]
    old_group = f"{prefix}:g:{{{old.hex()}}}"
    time.sleep(ray.get(eb.call.remote("_trust_s"), timeout=60) + 0.5)  # (both idle)
    r = redis.Redis.from_url(redis_server.url)
    try:
        cleared = int(r.get(gen_key))
        ray.get(ea.call.remote("clear"), timeout=60)
        gen = int(r.get(gen_key))
        assert not r.exists(old_group)  # clear deleted it
        r.delete(gen_key, f"{prefix}:{{n}}:epoch")  # the directory lost its data: nodes re-join and re-register
        wait_until(lambda: r.exists(old_group), 20)  # the cleared pages are listed again

        def b_looked() -> bool:  # (never the cleared pages; B's breaker may keep it from reading a moment)
            out = ray.get(eb.read.remote(keys), timeout=60)
            assert out["exists"] == 0 and out["ok"] == [False, False]
            return out["counts"].get("sglang_generation_unknown", 0) == 1

        wait_until(b_looked, 15)
        assert ray.get(eb.write.remote(keys, 0), timeout=60)[0] == [False, False]  # (nor written anywhere)
        assert r.get(gen_key) is None  # B put nothing back
        # A read the counter at its clear: it puts back the generation it made, and B follows. (A's breaker may
        # keep it from reading for a few seconds: in one CI run the counter was not back after A's first call.
        # Kept from it past `_trust_s`, A would start a random generation instead: either is safe, and neither is
        # the cleared one)
        wait_until(lambda: ray.get(ea.call.remote("batch_exists", keys), timeout=60) == 0
                   and r.get(gen_key) is not None, 30)
        assert int(r.get(gen_key)) not in (0, cleared)
        print("\nthe counter A put back:", "the generation it made" if int(r.get(gen_key)) == gen else "a new one")
        group = ray.get(ea.call.remote("_refresh_generation", True), timeout=60)
        wait_until(lambda: ray.get(eb.call.remote("_refresh_generation"), timeout=60) == group, 10)
        assert group != old and ray.get(eb.read.remote(keys), timeout=60)["exists"] == 0
    finally:
        r.close()
        ray.kill(ea)
        ray.kill(eb)


def test_a_dead_holder_node_gives_misses_not_errors(sgl_cluster, engines):
    # last in the module: removes node A. B's reads of A's pages become misses (False entries, 0 hits), are
    # counted, and B keeps working on its own pages.
    cluster, _ = sgl_cluster
    ea, eb = engines
    keys = keys_for("doc7")
    ok, ref = ray.get(ea.write.remote(keys, 0), timeout=60)
    assert ok == [True] * PAGES
    own = keys_for("doc7-b", 2)
    ok_b, ref_b = ray.get(eb.write.remote(own, 256), timeout=60)
    assert ok_b == [True, True]
    node_a = cluster.nodes[1]  # engine A's node (see `engines`)
    cluster.remove_node(node_a)
    # straight after the kill the directory may still list A (its lease runs 2 s) and A's processes may still be
    # going down: whatever arrives is a leading run of intact pages, the rest are misses
    first = ray.get(eb.read.remote(keys), timeout=60)
    n = sum(first["ok"])
    assert first["ok"] == [True] * n + [False] * (PAGES - n)
    assert torch.equal(first["kv"], ref[:, :, :n * PAGE])
    wait_until(lambda: ray.get(eb.call.remote("batch_exists", keys), timeout=60) == 0, 15)
    again = ray.get(eb.read.remote(keys), timeout=60)
    assert again["exists"] == 0 and again["ok"] == [False] * PAGES
    assert again["counts"]["miss_holder_dead"] + again["counts"].get("miss_peer_error", 0) >= 1
    mine = ray.get(eb.read.remote(own), timeout=60)
    assert mine["ok"] == [True, True] and torch.equal(mine["kv"], ref_b)


def test_a_backend_not_yet_given_its_host_pool_answers_misses(engines):
    _, eb = engines  # (B: A's node is gone after the test above)
    keys = keys_for("unregistered", 2)
    out = ray.get(eb.unregistered_calls.remote(keys), timeout=60)
    assert out["exists"] == 0 and out["exists_one"] is False
    assert out["get_v1"] == [False, False] and out["set_v1"] == [False, False]
    assert out["get"] is None and out["set"] is False and out["batch_set"] is False
    assert out["batch_get"] == [None, None]
    assert out["counts"]["sglang_not_registered"] >= 6


def test_with_redis_down_batch_calls_are_misses_and_serving_resumes(engines, redis_server):
    # last in the module: kills the session's Redis and brings it back empty (the KVNodes re-register)
    _, eb = engines
    keys = keys_for("redis-down")
    ok, ref = ray.get(eb.write.remote(keys, 0), timeout=60)
    assert ok == [True] * PAGES
    redis_server.kill()
    try:
        got = ray.get(eb.read.remote(keys), timeout=60)  # nobody can say where the pages are: misses
        wrote, _ = ray.get(eb.write.remote(keys_for("while-down", 2), 0), timeout=60)
    finally:
        redis_server.restart()
    assert got["exists"] == 0 and got["ok"] == [False] * PAGES
    # (a failed call, or none at all when the client's breaker had already opened on a failure of its table refresh)
    assert got["counts"].get("directory_errors", 0) + got["counts"].get("directory_skipped", 0) >= 1
    assert len(wrote) == 2 and all(isinstance(w, bool) for w in wrote)  # an answer, not an exception
    # the nodes re-register what they hold in the emptied Redis: B reads its pages from kvmesh again
    wait_until(lambda: ray.get(eb.call.remote("batch_exists", keys), timeout=60) == PAGES, 20)
    again = ray.get(eb.read.remote(keys), timeout=60)
    assert again["ok"] == [True] * PAGES and torch.equal(again["kv"], ref)


def test_hybrid_pools_are_refused_naming_the_model_feature(engines):
    # SGLang registers each host pool of a hybrid model at start-up: anything but the uniform KV pool stops it
    _, eb = engines
    for pool, feature in (("swa", "sliding-window"), ("mamba", "Mamba"), ("indexer", "DSA"),
                          ("deepseek_v4_c4", "DeepSeek-V4"), ("draft_swa", "draft")):
        with pytest.raises(ray.exceptions.RayTaskError, match=feature):
            ray.get(eb.call.remote("register_mem_host_pool_v2", None, pool), timeout=60)


def test_a_backend_pointed_at_a_dead_directory_fails_at_registration_saying_so_in_one_line(sgl_cluster):
    # SGLang hands the backend its host pool at start-up, where kvmesh connects: a directory where nothing listens
    # stops the engine there, with the URL (password redacted) and the cause on one line, not a silent miss forever
    cluster, _ = sgl_cluster
    a = cluster.node_ids()[-1]  # (a node of the module's cluster that is still there)
    with dead_directory() as url:
        dead = engine_on(a, seed=3, redis_url=url)
        with pytest.raises(ray.exceptions.RayActorError) as info:
            ray.get(dead.node.remote(), timeout=120)
    says_directory_unreachable(str(info.value), url)


@pytest.mark.parametrize("geometry", [dict(heads=1, head_dim=128, layers=3, dtype=torch.float16),
                                      dict(heads=8, head_dim=32, layers=2, dtype=torch.float32)],
                         ids=["1x128-3L-fp16", "8x32-2L-fp32"])
def test_other_pool_geometries_round_trip_bit_exact_across_nodes(sgl_cluster, geometry):
    # pools of other shapes and dtypes than the module's engines: a page written on node A reads back bit-exact on B
    cluster, _ = sgl_cluster
    a, b = cluster.node_ids()[-2:]  # two nodes of the module's cluster that are still there (a test removes one)
    tag = "-".join(str(v) for v in geometry.values())
    ea, eb = engine_on(a, seed=7, model=f"geom-{tag}@r1", **geometry), engine_on(b, seed=8, model=f"geom-{tag}@r1",
                                                                                  **geometry)
    try:
        keys = keys_for(f"geometry-{tag}")
        ok, ref = ray.get(ea.write.remote(keys, 0), timeout=60)
        assert ok == [True] * PAGES and ref.dtype == geometry["dtype"]
        got = ray.get(eb.read.remote(keys), timeout=60)
        assert got["exists"] == PAGES and got["ok"] == [True] * PAGES and got["fetch"].peer_chunks == PAGES
        assert torch.equal(got["kv"], ref)
        _, b_own = ray.get(eb.write.remote(keys_for(f"b-own-{tag}", 1), 0), timeout=60)
        assert not torch.equal(b_own, ref[:, :, :PAGE])
    finally:
        ray.kill(ea)
        ray.kill(eb)


def host_pool(dtype):
    """SGLang's own host pool over a device pool of KV `dtype` (fp8 ones are stored as uint8 by both)."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    dev = MHATokenToKVPool(size=256, page_size=PAGE, dtype=dtype, head_num=2, head_dim=64, layer_num=2,
                           device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    cls, info, kw = _mha_host_inputs(dev)
    return cls(info, 2.0, 0, PAGE, "layer_first", **kw)


def test_what_the_pool_does_not_say_comes_from_the_server_args():
    # fp8 e4m3 and e5m2 pools are both stored as uint8: the same byte is another value in each (0x41 is 2.25 in
    # e4m3, 2.5 in e5m2), so the KV cache dtype must be named, and engines that name different ones never share;
    # quantized weights, config overrides and a compute dtype change the KV of the same weights too
    from types import SimpleNamespace as NS

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from kvmesh.integrations.sglang import spec_for_pool

    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name="tiny", extra_config={})
    opts = {"model_id": "tiny@r1"}
    args = dict(kv_cache_dtype="auto", quantization=None, json_model_override_args="{}", dtype="auto")
    fp8 = {}
    for dtype, name in ((torch.float8_e4m3fn, "fp8_e4m3"), (torch.float8_e5m2, "fp8_e5m2")):
        pool = host_pool(dtype)
        assert pool.dtype == torch.uint8
        for unnamed in (None, NS(**args)):
            with pytest.raises(ValueError, match="kv-cache-dtype"):
                spec_for_pool(config, pool, opts, unnamed)
        fp8[name] = spec_for_pool(config, pool, opts, NS(**{**args, "kv_cache_dtype": name}))
        assert spec_for_pool(config, pool, {**opts, "kv_cache_dtype": name}).namespace == fp8[name].namespace
    assert fp8["fp8_e4m3"].namespace != fp8["fp8_e5m2"].namespace
    pool = host_pool(torch.bfloat16)
    plain = spec_for_pool(config, pool, opts, NS(**args))
    assert plain == spec_for_pool(config, pool, opts)  # (nothing in these args changes the KV)
    assert plain == spec_for_pool(config, pool, opts, NS(**{**args, "dtype": "bfloat16"}))  # (the pool's own)
    changed = [spec_for_pool(config, pool, opts, NS(**{**args, **change})).namespace
               for change in ({"quantization": "fp8"}, {"json_model_override_args": '{"rope_theta": 1e6}'},
                              {"dtype": "float32"})]
    assert len({plain.namespace, *changed}) == 4


@pytest.mark.parametrize("bad", [{"fetch_timeout_s": float("nan")}, {"fetch_timeout_s": float("inf")},
                                 {"fetch_timeout_s": 1e6}, {"generation_refresh_s": float("nan")},
                                 {"fetch_timeout_s": 0}, {"cache_salt": ""},
                                 # unknown keys too (they were passed over: a typo fell back to the default),
                                 # SGLang's own excepted (extra() has them)
                                 {"fetch_timeout": 5}, {"generation_refresh": 1}])
def test_bad_options_are_refused_at_construction_naming_them(bad):
    # SGLang's JSON takes NaN and Infinity: such a deadline was accepted, and every read then failed (a miss,
    # forever, behind healthy-looking exists counts)
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from kvmesh.integrations.sglang import parse_options

    (name,) = bad
    with pytest.raises(ValueError, match=name):
        parse_options(extra(**bad))
    assert parse_options(extra())["generation_refresh_s"] == 0.2  # (SGLang's own keys pass)


def test_a_ray_node_id_where_no_kvnode_runs_is_a_clear_error_naming_the_option(sgl_cluster):
    with pytest.raises(ValueError, match=r"extra_config\['ray_node_id'\] is 'ff"):
        Engine(seed=4, ray_node_id="ff" * 28)
