"""Reuse through a transformers causal LM (`DynamicCache`).

    spec_for_model(model, ...) -> KVSpec        identity from the model's config, dtype and weights, and the KV
                                                format (`HF_FORMAT`, or None: kvmesh's neutral chunks, shared
                                                with a vLLM engine whose connector has kv_format="neutral")
    cache_from_kv(kv) -> DynamicCache           [num_layers, 2, T, kv_heads, head_dim] -> per-layer [1, H, T, D]
    kv_from_cache(cache, num_tokens, layers)    the reverse
    prefill_on_load(model, ids, load, ...)      prefill a suffix while its prefix arrives layer by layer: decoder
                                                layer i waits (forward pre-hook) only for layer i's KV
    generate(model, prompt, client=...)         look up, follow the cost model's plan (load all / compute the
                                                front while the rest loads / recompute), prefill the rest,
                                                decode greedily, store the new full chunks

Without a client, `generate` is the plain recompute path through the same code, so the two can be compared token
for token.

Sliding-window models (Mistral-, Gemma-2-style configs). The cache here is a plain `DynamicCache`, which keeps every
token of every layer (the model applies its window as an attention mask), so the KV stored and loaded is the whole
prefix of every layer: one uniform stack, whatever the layers' windows.

What this integration moves is one K and one V per layer, per token, of one shape: [kv_heads, head_dim]. Models whose
state is anything else raise `UnsupportedModel` (a `ValueError`) from `spec_for_model` and `generate`, before
anything is looked up, stored or computed: hybrids with recurrent, convolutional or linear-attention layers (a
`layer_types` or `layers_block_type` entry other than full, sliding or chunked attention: Qwen3-Next, Jamba, LFM2,
Falcon-H1, Bamba, MiniMax...) and multi-head latent attention (DeepSeek-V2/V3: K and V head dims differ). A spec
whose geometry (layers, kv heads, head dim, dtype) is not the model's raises `ValueError` from `generate`, and a
cache whose K/V do not have the spec's shape is never stored.
"""

from __future__ import annotations

from kvmesh._extras import require

transformers = require("transformers", "hf", __name__)  # (before the parts: the one line that names the extra)

# The parts: which models and their spec, the DynamicCache and the layer-wise prefill, and generate. Tests and
# benchmarks import the private helpers from here too.
from kvmesh.integrations.hf_cache import (  # noqa: E402
    _cache_kwarg,
    _check_cache,
    _decoder_layers,
    _forward,
    _install,
    _layer_kv,
    _new_cache,
    cache_from_kv,
    kv_from_cache,
    prefill_on_load,
)
from kvmesh.integrations.hf_generate import GenerationResult, _reuse, _start_load, _sync, generate  # noqa: E402
from kvmesh.integrations.hf_spec import (  # noqa: E402
    HF_FORMAT,
    UnsupportedModel,
    _check_spec,
    _decoder,
    _geometry,
    check_supported,
    config_fingerprint,
    spec_for_model,
    tiny_llama,
    weights_fingerprint,
)

__all__ = [
    "HF_FORMAT",
    "GenerationResult",
    "UnsupportedModel",
    "_cache_kwarg",
    "_check_cache",
    "_check_spec",
    "_decoder",
    "_decoder_layers",
    "_forward",
    "_geometry",
    "_install",
    "_layer_kv",
    "_new_cache",
    "_reuse",
    "_start_load",
    "_sync",
    "cache_from_kv",
    "check_supported",
    "config_fingerprint",
    "generate",
    "kv_from_cache",
    "prefill_on_load",
    "spec_for_model",
    "tiny_llama",
    "weights_fingerprint",
]
