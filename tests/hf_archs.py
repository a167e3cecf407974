"""The transformers model families of tests/integration/test_hf_architectures.py (each with what sets it apart:
see that module's docstring), as tiny random-weight models, shared with the GPU run of the same comparison
(tests/gpu/test_hf_cuda.py), which has no Ray."""

import torch

CHUNK, VOCAB = 16, 512
ARCHS = ["qwen3", "gemma3", "llama4", "gpt_neox", "gpt2", "mixtral", "falcon", "bart", "bert"]


def model(arch: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    if arch == "qwen3":
        cfg, cls = tf.Qwen3Config(num_hidden_layers=2, head_dim=48, **common), tf.Qwen3ForCausalLM
    elif arch == "gemma3":
        cfg = tf.Gemma3TextConfig(num_hidden_layers=6, head_dim=32, sliding_window=40, query_pre_attn_scalar=32,
                                  **common)
        cls = tf.Gemma3ForCausalLM
    elif arch == "llama4":
        cfg = tf.Llama4TextConfig(num_hidden_layers=4, head_dim=32, attention_chunk_size=24, num_local_experts=2,
                                  num_experts_per_tok=1, intermediate_size_mlp=256, interleave_moe_layer_step=2,
                                  **common)
        cls = tf.Llama4ForCausalLM
    elif arch == "gpt_neox":
        cfg = tf.GPTNeoXConfig(num_hidden_layers=2, vocab_size=VOCAB, hidden_size=128, num_attention_heads=4,
                               intermediate_size=256, initializer_range=0.2, rotary_pct=0.25, bos_token_id=1,
                               eos_token_id=2)
        cls = tf.GPTNeoXForCausalLM
    elif arch == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, vocab_size=VOCAB, n_embd=128, n_head=4, n_positions=1024,
                            initializer_range=0.2, bos_token_id=1, eos_token_id=2)
        cls = tf.GPT2LMHeadModel
    elif arch == "mixtral":
        cfg = tf.MixtralConfig(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, **common)
        cls = tf.MixtralForCausalLM
    elif arch == "bert":  # a BERT-family LM head, causal only with is_decoder=True (without it: refused)
        cfg = tf.BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=256, max_position_embeddings=1024, initializer_range=0.2,
                            is_decoder=True, pad_token_id=0)
        cls = tf.BertLMHeadModel
    elif arch == "bart":  # the decoder-only form of an encoder-decoder config: its num_hidden_layers and
        # num_attention_heads are the encoder's (1 and 2), not its decoder's (2 and 4)
        cfg = tf.BartConfig(vocab_size=VOCAB, d_model=128, encoder_layers=1, decoder_layers=2,
                            encoder_attention_heads=2, decoder_attention_heads=4, encoder_ffn_dim=256,
                            decoder_ffn_dim=256, max_position_embeddings=1024, init_std=0.2, bos_token_id=1,
                            eos_token_id=2, pad_token_id=0)
        cls = tf.BartForCausalLM
    else:
        cfg = tf.FalconConfig(num_hidden_layers=2, vocab_size=VOCAB, hidden_size=128, num_attention_heads=4,
                              num_kv_heads=2, new_decoder_architecture=True, initializer_range=0.2, bos_token_id=1,
                              eos_token_id=2)
        cls = tf.FalconForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        m = cls(cfg)
    if arch == "gemma3":  # its tied embeddings, scaled by sqrt(hidden), would drown the layers (see tests/vllm)
        with torch.no_grad():
            m.get_input_embeddings().weight.mul_(cfg.hidden_size ** -0.5)
    return m.eval()


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()
