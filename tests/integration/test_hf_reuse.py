"""Reuse through a real transformers model: a prompt computed on node A is reused on node B, and the greedy
output is token-for-token what recomputing gives."""

import torch

import kvmesh
from kvmesh.cost import LinkModel
from kvmesh.integrations.hf import generate, spec_for_model, tiny_llama
from tests.integration.conftest import on_node

CHUNK = 32


def model():
    return tiny_llama(seed=7, vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=256, initializer_range=0.2)


def w_generate(tokens, use_kvmesh: bool, salt=None, load_vs_compute=None):
    torch.set_num_threads(1)
    m = model()
    client = kvmesh.connect(spec_for_model(m, chunk_tokens=CHUNK)) if use_kvmesh else None
    if load_vs_compute is not None:
        # a synthetic machine: computing a chunk takes 1 ms, loading one `load_vs_compute` ms
        for n in (32, 64, 128, 256, 512):
            client.cost.prefill.observe(n, 0, 1e-3 * n / CHUNK)
        for name in ("local", "peer"):
            client.cost.links[name] = LinkModel(client.spec.chunk_bytes / (1e-3 * load_vs_compute), 1e-9)
    r = generate(m, tokens, max_new_tokens=12, client=client, cache_salt=salt, keep_logits=True)
    if client:
        client.flush()
        client.close()
    return r


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g).tolist()


def test_different_prompts_give_different_outputs():
    # guards the comparison below: with a degenerate model every prompt would give the same tokens
    m = model()
    outs = {tuple(generate(m, prompt(40, s), 8).tokens) for s in range(4)}
    assert len(outs) == 4


def test_reuse_across_nodes_gives_identical_greedy_tokens(mesh):
    a, b, c = mesh.node_ids
    doc = prompt(CHUNK * 6, seed=1)
    p1, p2 = doc + prompt(20, seed=2), doc + prompt(20, seed=3)
    first = on_node(a, w_generate, p1, True)
    assert first.reused_tokens == 0 and first.stored_chunks == 6
    reused = on_node(b, w_generate, p2, True)
    plain = on_node(c, w_generate, p2, False)
    assert reused.reused_tokens == CHUNK * 6 and reused.reused_peer_tokens == CHUNK * 6
    assert reused.computed_tokens == 20
    assert reused.tokens == plain.tokens
    assert torch.allclose(reused.first_logits, plain.first_logits, atol=1e-4, rtol=0)
    # the suffix chunk p2 added is now cached too, and a repeat on B is served from B's own node
    again = on_node(b, w_generate, p2, True)
    assert again.reused_tokens == CHUNK * 6 and again.tokens == plain.tokens


def test_a_prompt_made_only_of_cached_chunks_still_computes_its_last_token(mesh):
    a, b, _ = mesh.node_ids
    p = prompt(CHUNK * 4, seed=4)
    on_node(a, w_generate, p, True)
    r = on_node(b, w_generate, p, True)
    assert r.reused_tokens == CHUNK * 3 and r.computed_tokens == CHUNK
    assert r.tokens == on_node(b, w_generate, p, False).tokens


def test_salted_tenants_do_not_share(mesh):
    a, b, _ = mesh.node_ids
    p = prompt(CHUNK * 3 + 5, seed=5)
    on_node(a, w_generate, p, True, "tenant-x")
    assert on_node(b, w_generate, p, True, "tenant-y").reused_tokens == 0
    assert on_node(b, w_generate, p, True, "tenant-x").reused_tokens == CHUNK * 3


def test_cost_model_plans_give_identical_outputs(mesh):
    a, b, _ = mesh.node_ids
    doc = prompt(CHUNK * 8, seed=6)
    p = doc + prompt(10, seed=7)
    on_node(a, w_generate, p, True)
    plain = on_node(b, w_generate, p, False)
    # a link as slow as computing: the front is computed while the back loads
    split = on_node(b, w_generate, p, True, None, 1.0)
    assert split.plan == "split" and 0 < split.reused_tokens < CHUNK * 8 and split.tokens == plain.tokens
    # a hopeless link: recompute, and say so
    slow = on_node(b, w_generate, p, True, None, 1e3)
    assert slow.plan == "recompute" and slow.reused_tokens == 0 and slow.tokens == plain.tokens
    # a fast link: load everything
    fast = on_node(b, w_generate, p, True, None, 1e-3)
    assert fast.plan == "load" and fast.reused_tokens == CHUNK * 8 and fast.tokens == plain.tokens
