"""A transformers `DynamicCache` and kvmesh chunks, and a prefill that runs while its prefix arrives layer by layer.

cache_from_kv(kv) -> DynamicCache           [num_layers, 2, T, kv_heads, head_dim] -> per-layer [1, H, T, D]
kv_from_cache(cache, num_tokens, layers)    the reverse
prefill_on_load(model, ids, load, ...)      decoder layer i waits (forward pre-hook) only for layer i's KV
"""

from __future__ import annotations

import inspect

import torch

from kvmesh._extras import require
from kvmesh.integrations.hf_spec import UnsupportedModel, _decoder
from kvmesh.movers import LayerwiseLoad, scatter_contiguous
from kvmesh.spec import KVSpec


def _new_cache():
    return _transformers().DynamicCache()


def _install(cache, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Put K/V [1, H, T, D] into a DynamicCache layer without copying them (so they may still be filling)."""
    cache.update(k[:, :, :0], v[:, :, :0], layer)  # creates the layer
    if hasattr(cache, "layers"):  # transformers >= 4.56
        cache.layers[layer].keys, cache.layers[layer].values = k, v
    else:
        cache.key_cache[layer], cache.value_cache[layer] = k, v


def cache_from_kv(kv: torch.Tensor):
    """A `DynamicCache` holding (a copy of) `kv` ([num_layers, 2, T, H, D])."""
    cache = _new_cache()
    for layer in range(kv.shape[0]):
        _install(
            cache,
            layer,
            kv[layer, 0].transpose(0, 1).unsqueeze(0).contiguous(),
            kv[layer, 1].transpose(0, 1).unsqueeze(0).contiguous(),
        )
    return cache


def _layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def kv_from_cache(cache, num_tokens: int, num_layers: int) -> torch.Tensor:
    """[num_layers, 2, num_tokens, H, D] copied out of a batch-1 cache."""
    first_k, _ = _layer_kv(cache, 0)
    _, h, _, d = first_k.shape
    out = torch.empty((num_layers, 2, num_tokens, h, d), dtype=first_k.dtype, device=first_k.device)
    for layer in range(num_layers):
        k, v = _layer_kv(cache, layer)
        out[layer, 0].copy_(k[0, :, :num_tokens].transpose(0, 1))
        out[layer, 1].copy_(v[0, :, :num_tokens].transpose(0, 1))
    return out


def _check_cache(cache, spec: KVSpec, num_tokens: int) -> None:
    """The computed cache holds, in every layer, K and V of the spec's shape; else nothing may be stored."""
    want = (1, spec.num_kv_heads, num_tokens, spec.head_dim)
    held = len(cache.layers) if hasattr(cache, "layers") else len(cache.key_cache)
    if held != spec.num_layers:
        raise UnsupportedModel(f"the cache holds {held} layers, the spec {spec.num_layers}: its KV cannot be stored")
    for layer in range(spec.num_layers):
        k, v = _layer_kv(cache, layer)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise UnsupportedModel(
                f"layer {layer}'s cache holds K {tuple(k.shape)} and V {tuple(v.shape)}, not {want} "
                "[batch, kv heads, tokens, head dim] as the spec says: this model's KV cannot be stored"
            )


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _decoder_layers(model):
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else None


def _forward(model, ids: torch.Tensor, cache, **kw):
    return model(input_ids=ids, use_cache=True, **{_cache_kwarg(model): cache}, **kw)


def prefill_on_load(
    model,
    suffix_ids: torch.Tensor,
    load: LayerwiseLoad | None,
    loaded_tokens: int,
    front_cache=None,
    front_tokens: int = 0,
):
    """Prefill `suffix_ids` ([1, S]) on top of a prefix made of `front_tokens` computed tokens (in
    `front_cache`) followed by `loaded_tokens` tokens arriving through `load` (chunk layout). Decoder layer i
    waits only for layer i of the load. Returns (last-position logits, cache)."""
    num_layers, _ = _decoder(model.config)
    total = front_tokens + loaded_tokens
    device = suffix_ids.device
    if load is not None:
        _, _, _, _, h, d = load.staging.shape
    else:
        _, h, _, d = _layer_kv(front_cache, 0)[0].shape
    dtype = next(model.parameters()).dtype
    keys = [torch.empty((1, h, total, d), dtype=dtype, device=device) for _ in range(num_layers)]
    values = [torch.empty((1, h, total, d), dtype=dtype, device=device) for _ in range(num_layers)]
    if front_tokens:
        for layer in range(num_layers):
            fk, fv = _layer_kv(front_cache, layer)
            keys[layer][:, :, :front_tokens].copy_(fk[:, :, :front_tokens])
            values[layer][:, :, :front_tokens].copy_(fv[:, :, :front_tokens])
    if load is not None:
        # K/V are written on the load's consumer stream; this stream waits for each layer before using it, so
        # by the time they are freed here the writes are long done
        load.then(
            lambda layer, piece: scatter_contiguous(
                piece.unsqueeze(1), keys, values, front_tokens, range(layer, layer + 1)
            )
        )
    cache = _new_cache()
    for layer in range(num_layers):
        _install(cache, layer, keys[layer], values[layer])
    hooks = []
    decoder = _decoder_layers(model)
    if load is not None and load.stream is not None:
        if decoder is not None and len(decoder) == num_layers:
            hooks = [m.register_forward_pre_hook(lambda _m, _a, i=i: load.wait(i)) for i, m in enumerate(decoder)]
        else:  # unknown architecture: wait for everything up front
            for layer in range(num_layers):
                load.wait(layer)
    try:
        out = _forward(model, suffix_ids, cache, logits_to_keep=1)
    finally:
        for hk in hooks:
            hk.remove()
    return out.logits[:, -1], cache


def _transformers():
    """transformers, which kvmesh.integrations.hf (importing this module) has already required."""
    return require("transformers", "hf", "kvmesh.integrations.hf")
