"""The kvmesh spec of an SGLang host pool's pages, and their keys (see kvmesh.integrations.sglang).

parse_options(extra_config) -> dict          the backend's options (`options.SGLANG`); OptionError naming a bad one
server_args()                                SGLang's server arguments in this process, or None
spec_for_pool(storage_config, host_pool, options, args, loaded) -> KVSpec   one chunk per page
model_identity / compute_dtype / kv_cache_dtype / draft_identity            the parts of its model id
sglang_kv_format(layout) -> KVFormat         the format of the pages this backend writes
pool_feature(name) -> str                    the model feature an extra host pool stands for
page_keys(group, keys) -> [bytes]            kvmesh chunk keys of SGLang page keys in a generation's group
chunk_view(page, layout) -> Tensor           a host-pool page viewed as a kvmesh chunk (no copy)
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from kvmesh.hashing import HASH_BYTES
from kvmesh.integrations.identity import local_model_id
from kvmesh.integrations.options import SGLANG
from kvmesh.spec import KVFormat, KVSpec

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
# Bumped whenever this backend changes how it writes a page's bytes: pages written before are then never read.
SGLANG_FORMAT_VERSION = 1
# SGLang host pool name (prefix) -> the model feature it stands for
_POOL_FEATURES = (
    ("swa", "hybrid sliding-window attention (a separate SWA KV pool)"),
    ("auxiliary_swa", "hybrid sliding-window attention (a separate SWA KV pool)"),
    ("mamba", "Mamba / state-space layers (a recurrent state pool)"),
    ("indexer", "sparse-attention indexer keys (DeepSeek-V3.2 DSA)"),
    ("deepseek_v4", "DeepSeek-V4 compressed KV"),
    ("draft", "speculative-decoding draft-model KV"),
)


def parse_options(extra: dict | None) -> dict:
    """The kvmesh options in SGLang's extra_config (`options.SGLANG`), type-checked, with defaults; an unknown key
    (other than SGLang's own, `options.SGLANG_KEYS`) or a bad value is an OptionError (a ValueError) naming it.
    (SGLang's JSON takes NaN and Infinity: a deadline of either made every read a miss, forever.)"""
    return SGLANG.parse(extra)


def server_args():
    """SGLang's server arguments as this process has them (its scheduler sets them before it builds the storage
    backend), or None where they are not set (a pool built outside an engine)."""
    import importlib

    for module, name in (
        ("sglang.srt.runtime_context", "get_server_args"),
        ("sglang.srt.server_args", "get_global_server_args"),
    ):
        try:
            return getattr(importlib.import_module(module), name)()
        except Exception:  # (not set yet, or the accessor this SGLang retired)
            continue
    return None


def model_identity(storage_config: HiCacheStorageConfig, options: dict, args=None, loaded: str | None = None) -> str:
    """The model id: the option, else a local directory's fingerprint or a hub name with its revision; then what
    changes the KV computed from the same weights, from SGLang's server args `args` where given: random weights
    (`--load-format dummy`), quantization, a config override (`--json-model-override-args`). `loaded`: the identity
    of the weights SGLang loaded since it started (`KVMeshStorage.weights_updated`), which replaces the model's and
    its load format."""
    if loaded:
        base = loaded
    elif "model_id" in options:
        base = options["model_id"]
    else:
        name = storage_config.model_name
        if not name:
            raise ValueError("kvmesh SGLang backend: the storage config has no model_name; set extra_config model_id")
        if os.path.isdir(name):
            base = local_model_id(name)
        elif "model_revision" not in options:
            raise ValueError(
                f"kvmesh SGLang backend: {name!r} is not a local directory, so kvmesh cannot fingerprint "
                f"its weights; set extra_config model_revision (or model_id)"
            )
        else:
            base = f"{name}@{options['model_revision']}"
    if args is None:
        return base
    if getattr(args, "load_format", None) == "dummy" and not loaded:  # random weights, not the checkpoint's
        base += "#weights=dummy"
    quantization = getattr(args, "quantization", None)
    if quantization:
        base += f"#q={quantization}"
    overrides = getattr(args, "json_model_override_args", None)
    if overrides and overrides.strip() not in ("", "{}"):
        try:
            overrides = json.dumps(json.loads(overrides), sort_keys=True)
        except ValueError:
            pass  # (SGLang refuses it itself; hashed as given)
        base += f"#hf={hashlib.blake2b(overrides.encode(), digest_size=8).hexdigest()}"
    return base


def compute_dtype(host_pool, args) -> str:
    """SGLang's --dtype for the model id where it is not the pool's own KV dtype ("" where it is, or is "auto":
    the checkpoint's, which its fingerprint covers): the same weights give other KV values computed in another."""
    name = getattr(args, "dtype", None)
    if not name or name == "auto":
        return ""
    dtype = getattr(torch, str(name), None)
    return "" if dtype == host_pool.dtype else str(name)


def kv_cache_dtype(host_pool, options: dict, args) -> str:
    """The KV cache dtype for the model id: "" where the pool's own dtype says it (a 2- or 4-byte float); SGLang's
    --kv-cache-dtype (or the option) otherwise. A pool stored as bytes (uint8: every fp8 format, and the others
    SGLang quantizes KV to) without either is refused: e4m3 and e5m2 pages are the same bytes and other values."""
    option, served = options.get("kv_cache_dtype"), getattr(args, "kv_cache_dtype", None)
    if option and served and served != "auto" and option != served:  # (the server's is what the pool holds: an
        # option that names another format would label its pages as that one, for engines that really use it)
        raise ValueError(
            f"kvmesh SGLang backend: extra_config kv_cache_dtype is {option!r}, but SGLang runs with "
            f"--kv-cache-dtype {served!r}; drop the option or make them agree"
        )
    given = option or served
    if given and given != "auto":
        return str(given)
    if torch.empty(0, dtype=host_pool.dtype).element_size() == 1:
        raise ValueError(
            f"kvmesh SGLang backend: the host pool stores KV as {str(host_pool.dtype).removeprefix('torch.')} (a "
            f"quantized KV cache), and nothing says which format: start SGLang with an explicit --kv-cache-dtype "
            f"(e.g. fp8_e4m3), or set extra_config kv_cache_dtype"
        )
    return ""


def spec_for_pool(
    storage_config: HiCacheStorageConfig, host_pool, options: dict, args=None, loaded: str | None = None
) -> KVSpec:
    """The kvmesh spec of the pages in SGLang's host pool: one chunk per page. `args`: SGLang's server args
    (`server_args()`), None outside an engine; `loaded`: see `model_identity`."""
    layout = getattr(host_pool, "layout", None)
    if layout not in LAYOUTS or not hasattr(host_pool, "kv_buffer"):
        raise ValueError(
            f"kvmesh SGLang backend supports MHA host pools with layout in {LAYOUTS}, got "
            f"{type(host_pool).__name__} with layout {layout!r}"
        )
    if getattr(host_pool, "v_head_dim", host_pool.head_dim) != host_pool.head_dim:
        raise ValueError("kvmesh SGLang backend: K and V head dims differ; kvmesh chunks hold equal K and V")
    model_id = model_identity(storage_config, options, args, loaded)
    compute, quantized = compute_dtype(host_pool, args), kv_cache_dtype(host_pool, options, args)
    if compute:
        model_id += f"#compute={compute}"
    if quantized:
        model_id += f"#kv={quantized}"
    if storage_config.pp_size > 1:  # stages hold different layers of the same model
        model_id += f"#layers{host_pool.start_layer}-{host_pool.end_layer}"
    cp_size = getattr(storage_config, "attn_cp_size", 1) or 1  # (an SGLang without context parallelism: none)
    if cp_size > 1 and (getattr(host_pool, "shard_size", 1) or 1) > 1:  # attention context parallel with KV cache
        # sharding (a page-interleaved host pool): each CP rank holds its own part of the KV. Without sharding
        # (SGLang 0.5.23 refuses it with any --hicache-storage-backend), dense-MHA CP all-gathers K/V and writes
        # the whole KV into every CP rank's pool: the same page under the same key, to be shared
        model_id += f"#cp{getattr(storage_config, 'attn_cp_rank', 0)}of{cp_size}"
    draft = draft_identity(host_pool, args)
    if draft:
        model_id += f"#draft={draft}"
    return KVSpec(
        model_id=model_id,
        num_layers=host_pool.layer_num,
        num_kv_heads=host_pool.head_num,
        head_dim=host_pool.head_dim,
        dtype=str(host_pool.dtype).removeprefix("torch."),
        chunk_tokens=host_pool.page_size,
        tp_rank=storage_config.tp_rank,
        tp_size=storage_config.tp_size,
        lora_id=options.get("lora_id"),
        kv_format=sglang_kv_format(layout),
    )


def draft_identity(host_pool, args) -> str:
    """The speculative draft model whose layers SGLang packs into the host pool after the target's (NextN/MTP:
    `layer_num` > `target_layer_num`), where it is not the target's own checkpoint: its KV comes from its weights.
    "" where the pool has no draft layers, the draft is the target's checkpoint, or no server args say it."""
    target_layers = getattr(host_pool, "target_layer_num", host_pool.layer_num)
    path = getattr(args, "speculative_draft_model_path", None)
    if host_pool.layer_num <= target_layers or not path or path == getattr(args, "model_path", None):
        return ""
    if os.path.isdir(path):
        ident = local_model_id(path)
    else:
        ident = f"{path}@{getattr(args, 'speculative_draft_model_revision', None) or ''}"
    if getattr(args, "speculative_draft_load_format", None) == "dummy":
        ident += "#weights=dummy"
    quantization = getattr(args, "speculative_draft_model_quantization", None)
    return ident + (f"#q={quantization}" if quantization else "")


def sglang_kv_format(layout: str) -> KVFormat:
    """The format of the pages this backend writes: SGLang's host pool layout (read through `chunk_view`)."""
    return KVFormat("sglang", f"host:{layout}", SGLANG_FORMAT_VERSION)


def pool_feature(name: str) -> str:
    """The model feature an SGLang host pool other than "kv" stands for."""
    for prefix, feature in _POOL_FEATURES:
        if name == prefix or name.startswith(prefix + "_"):
            return feature
    return f"an extra KV pool {name!r}"


def page_keys(group: bytes, keys: list[str]) -> list[bytes]:
    """kvmesh chunk keys of SGLang page keys, in `group`'s generation (see the module docstring)."""
    return [
        hashlib.blake2b(group + k.encode("utf-8"), digest_size=HASH_BYTES, person=b"kvmesh.sglang").digest()
        for k in keys
    ]


def chunk_view(page: torch.Tensor, layout: str) -> torch.Tensor:
    """One host-pool page, shaped as `get_data_page(i, flat=False)` gives it, viewed (no copy) as a kvmesh chunk
    [layers, 2 (K, V), page, kv_heads, head_dim]."""
    if layout == "layer_first":  # [2, L, P, H, D]
        return page.transpose(0, 1)
    if layout == "page_first":  # [2, P, L, H, D]
        return page.permute(2, 0, 1, 3, 4)
    if layout == "page_first_direct":  # [2, 1, L, P, H, D]
        return page[:, 0].transpose(0, 1)
    if layout == "page_head":  # [2, 1, H, P, L, D]
        return page[:, 0].permute(3, 0, 2, 1, 4)
    raise ValueError(f"unsupported host pool layout {layout!r}")
