"""Reuse through a real transformers model: a prompt computed on node A is reused on node B, and the greedy
output is token-for-token what recomputing gives."""

import torch

import kvmesh
from kvmesh.integrations.hf import generate, spec_for_model, tiny_llama
from tests.integration.conftest import on_node

CHUNK = 32


def model():
    return tiny_llama(seed=7, vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=256, initializer_range=0.2)


def w_generate(prompt, use_kvmesh: bool, salt=None):
    torch.set_num_threads(1)
    m = model()
    client = kvmesh.connect(spec_for_model(m, chunk_tokens=CHUNK)) if use_kvmesh else None
    r = generate(m, prompt, max_new_tokens=12, client=client, cache_salt=salt, keep_logits=True)
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
