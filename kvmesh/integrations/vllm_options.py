"""The vLLM connector's options (`kv_connector_extra_config`) and the kvmesh identity of a vLLM engine's KV.

    parse_options(extra) -> ConnectorOptions      type-checked options; a bad one is a ValueError naming it
    spec_for_vllm(vllm_config, kv_cache_config, options, tp_rank, lora_id) -> KVSpec
    model_identity(model_config, options) -> str  the spec's model_id
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
from kvmesh.spec import KVSpec

DEFAULT_CHUNK_TOKENS = 256
LOAD_MODES = ("async", "sync")
SAVE_COPIES = ("inline", "background")


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


_KINDS = {"ray_address": str, "ray_node_id": str, "redis_url": str, "cache_salt": str, "model_id": str,
          "model_revision": str, "chunk_tokens": int, "load_mode": str, "cost_model": bool,
          "fetch_timeout_s": (int, float), "save_copy": str}
# keys that are vLLM's or another connector's, not ours (MultiConnector passes its own through)
_FOREIGN = ("connectors",)


def parse_options(extra: dict | None) -> ConnectorOptions:
    """The connector's options in `kv_connector_extra_config`. Unknown keys are errors (a typo would otherwise
    silently fall back to a default)."""
    extra = dict(extra or {})
    unknown = sorted(k for k in extra if k not in _KINDS and k not in _FOREIGN)
    if unknown:
        raise ValueError(f"kvmesh vLLM connector: unknown kv_connector_extra_config key(s) {unknown}; "
                         f"known: {sorted(_KINDS)}")
    out = {}
    for name, kind in _KINDS.items():
        v = extra.get(name)
        if v is None:
            continue
        bad = (not isinstance(v, kind) or (kind is not bool and isinstance(v, bool))
               or (kind is str and not v) or (kind in (int, (int, float)) and v <= 0))
        if bad:
            what = {str: "a non-empty string", int: "a positive integer", bool: "true or false"}.get(
                kind, "a positive number")
            raise ValueError(f"kvmesh vLLM connector: kv_connector_extra_config[{name!r}] must be {what}, "
                             f"got {v!r}")
        out[name] = v
    if out.get("load_mode", "async") not in LOAD_MODES:
        raise ValueError(f"kvmesh vLLM connector: kv_connector_extra_config['load_mode'] must be one of "
                         f"{LOAD_MODES}, got {out['load_mode']!r}")
    if out.get("save_copy", "inline") not in SAVE_COPIES:
        raise ValueError(f"kvmesh vLLM connector: kv_connector_extra_config['save_copy'] must be one of "
                         f"{SAVE_COPIES}, got {out['save_copy']!r}")
    if "\x00" in out.get("cache_salt", ""):
        raise ValueError("kvmesh vLLM connector: kv_connector_extra_config['cache_salt'] must not contain NUL")
    return ConnectorOptions(**out)


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
                raise ValueError(f"kvmesh vLLM connector: {name!r} is not a local directory and has no revision, so "
                                 f"its weights could change under the same name; pass --revision, or set "
                                 f"kv_connector_extra_config model_revision or model_id")
            base = f"{name}@{revision}"
    overrides = getattr(model_config, "hf_overrides", None)
    if callable(overrides):
        raise ValueError("kvmesh vLLM connector: hf_overrides is a function, which kvmesh cannot fingerprint; set "
                         "kv_connector_extra_config model_id to name this configuration")
    if overrides:
        digest = hashlib.blake2b(json.dumps(overrides, sort_keys=True, default=str).encode(), digest_size=8)
        base += f"#hf={digest.hexdigest()}"
    quantization = getattr(model_config, "quantization", None)
    if quantization:
        base += f"#q={quantization}"
    return base


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def spec_for_vllm(vllm_config, kv_cache_config, options: ConnectorOptions, tp_rank: int = 0,
                  lora_id: str | None = None, model_id: str | None = None) -> KVSpec:
    """The spec of the KV this engine (TP shard `tp_rank`) caches: one full-attention KV cache group, heads per
    shard, KV dtype, chunk tokens a multiple of the block size. `model_id`, when given, skips deriving it again."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"kvmesh vLLM connector: the model has {len(groups)} KV cache groups; only models with "
                         f"one full-attention group are supported (hybrid / sliding-window / Mamba are not)")
    kv = groups[0].kv_cache_spec
    if type(kv).__name__ != "FullAttentionSpec" or getattr(kv, "sliding_window", None):
        raise ValueError(f"kvmesh vLLM connector: only full attention is supported, got {type(kv).__name__}")
    if getattr(kv, "head_size_v", kv.head_size) != kv.head_size:
        raise ValueError("kvmesh vLLM connector: K and V head sizes differ (MLA-like); kvmesh chunks hold equal K/V")
    parallel = vllm_config.parallel_config
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        raise ValueError("kvmesh vLLM connector: pipeline parallelism is not supported")
    cache = vllm_config.cache_config
    if getattr(cache, "calculate_kv_scales", False):
        raise ValueError("kvmesh vLLM connector: calculate_kv_scales makes each engine quantize KV with its own "
                         "scales, so engines could not share it")
    block = kv.block_size
    chunk = options.chunk_tokens or -(-DEFAULT_CHUNK_TOKENS // block) * block
    if chunk % block:
        raise ValueError(f"kvmesh vLLM connector: chunk_tokens={chunk} must be a multiple of vLLM's block size "
                         f"{block}")
    kv_dtype = _dtype_name(kv.dtype)
    if model_id is None:
        model_id = model_identity(vllm_config.model_config, options)
        compute = _dtype_name(vllm_config.model_config.dtype)
        if compute != kv_dtype:  # the same weights give other KV values in another compute dtype
            model_id += f"#compute={compute}"
    return KVSpec(model_id=model_id, num_layers=len(groups[0].layer_names), num_kv_heads=kv.num_kv_heads,
                  head_dim=kv.head_size, dtype=kv_dtype, chunk_tokens=chunk, tp_rank=tp_rank,
                  tp_size=getattr(parallel, "tensor_parallel_size", 1), lora_id=lora_id)


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
