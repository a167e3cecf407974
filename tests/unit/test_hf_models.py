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


def test_models_without_attention_kv_or_with_layers_that_share_kv_are_refused_by_name():
    import transformers as tf

    rwkv = tf.RwkvForCausalLM(tf.RwkvConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                            attention_hidden_size=64, intermediate_size=128)).eval()
    with pytest.raises(UnsupportedModel, match="rwkv.*num_attention_heads"):
        spec_for_model(rwkv, chunk_tokens=8)
    t5 = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                   num_heads=4)).eval()
    with pytest.raises(UnsupportedModel, match="t5.*encoder-decoder"):  # (was: a spec, then transformers' error)
        spec_for_model(t5, chunk_tokens=8)
    # Gemma-3n: its last num_kv_shared_layers layers read earlier layers' K/V, and its cache holds fewer layers
    cfg = tf.Gemma3nTextConfig(vocab_size=256, vocab_size_per_layer_input=256, hidden_size=64,
                               hidden_size_per_layer_input=16, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, intermediate_size=128, sliding_window=40,
                               layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                               laurel_rank=8, altup_num_inputs=2, initializer_range=0.2,
                               activation_sparsity_pattern=[0.0] * 4)
    torch.manual_seed(3)
    gemma3n = tf.Gemma3nForCausalLM(cfg).eval()
    with pytest.raises(UnsupportedModel, match="gemma3n.*num_kv_shared_layers"):
        spec_for_model(gemma3n, chunk_tokens=8)


def test_models_of_more_than_one_kv_shape_or_of_looped_layers_are_refused_before_any_work():
    """Gemma 4: sliding layers of head dim 256, full ones of 512 (a per-layer config, whose global head_dim read
    raises transformers' own RuntimeError). Dory: its recurrent layers run twice, and its cache holds a layer per
    loop. Both are refused by name before a lookup or a prefill, not by transformers' error or at store time."""
    import transformers as tf

    class Untouched:  # a client that fails the test if generate gets as far as using it
        def __getattr__(self, name):
            raise AssertionError(f"generate used the client ({name}) for a model it must refuse")

    if not hasattr(tf, "Gemma4TextConfig") or not hasattr(tf, "DoryConfig"):
        pytest.skip("this transformers has no Gemma 4 or Dory")
    cfg = tf.Gemma4TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, num_hidden_layers=2, initializer_range=0.2)
    torch.manual_seed(0)
    gemma4 = tf.Gemma4ForCausalLM(cfg).eval()
    with pytest.raises(UnsupportedModel, match="gemma4_text.*differs between its layers"):
        spec_for_model(gemma4, chunk_tokens=8)
    with pytest.raises(UnsupportedModel, match="gemma4_text"):
        generate(gemma4, list(range(3, 30)), 2, client=Untouched())
    # a BERT-family LM head without is_decoder=True attends both ways: reusing a prefix's K/V would be wrong
    bert = tf.BertLMHeadModel(tf.BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=128, initializer_range=0.2)).eval()
    with pytest.raises(UnsupportedModel, match="bert.*not causal"):
        generate(bert, list(range(3, 30)), 2, client=Untouched())
    # ... judged by its attention, not by config keys a causal model never reads (transformers 4's config.json)
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               is_decoder=False, add_cross_attention=False)).eval()
    assert spec_for_model(llama, chunk_tokens=8).num_layers == 2
    for mode in ("per_loop", "last_loop"):
        cfg = tf.DoryConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_hidden_layers=3, n_input_layers=1,
                            n_recurrent_layers=1, n_output_layers=1, n_recurrent_loops=2, recurrent_kv_cache_mode=mode,
                            initializer_range=0.2)
        dory = tf.DoryForCausalLM(cfg).eval()
        with pytest.raises(UnsupportedModel, match="dory.*n_recurrent_loops"):
            generate(dory, list(range(3, 30)), 2, client=Untouched())


@pytest.mark.parametrize("change", [{"rope_theta": 5000.0}, {"rms_norm_eps": 1e-2},
                                    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}])
def test_the_same_weights_under_another_config_that_changes_kv_get_another_spec(change):
    # spec_for_model names a model without a revision by a fingerprint of its weights: it must cover the config
    # too, or one model reuses the other's KV (measured before: other greedy tokens, logits 5.0 apart)
    import transformers as tf

    base = dict(COMMON, num_hidden_layers=2)
    torch.manual_seed(0)
    a = tf.LlamaForCausalLM(tf.LlamaConfig(**base)).eval()
    b = tf.LlamaForCausalLM(tf.LlamaConfig(**base, **change)).eval()
    b.load_state_dict(a.state_dict())
    assert spec_for_model(a, chunk_tokens=8) != spec_for_model(b, chunk_tokens=8)
    c = tf.LlamaForCausalLM(tf.LlamaConfig(**base, attn_implementation="eager")).eval()  # same K/V: same spec
    c.load_state_dict(a.state_dict())
    assert spec_for_model(a, chunk_tokens=8) == spec_for_model(c, chunk_tokens=8)


@pytest.mark.parametrize("tp_size", [0, -1, 3, "2", 2.0, True])
def test_a_tp_size_that_does_not_split_the_kv_heads_is_refused_naming_it(tp_size):
    """4 KV heads: tp_size 0 raised ZeroDivisionError out of spec_for_model, "2" a TypeError about `//`, and 3 gave
    a spec of 1 KV head per rank (4 // 3): a shard geometry no rank holds, accepted without a word."""
    m = tiny_llama(seed=1, vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                   intermediate_size=128, initializer_range=0.2)
    with pytest.raises(ValueError, match="tp_size"):
        spec_for_model(m, model_id="m@1", chunk_tokens=8, tp_size=tp_size)
    assert spec_for_model(m, model_id="m@1", chunk_tokens=8, tp_size=2, tp_rank=1).num_kv_heads == 2
