"""Reuse through transformers model families beyond Llama, each with what sets it apart: Qwen3 (a head dim that is
not hidden / heads, q/k norms), Gemma-3 (five sliding-window layers to one full, head dim 32 of a 128 hidden),
Llama-4 (chunked local attention over 24 tokens, layers without RoPE, experts every other layer), GPT-NeoX (partial
rotary, fused QKV, no GQA), GPT-2 (learned positions, Conv1D), Mixtral (experts) and Falcon's new
decoder, BART's decoder alone (`BartForCausalLM`, whose config's layer and head counts are the encoder's), and
BERT's LM head run as a decoder (`is_decoder=True`; without it, bidirectional, it is refused).
A prompt of 5 chunks and 7 tokens is computed on node A; a longer one that shares it is reused on node B
(pulled from A) and must give the greedy tokens of a full recompute on node C, logits within float32 tolerance.

Models whose state is not per-token K/V (hybrids with linear-attention, recurrent or convolutional layers; DeepSeek's
latent attention) raise `UnsupportedModel` before anything is looked up or stored: tests/unit/test_hf_models.py."""

import pytest
import torch

import kvmesh
from kvmesh.integrations.hf import generate, spec_for_model
from tests.hf_archs import ARCHS, CHUNK, model, prompt
from tests.integration.conftest import on_node


def w_generate(arch, tokens, use_kvmesh: bool):
    torch.set_num_threads(1)
    m = model(arch)
    client = kvmesh.connect(spec_for_model(m, chunk_tokens=CHUNK)) if use_kvmesh else None
    try:
        r = generate(m, tokens, max_new_tokens=8, client=client, keep_logits=True)
        if client:
            client.flush()
        return r
    finally:
        if client:
            client.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_prefix_computed_on_one_node_is_reused_on_another_with_the_tokens_of_a_recompute(mesh, arch):
    a, b, c = mesh.node_ids
    doc = prompt(5 * CHUNK + 7, seed=ARCHS.index(arch))  # 5 full chunks and a partial one, which is not stored
    longer = doc + prompt(9, seed=100)
    first = on_node(a, w_generate, arch, doc, True)
    assert first.reused_tokens == 0 and first.stored_chunks == 5
    reused = on_node(b, w_generate, arch, longer, True)
    plain = on_node(c, w_generate, arch, longer, False)
    assert reused.reused_tokens == 5 * CHUNK and reused.reused_peer_tokens == 5 * CHUNK
    assert reused.tokens == plain.tokens
    assert torch.allclose(reused.first_logits, plain.first_logits, atol=1e-4, rtol=0)
    # the comparison proves something: another prompt gives other tokens
    assert on_node(c, w_generate, arch, prompt(len(longer), seed=200), False).tokens != plain.tokens
