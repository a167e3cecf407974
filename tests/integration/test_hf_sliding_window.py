"""Reuse through transformers models whose sliding window is smaller than the prompt, as a new user would try them:
a Mistral-style config (every layer sees a 48-token window) and a Gemma-2-style one (windowed and full-attention
layers alternate). A prefix computed on node A is reused on node B with the greedy tokens of a full recompute.

`kvmesh.integrations.hf` keeps a plain DynamicCache (every token of every layer; the model applies its window as
an attention mask), so what is stored and loaded is the whole prefix of every layer. A control stores the right
chunks and noise in the ones the suffix's window reaches, under another salt: the output must change, so the
identical outputs come from the loaded KV and the window is smaller than what was reused.
"""

import pytest
import torch

import kvmesh
from kvmesh.integrations.hf import generate, spec_for_model
from tests.integration.conftest import on_node

CHUNK, WINDOW, VOCAB = 32, 48, 512
PREFIX, SUFFIX = 6 * CHUNK, 20  # 212 tokens: the window is under a quarter of the prompt


def model(arch: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, initializer_range=0.2,
                  sliding_window=WINDOW, bos_token_id=1, eos_token_id=2)
    if arch == "mistral":
        cfg, cls = tf.MistralConfig(num_hidden_layers=2, tie_word_embeddings=False, **common), tf.MistralForCausalLM
    else:
        cfg = tf.Gemma2Config(num_hidden_layers=4, query_pre_attn_scalar=32, pad_token_id=0, **common)
        cls = tf.Gemma2ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        m = cls(cfg)
    if arch == "gemma2":  # its tied embeddings, scaled by sqrt(hidden), would drown the layers (see tests/vllm)
        with torch.no_grad():
            m.get_input_embeddings().weight.mul_(cfg.hidden_size ** -0.5)
    return m.eval()


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def w_generate(arch, tokens, use_kvmesh: bool, salt=None):
    torch.set_num_threads(1)
    m = model(arch)
    client = kvmesh.connect(spec_for_model(m, chunk_tokens=CHUNK)) if use_kvmesh else None
    try:
        r = generate(m, tokens, max_new_tokens=10, client=client, cache_salt=salt)
        if client:
            client.flush()
        return r
    finally:
        if client:
            client.close()


def w_plant(arch, tokens, salt: str, noisy_chunks: list[int]) -> int:
    """Copy the stored chunks of `tokens` under `salt`, with noise in `noisy_chunks`."""
    m = model(arch)
    with kvmesh.connect(spec_for_model(m, chunk_tokens=CHUNK)) as c:
        kv = c.fetch(c.lookup(tokens))
        n = kv.shape[2] // CHUNK
        chunks = [kv[:, :, i * CHUNK:(i + 1) * CHUNK].clone() for i in range(n)]
        for i in noisy_chunks:
            chunks[i] = (torch.randn(chunks[i].shape) * chunks[i].std()).to(chunks[i].dtype)
        h = c.hashes(tokens, salt)
        sent = c.store_keys(h[0], h[:n], chunks).handed
        c.flush()
        return sent


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_a_prefix_longer_than_the_window_is_reused_with_identical_greedy_tokens(mesh, arch):
    a, b, c = mesh.node_ids
    doc = prompt(PREFIX, seed=1)
    p1, p2 = doc + prompt(SUFFIX, seed=2), doc + prompt(SUFFIX, seed=3)
    first = on_node(a, w_generate, arch, p1, True)
    assert first.reused_tokens == 0 and first.stored_chunks == PREFIX // CHUNK
    reused = on_node(b, w_generate, arch, p2, True)
    plain = on_node(c, w_generate, arch, p2, False)
    assert reused.reused_tokens == PREFIX and reused.reused_peer_tokens == PREFIX
    assert reused.tokens == plain.tokens
    assert plain.tokens != on_node(c, w_generate, arch, prompt(PREFIX, 4) + p2[PREFIX:], False).tokens  # the
    # prefix beyond the suffix matters: the outputs depend on it
    # control: the last chunk (which the suffix's window reaches into) replaced by noise changes the output
    assert on_node(a, w_plant, arch, p2, "ctl-right", []) == PREFIX // CHUNK
    assert on_node(a, w_plant, arch, p2, "ctl-noise", [PREFIX // CHUNK - 1]) == PREFIX // CHUNK
    right = on_node(b, w_generate, arch, p2, True, "ctl-right")
    noise = on_node(b, w_generate, arch, p2, True, "ctl-noise")
    assert right.reused_tokens == PREFIX and right.tokens == plain.tokens
    assert noise.reused_tokens == PREFIX and noise.tokens != plain.tokens
