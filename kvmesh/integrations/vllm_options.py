"""The vLLM connector's options (`kv_connector_extra_config`) and the kvmesh identity of a vLLM engine's KV.

    parse_options(extra) -> ConnectorOptions      type-checked options; a bad one is an OptionError (a
                                                  ValueError) naming it
    groups_for_vllm(kv_cache_config) -> [KVGroup] the model's KV cache groups; a model feature kvmesh cannot move
                                                  (Mamba state, chunked local attention, MLA, ...) is a ValueError
                                                  naming it
    specs_for_vllm(vllm_config, kv_cache_config, options, tp_rank, lora_id, kv_format) -> (KVSpec, ...)
                                                  one spec per KV cache group, in vLLM's group order
    spec_for_vllm(...) -> KVSpec                  the same for a model with one group
    model_identity(model_config, options) -> str  the spec's model_id
    config_identity(model_config) -> str          its part for config overrides and quantization
    request_salt(engine_salt, request_salt)       the kvmesh salt of one request
    lora_identity(lora_request) -> str            the spec's lora_id for a request's adapter

Nothing here imports vLLM: the arguments are read by attribute, so these are testable without it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from kvmesh.integrations.identity import local_model_id, model_fingerprint
from kvmesh.integrations.options import VLLM_CONNECTOR
from kvmesh.spec import KVFormat, KVGroup, KVSpec, group_specs

DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class ConnectorOptions:
    ray_address: str | None = None  # Ray cluster to join when this process has no Ray connection yet
    ray_node_id: str | None = None  # the node whose KVNode is this engine's local one
    redis_url: str | None = None  # the directory, if not the one the local KVNode uses
    cache_salt: str | None = None  # engine-wide tenant salt, combined with each request's cache_salt
    model_id: str | None = None  # the model's identity; replaces the model name and revision or fingerprint
    model_revision: str | None = None  # revision of a hub model (default: vLLM's --revision)
    chunk_tokens: int | None = None  # tokens per kvmesh chunk, a multiple of vLLM's block size
    load_mode: str = "async"  # "async": load between steps; "sync": in the step that needs it, layer by layer
    cost_model: bool = True  # load only what the cost model says is cheaper than recomputing it
    fetch_timeout_s: float | None = None  # deadline of one load (default: the kvmesh config's fetch_timeout_s)
    save_copy: str | None = None  # "inline": saves copy blocks to staging in the step loop; "background": on the
    # saver thread (or a side stream), vLLM keeping the blocks until then. Default: inline on CPU, else background
    kv_format: str = "engine"  # "engine": the chunks' identity names vLLM, its block layout (the CPU packing kvmesh
    # learned, or the GPU layout) and this connector's format version, so only engines that write alike share;
    # "neutral": kvmesh's engine-neutral chunks, shared with any integration of the same spec (a transformers
    # worker with kv_format=None), trusting both to write the same bytes


def parse_options(extra: dict | None) -> ConnectorOptions:
    """The connector's options in `kv_connector_extra_config` (`options.VLLM_CONNECTOR`). Unknown keys are errors
    (a typo would otherwise silently fall back to a default)."""
    return ConnectorOptions(**VLLM_CONNECTOR.parse(extra))


def request_salt(engine_salt: str | None, request_salt: str | None) -> str | None:
    """The kvmesh salt of a request. Without an engine salt it is the request's own `cache_salt` (so a
    transformers worker with the same salt shares with it); with one, "<engine salt>\\0<request salt>": requests
    of a salted engine never share with anyone who does not know that salt."""
    if engine_salt is None:
        return request_salt or None
    return f"{engine_salt}\x00{request_salt or ''}"


def model_identity(model_config, options: ConnectorOptions) -> str:
    """`model_id` for the spec: the option if given; else a local model directory's name and weights
    fingerprint, or a hub name with its revision. Anything that changes the KV computed from the same weights
    (dtype, quantization, config overrides) is appended."""
    if options.model_id:
        base = options.model_id
    else:
        name = str(model_config.model)
        if os.path.isdir(name):
            base = local_model_id(name)
        else:
            revision = options.model_revision or getattr(model_config, "revision", None)
            if not revision:
                raise ValueError(
                    f"kvmesh vLLM connector: {name!r} is not a local directory and has no revision, so "
                    f"its weights could change under the same name; pass --revision, or set "
                    f"kv_connector_extra_config model_revision or model_id"
                )
            base = f"{name}@{revision}"
    return base + config_identity(model_config)


def config_identity(model_config, what: str = "kvmesh vLLM connector: ", option: str = "kv_connector_extra_config"):
    """What of an engine's model config changes the KV it computes from the same weights, for its model_id:
    config overrides and quantization ("" when neither is set)."""
    out = ""
    overrides = getattr(model_config, "hf_overrides", None)
    if callable(overrides):
        raise ValueError(
            f"{what}hf_overrides is a function, which kvmesh cannot fingerprint; set {option} model_id to name "
            f"this configuration"
        )
    if overrides:
        digest = hashlib.blake2b(json.dumps(overrides, sort_keys=True, default=str).encode(), digest_size=8)
        out += f"#hf={digest.hexdigest()}"
    quantization = getattr(model_config, "quantization", None)
    if quantization:
        out += f"#q={quantization}"
    return out


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layer_index(name: str) -> int:
    """The model layer index in a vLLM attention layer name ("model.layers.3.self_attn.attn" -> 3)."""
    ints = [int(x) for x in name.split(".") if x.isdigit()]
    if len(ints) != 1:
        raise ValueError(f"kvmesh vLLM connector: cannot tell the layer index of {name!r}")
    return ints[0]


# vLLM KV cache spec class -> the model feature it stands for, for those kvmesh cannot move
_UNSUPPORTED = {
    "MambaSpec": "Mamba / state-space layers (a recurrent state, not per-token K/V)",
    "ChunkedLocalAttentionSpec": "chunked local attention (Llama-4-style)",
    "MLAAttentionSpec": "MLA (latent KV, DeepSeek-style)",
    "CrossAttentionSpec": "cross-attention (encoder-decoder models)",
    "EncoderOnlyAttentionSpec": "encoder-only attention",
}


def groups_for_vllm(kv_cache_config) -> list[KVGroup]:
    """The model's KV cache groups as kvmesh describes them. vLLM's hybrid allocator gives full-attention and
    sliding-window layers groups of their own (with it off, a sliding-window layer is kept whole, and kvmesh moves
    it as the full-attention memory it then is). Everything else is refused here, naming the model feature."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ValueError(
            "kvmesh vLLM connector: the model has no KV cache groups (attention-free models are not supported)"
        )
    out = []
    for i, g in enumerate(groups):
        kv = g.kv_cache_spec
        kind = type(kv).__name__
        if kind in _UNSUPPORTED:
            raise ValueError(
                f"kvmesh vLLM connector: the model has {_UNSUPPORTED[kind]} (KV cache group {i}, "
                f"{kind}), which kvmesh does not support"
            )
        if kind not in ("FullAttentionSpec", "SlidingWindowSpec"):
            raise ValueError(
                f"kvmesh vLLM connector: KV cache group {i} is a {kind}; only full attention and "
                f"sliding-window attention are supported"
            )
        if getattr(kv, "head_size_v", kv.head_size) != kv.head_size:
            raise ValueError(
                "kvmesh vLLM connector: K and V head sizes differ (MLA-like); kvmesh chunks hold equal K/V"
            )
        if getattr(kv, "extra_retained_tokens", 0):
            raise ValueError(
                "kvmesh vLLM connector: sliding-window layers that retain extra tokens (multi-module "
                "speculative decoding) are not supported"
            )
        layers = tuple(layer_index(n) for n in g.layer_names)
        if kind == "SlidingWindowSpec":
            out.append(KVGroup(i, "sliding_window", int(kv.sliding_window), layers))
        else:
            out.append(KVGroup(i, "full", 0, layers))
    first = groups[0].kv_cache_spec
    for i, g in enumerate(groups):
        kv = g.kv_cache_spec
        if (kv.block_size, kv.num_kv_heads, kv.head_size, kv.dtype) != (
            first.block_size,
            first.num_kv_heads,
            first.head_size,
            first.dtype,
        ):
            raise ValueError(
                f"kvmesh vLLM connector: KV cache group {i} has another block size, head count, head "
                f"size or dtype than group 0; kvmesh needs them alike across groups"
            )
    return out


def cache_dtype_tag(cache_dtype: str | None) -> str:
    """vLLM's `--kv-cache-dtype` for the model id, "" for "auto" (the KV dtype is then the spec's own). vLLM's "fp8"
    and "fp8_e4m3" are one format, its platform's e4m3 (e4m3fn on CUDA and the CPU, e4m3fnuz on ROCm; every vLLM
    kernel takes the two names alike): named with it, so engines given either name share."""
    if not cache_dtype or cache_dtype == "auto":
        return ""
    if cache_dtype in ("fp8", "fp8_e4m3"):
        try:
            from vllm.platforms import current_platform

            return f"fp8:{_dtype_name(current_platform.fp8_dtype())}"
        except Exception:  # (no platform here to ask: the alias alone still keeps it apart from the others)
            return "fp8"
    return str(cache_dtype)


def specs_for_vllm(
    vllm_config,
    kv_cache_config,
    options: ConnectorOptions,
    tp_rank: int = 0,
    lora_id: str | None = None,
    model_id: str | None = None,
    kv_format: KVFormat | None = None,
) -> tuple[KVSpec, ...]:
    """The specs of the KV this engine (TP shard `tp_rank`) caches, one per KV cache group (a model with one
    full-attention group: one plain spec): heads per shard, KV dtype, chunk tokens a multiple of the block size,
    `kv_format` (None when the options say "neutral"). `model_id`, when given, skips deriving it again."""
    groups = groups_for_vllm(kv_cache_config)
    kv = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    parallel = vllm_config.parallel_config
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        raise ValueError("kvmesh vLLM connector: pipeline parallelism is not supported")
    cache = vllm_config.cache_config
    if getattr(cache, "calculate_kv_scales", False):
        raise ValueError(
            "kvmesh vLLM connector: calculate_kv_scales makes each engine quantize KV with its own "
            "scales, so engines could not share it"
        )
    block = kv.block_size
    chunk = options.chunk_tokens or -(-DEFAULT_CHUNK_TOKENS // block) * block
    if chunk % block:
        raise ValueError(f"kvmesh vLLM connector: chunk_tokens={chunk} must be a multiple of vLLM's block size {block}")
    kv_dtype = _dtype_name(kv.dtype)
    if model_id is None:
        model_id = model_identity(vllm_config.model_config, options)
        compute = _dtype_name(vllm_config.model_config.dtype)
        if compute != kv_dtype:  # the same weights give other KV values in another compute dtype
            model_id += f"#compute={compute}"
        quantized = cache_dtype_tag(getattr(cache, "cache_dtype", "auto"))
        if quantized:  # fp8 variants are all stored as uint8: the same byte is another value in each
            model_id += f"#kv={quantized}"
    base = KVSpec(
        model_id=model_id,
        num_layers=len(groups[0].layers),
        num_kv_heads=kv.num_kv_heads,
        head_dim=kv.head_size,
        dtype=kv_dtype,
        chunk_tokens=chunk,
        tp_rank=tp_rank,
        tp_size=getattr(parallel, "tensor_parallel_size", 1),
        lora_id=lora_id,
        kv_format=kv_format if options.kv_format == "engine" else None,
    )
    return group_specs(base, groups)


def spec_for_vllm(
    vllm_config,
    kv_cache_config,
    options: ConnectorOptions,
    tp_rank: int = 0,
    lora_id: str | None = None,
    model_id: str | None = None,
    kv_format: KVFormat | None = None,
) -> KVSpec:
    """`specs_for_vllm` for a model with one KV cache group."""
    specs = specs_for_vllm(vllm_config, kv_cache_config, options, tp_rank, lora_id, model_id, kv_format)
    if len(specs) != 1:
        raise ValueError(f"kvmesh vLLM connector: the model has {len(specs)} KV cache groups (use specs_for_vllm)")
    return specs[0]


def lora_identity(lora_request, fingerprints: dict[str, str]) -> str | None:
    """The spec's lora_id of a request's adapter: its name and, for a local adapter directory, a fingerprint of
    its files (memoised in `fingerprints`, path -> fingerprint, owned by the caller)."""
    if lora_request is None:
        return None
    name = str(lora_request.lora_name)
    path = getattr(lora_request, "lora_path", "") or ""
    if path and os.path.isdir(path):
        fp = fingerprints.get(path)
        if fp is None:
            fp = fingerprints[path] = model_fingerprint(path)
        return f"{name}@{fp}"
    return name


def background_save_copy(options: ConnectorOptions, device_type: str) -> bool:
    """Whether saves copy blocks out after the step (asynchronously) rather than in it. Both sides of the
    connector decide it alike: the scheduler then keeps a finished request's blocks until the workers report it."""
    if options.save_copy is not None:
        return options.save_copy == "background"
    return device_type != "cpu"  # a CPU copy is a memcpy; a GPU one is a side-stream kernel + DMA
