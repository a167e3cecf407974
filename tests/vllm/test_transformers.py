"""A vLLM engine and a transformers worker of the same model share chunks through kvmesh, both ways: vLLM's CPU
block layout and transformers' K/V meet in kvmesh's engine-neutral chunk layout.

    F (node 1): vLLM, fp32 compute and KV, kvmesh with load_mode="sync" (layer-by-layer loads in the step), its
                cost model off (for this tiny model a peer fetch may cost about as much as the prefill), and
                kv_format="neutral" (the engine's format left out of the identity, so it can share at all)
    the test process (head node): `kvmesh.integrations.hf` on the same weights, fp32 (and bf16 for the dtype test),
                with kv_format=None (neutral) too

fp32 on both sides: the two implementations then compute the same greedy tokens, so a chunk written by one and
read by the other is checked against both engines' own full recomputes.
"""

import os

import pytest
import ray
import torch

import kvmesh
from kvmesh.integrations.hf import _forward, _new_cache, generate, kv_from_cache, spec_for_model
from kvmesh.integrations.identity import local_model_id
from tests.conftest import wait_until
from tests.vllm.engines import delta, make_model, start_engine, tokens

# the first test of the module also waits for its engines to start (minutes on a busy 2-core machine), and
# pytest-timeout counts fixture setup in the test's time
pytestmark = pytest.mark.timeout(900)

PREFIX, SUFFIX = 1024, 40


@pytest.fixture(scope="module")
def setup(vllm_mesh, tmp_path_factory):
    from transformers import LlamaForCausalLM

    cluster, _ = vllm_mesh
    work = str(tmp_path_factory.mktemp("vllm-hf"))
    model_dir = make_model(os.path.join(work, "tiny-llama"))
    f = start_engine(cluster.node_ids()[1], work, model_dir, dtype="float32",
                     kvmesh={"load_mode": "sync", "cost_model": False, "kv_format": "neutral"})
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    spec = spec_for_model(hf, model_id=local_model_id(model_dir), chunk_tokens=256, kv_format=None)
    client = kvmesh.connect(spec)  # the test process is on the head node
    ray.get(f.node_id.remote(), timeout=600)
    yield {"F": f, "hf": hf, "spec": spec, "client": client, "model_dir": model_dir}
    client.close()
    ray.kill(f)


def gen(engine, prompts, **kw):
    return ray.get(engine.generate.remote(prompts, **kw), timeout=300)


def external(engine) -> int:
    return ray.get(engine.prompt_tokens_by_source.remote()).get("external_kv_transfer", 0)


def test_vllm_and_transformers_derive_the_same_spec(setup):
    assert ray.get(setup["F"].kvmesh_spec.remote()) == setup["spec"].canonical_bytes()
    # with their own formats in the identity (both integrations' default) they never share
    own = spec_for_model(setup["hf"], model_id=setup["spec"].model_id, chunk_tokens=256)
    assert own.kv_format.engine == "transformers" and own.namespace != setup["spec"].namespace


def test_an_engine_of_another_dtype_gets_no_hits(setup):
    from transformers import LlamaForCausalLM

    f = setup["F"]
    hf16 = LlamaForCausalLM.from_pretrained(setup["model_dir"], dtype=torch.bfloat16).eval()
    spec16 = spec_for_model(hf16, model_id=local_model_id(setup["model_dir"]), chunk_tokens=256, kv_format=None)
    assert spec16 != setup["spec"] and spec16.model_id == setup["spec"].model_id
    z = tokens(830, PREFIX) + tokens(831, SUFFIX)
    with kvmesh.connect(spec16) as c16:
        assert generate(hf16, z, max_new_tokens=2, client=c16).stored_chunks == 4
        assert c16.flush() == 4
        assert c16.lookup(z).num_chunks == 4  # the bf16 chunks are there
    before, counts = external(f), ray.get(f.counts.remote())["scheduler"]
    out = gen(f, [z])
    after = ray.get(f.counts.remote())["scheduler"]
    assert out[0]["cached"] == 0 and external(f) == before
    # counted as what it is (the engine's client caches the list of the model's specs for 10 s: this test comes
    # first, before any other miss made it read that list)
    assert delta(after, counts).get("miss_spec_mismatch", 0) == 1, delta(after, counts)


def test_chunks_a_transformers_worker_stored_load_into_vllm(setup):
    f, hf, client = setup["F"], setup["hf"], setup["client"]
    p = tokens(800, PREFIX) + tokens(801, SUFFIX)
    res = generate(hf, p, max_new_tokens=8, client=client)  # computes everything and stores its 4 full chunks
    assert res.reused_tokens == 0 and res.stored_chunks == 4
    assert client.flush() == 4
    before = external(f)
    out = gen(f, [p])
    assert external(f) - before == PREFIX
    assert out[0]["ids"] == gen(f, [p], recompute=True)[0]["ids"] == res.tokens


def test_chunks_vllm_stored_load_into_a_transformers_worker(setup):
    f, hf, client = setup["F"], setup["hf"], setup["client"]
    q = tokens(810, PREFIX) + tokens(811, SUFFIX)
    out = gen(f, [q])
    wait_until(lambda: client.lookup(q).num_chunks == 4, 30)
    res = generate(hf, q, max_new_tokens=8, client=client, store=False)
    assert res.reused_tokens == PREFIX and res.reused_peer_tokens == PREFIX  # from node 1's tier
    assert res.tokens == generate(hf, q, max_new_tokens=8).tokens == out[0]["ids"]


def test_vllm_attends_to_the_kv_it_loads(setup):
    # control: the right keys with another prompt's KV behind them must change vLLM's output, so the identical
    # outputs above come from the loaded KV and not from a silent recompute
    f, hf, client = setup["F"], setup["hf"], setup["client"]
    other = torch.tensor([tokens(820, PREFIX)])
    cache = _new_cache()
    with torch.inference_mode():
        _forward(hf, other, cache)
    wrong = kv_from_cache(cache, PREFIX, hf.config.num_hidden_layers)
    y = tokens(821, PREFIX) + tokens(822, SUFFIX)
    keys = client.hashes(y)[:4]
    assert client.store_keys(keys[0], keys, [wrong[:, :, i * 256:(i + 1) * 256] for i in range(4)]).handed == 4
    assert client.flush() == 4
    before = external(f)
    out = gen(f, [y])
    assert external(f) - before == PREFIX
    assert out[0]["ids"] != gen(f, [y], recompute=True)[0]["ids"]
