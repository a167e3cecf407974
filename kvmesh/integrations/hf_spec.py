"""Which transformers models kvmesh.integrations.hf can move the KV of, and their kvmesh spec.

spec_for_model(model, ...) -> KVSpec     identity from the config, dtype and weights, and the KV format
check_supported(model)                   raises UnsupportedModel (a ValueError) naming what is not K/V
weights_fingerprint(model) / config_fingerprint(config)   the parts of an identity without a revision
tiny_llama(seed, ...)                    a random-weight Llama, identical in every process
"""

from __future__ import annotations

import hashlib
import json

import torch

from kvmesh._extras import require
from kvmesh.spec import KVFormat, KVSpec

# The chunks this integration writes: every layer's K/V out of a DynamicCache, in kvmesh's neutral order. Bump the
# version whenever that changes.
HF_FORMAT = KVFormat("transformers", "dynamic-cache", 1)


def weights_fingerprint(model: torch.nn.Module) -> str:
    """BLAKE2b-64 over every parameter and buffer (name, dtype, shape, bytes; non-persistent buffers such as RoPE's
    `inv_freq` too) and over the model's config: a revision id for a model that has none. The config counts because
    the same weights give other K/V under another RoPE theta or scaling, norm epsilon, window, or multiplier. Reads
    all weights once; pass `model_id` with a real revision to skip it for big models."""
    h = hashlib.blake2b(digest_size=8, person=b"kvmesh.weights")
    tensors = dict(model.state_dict())
    tensors.update((f"buffer:{name}", b) for name, b in model.named_buffers() if name not in tensors)
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")  # (0-d buffers too)
    h.update(b"config|" + config_fingerprint(model.config).encode())
    return h.hexdigest()


# Config fields that name, label or steer a run without changing any layer's K/V: left out of the fingerprint, so
# that the same model loaded from another path, by another transformers, or with another attention backend (equal
# within dtype tolerance) still shares its KV. Everything else counts: an unknown field makes a miss, never a
# wrong hit.
_CONFIG_NOT_KV = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "transformers_version",
        "_commit_hash",
        "architectures",
        "torch_dtype",
        "dtype",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "_attn_implementation",
        "_attn_implementation_internal",
        "_attn_implementation_autoset",
        "_experts_implementation",
        "max_length",
        "min_length",
        "problem_type",
        "task_specific_params",
    }
)


def config_fingerprint(config) -> str:
    """BLAKE2b-64 of the model config's fields that can change K/V (all but `_CONFIG_NOT_KV`), in canonical JSON."""

    def strip(d):
        if isinstance(d, dict):
            return {k: strip(v) for k, v in d.items() if k not in _CONFIG_NOT_KV}
        if isinstance(d, (list, tuple)):
            return [strip(v) for v in d]
        return d

    d = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    text = json.dumps(strip(d), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=8, person=b"kvmesh.config").hexdigest()


class UnsupportedModel(ValueError):
    """A model whose per-layer state is not one K and one V per token of one shape (see the module docstring)."""


_ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention", "attention")


_GEOMETRY = (
    "head_dim",
    "qk_head_dim",
    "v_head_dim",
    "kv_lora_rank",
    "num_key_value_heads",
    "num_attention_heads",
    "hidden_size",
    "num_hidden_layers",
)


def _read(cfg, name: str, kind: str):
    """`config.<name>`, None if it has none. A heterogeneous config (transformers' per-layer configs, e.g.
    Gemma 4's: sliding layers of head dim 256, full ones of 512) raises on a global read of an attribute its layers
    do not share: that is a model of more than one KV shape."""
    try:
        return getattr(cfg, name, None)
    except Exception as e:
        raise UnsupportedModel(
            f"{kind}: config.{name} differs between its layers ({type(e).__name__}); kvmesh.integrations.hf moves "
            "K and V of one shape in every layer"
        ) from None


# how transformers names cross-attention (K/V of an encoder's output, not the prompt's): BART's, Whisper's, ...
# `encoder_attn`, BERT's `crossattention`, T5's `EncDecAttention`
_CROSS = ("cross", "encoder_attn", "encdec", "enc_dec")


def _bidirectional(model) -> str:
    """The name of a self-attention module of the model that attends both ways, or "". Transformers' attention
    modules say so themselves (`is_causal`: a BERT-family layer follows `config.is_decoder`, a decoder-only model's
    is always True); cross-attention (never the prompt's own K/V) is not one."""
    for name, m in model.named_modules():
        if getattr(m, "is_causal", None) is False and not getattr(m, "is_cross_attention", False):
            what = f"{name}.{type(m).__name__}".lower()
            if not any(c in what for c in _CROSS):
                return name or type(m).__name__
    return ""


def check_supported(model) -> None:
    """Raises `UnsupportedModel`, naming the model type and what it has, unless every decoder layer keeps plain
    per-token K/V of one shape."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "parameters"):
        raise TypeError(f"model must be a transformers model (with .config), got {type(model).__name__}")
    kind = getattr(cfg, "model_type", type(model).__name__)
    for name in _GEOMETRY:
        _read(cfg, name, kind)
    loops = getattr(cfg, "n_recurrent_loops", None)
    if isinstance(loops, int) and loops > 1:
        raise UnsupportedModel(
            f"{kind}: its recurrent layers run {loops} times per token (config.n_recurrent_loops): the cache "
            "holds more K/V than one per layer"
        )
    for attr in ("layer_types", "layers_block_type"):
        types = getattr(cfg, attr, None)
        other = sorted({str(t) for t in types or () if t not in _ATTENTION_LAYERS})
        if other:
            raise UnsupportedModel(
                f"{kind}: layers of type {', '.join(other)} (config.{attr}) keep state that is not per-token K/V "
                "(recurrent, convolutional or linear attention); kvmesh.integrations.hf moves only attention KV"
            )
    v_dim = getattr(cfg, "v_head_dim", None)
    qk_dim = getattr(cfg, "qk_head_dim", None) or getattr(cfg, "head_dim", None)
    if getattr(cfg, "kv_lora_rank", None) or (v_dim is not None and qk_dim is not None and v_dim != qk_dim):
        raise UnsupportedModel(
            f"{kind}: multi-head latent attention (K head dim {qk_dim}, V head dim {v_dim}); kvmesh.integrations.hf "
            "moves K and V of one shape"
        )
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModel(
            f"{kind}: an encoder-decoder model (its decoder's KV depends on the encoder's input, and its cross-"
            "attention KV is not per prompt token); kvmesh.integrations.hf moves a decoder-only model's KV"
        )
    both_ways = _bidirectional(model)
    if both_ways:
        raise UnsupportedModel(
            f"{kind}: its attention {both_ways} is not causal (is_causal False): a prefix's K/V depends on the "
            "tokens after it (a BERT-family LM head runs as a causal LM with config.is_decoder=True)"
        )
    if not isinstance(getattr(cfg, "num_hidden_layers", None), int):
        raise UnsupportedModel(f"{kind}: its config has no num_hidden_layers: not a decoder this integration knows")
    if not isinstance(getattr(cfg, "num_attention_heads", None), int):
        raise UnsupportedModel(f"{kind}: its config has no num_attention_heads: a model without attention KV")
    if getattr(cfg, "num_kv_shared_layers", 0):
        raise UnsupportedModel(
            f"{kind}: its last {cfg.num_kv_shared_layers} layers reuse earlier layers' K/V "
            "(config.num_kv_shared_layers): the cache holds fewer layers than the model has"
        )


def _decoder(cfg) -> tuple[int, int]:
    """(layers, attention heads) of the model's decoder. The decoder-only form of an encoder-decoder config (such
    as BartForCausalLM) has them as `decoder_layers` and `decoder_attention_heads`; its `num_hidden_layers` and
    `num_attention_heads` are the encoder's."""
    layers, heads = getattr(cfg, "decoder_layers", None), getattr(cfg, "decoder_attention_heads", None)
    return (
        layers if isinstance(layers, int) else cfg.num_hidden_layers,
        heads if isinstance(heads, int) else cfg.num_attention_heads,
    )


def _geometry(model, tp_size: int = 1) -> tuple[int, int, int, str]:
    """(layers, kv heads per rank, head dim, dtype) of the model's KV, from its config. `tp_size` must split the KV
    heads evenly (ValueError naming it otherwise: a rank's shard would be a guess)."""
    cfg = model.config
    layers, heads = _decoder(cfg)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    if kv_heads % tp_size:
        raise ValueError(f"tp_size {tp_size} does not divide the model's {kv_heads} KV heads evenly")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return layers, kv_heads // tp_size, head_dim, dtype


def _check_spec(model, spec: KVSpec) -> None:
    """`generate` runs the whole model in this process: the spec must describe all of its KV (tp_size 1)."""
    layers, kv_heads, head_dim, dtype = _geometry(model)
    want = (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype)
    if spec.tp_size != 1 or want != (layers, kv_heads, head_dim, dtype):
        raise ValueError(
            f"the client's spec (layers, kv heads, head dim, dtype) = {want} with tp_size {spec.tp_size} is not the "
            f"model's {(layers, kv_heads, head_dim, dtype)} in one process: make it with spec_for_model(model)"
        )


def spec_for_model(
    model,
    *,
    model_id: str | None = None,
    chunk_tokens: int = 256,
    lora_id: str | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    kv_format: KVFormat | None = HF_FORMAT,
) -> KVSpec:
    check_supported(model)
    cfg = model.config
    num_layers, kv_heads, head_dim, dtype = _geometry(model, tp_size)
    if model_id is None:
        name = getattr(cfg, "name_or_path", "") or cfg.model_type
        model_id = f"{name}@{weights_fingerprint(model)}"
    return KVSpec(
        model_id=model_id,
        num_layers=num_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        chunk_tokens=chunk_tokens,
        tp_rank=tp_rank,
        tp_size=tp_size,
        lora_id=lora_id,
        kv_format=kv_format,
    )


def tiny_llama(
    seed: int = 0,
    *,
    vocab_size: int = 4096,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    intermediate_size: int = 688,
    max_position_embeddings: int = 8192,
    initializer_range: float = 0.2,
    dtype=torch.float32,
):
    """A random-weight `LlamaForCausalLM`, identical for equal arguments in every process. The large
    `initializer_range` keeps greedy outputs prompt-dependent, so output comparisons mean something."""
    transformers = _transformers()
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def _transformers():
    """transformers, which kvmesh.integrations.hf (importing this module) has already required."""
    return require("transformers", "hf", "kvmesh.integrations.hf")
