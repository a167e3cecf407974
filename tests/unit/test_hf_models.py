"""Which transformers models `kvmesh.integrations.hf` can move the KV of, decided before anything is looked up,
stored or computed: hybrids whose layers keep recurrent, convolutional or linear-attention state, and latent
attention (K and V of different head dims), raise `UnsupportedModel` (a ValueError) naming the model type and what
it has; a client whose spec is not the model's geometry raises ValueError. No Redis or Ray is needed: every check
happens before the client is used."""

import pytest
import torch

from kvmesh import KVSpec
from kvmesh.integrations.hf import UnsupportedModel, generate, spec_for_model, tiny_llama

COMMON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
              initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny(kind: str):
    import transformers as tf

    if kind == "qwen3_next":
        cfg = tf.Qwen3NextConfig(num_hidden_layers=4, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                                 linear_key_head_dim=16, linear_value_head_dim=16, num_experts=2,
                                 num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                 **COMMON)
        cls = tf.Qwen3NextForCausalLM
    elif kind == "jamba":
        cfg = tf.JambaConfig(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                             expert_layer_offset=1, num_experts=2, mamba_d_state=8, use_mamba_kernels=False, **COMMON)
        cls = tf.JambaForCausalLM
    elif kind == "lfm2":
        cfg = tf.Lfm2Config(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"],
                            **COMMON)
        cls = tf.Lfm2ForCausalLM
    else:
        cfg = tf.DeepseekV3Config(num_hidden_layers=2, first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=32,
                                  qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                                  **{**COMMON, "num_key_value_heads": 4})
        cls = tf.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    return cls(cfg).eval()


@pytest.mark.parametrize("kind,words", [("qwen3_next", "linear_attention"), ("jamba", "linear_attention"),
                                        ("lfm2", "conv"), ("deepseek_v3", "latent attention")])
def test_a_model_whose_state_is_not_per_token_kv_is_refused_by_name(kind, words):
    m = tiny(kind)
    with pytest.raises(UnsupportedModel, match=f"{kind}.*{words}"):
        spec_for_model(m, chunk_tokens=8)
    with pytest.raises(UnsupportedModel, match=kind):
        generate(m, list(range(3, 20)), 2)
    assert issubclass(UnsupportedModel, ValueError)


def test_a_client_whose_spec_is_not_the_models_geometry_is_refused_before_its_first_lookup():
    m = tiny_llama(seed=1, vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   intermediate_size=128, initializer_range=0.2)
    good = spec_for_model(m, chunk_tokens=8)
    for wrong in (KVSpec(good.model_id, 2, 4, 16, good.dtype, chunk_tokens=8),  # the query heads, not the KV heads
                  KVSpec(good.model_id, 3, 2, 16, good.dtype, chunk_tokens=8),
                  KVSpec(good.model_id, 2, 2, 16, "float16", chunk_tokens=8),
                  KVSpec(good.model_id, 2, 1, 16, good.dtype, chunk_tokens=8, tp_size=2)):

        class Untouched:  # a client that fails the test if generate gets as far as using it
            spec = wrong

            def __getattr__(self, name):
                raise AssertionError(f"generate used the client ({name}) although its spec is wrong")

        with pytest.raises(ValueError, match="is not the model's"):
            generate(m, list(range(3, 30)), 2, client=Untouched())
