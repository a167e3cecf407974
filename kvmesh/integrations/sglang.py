"""SGLang HiCache L3 storage backend: `KVMeshStorage`, so SGLang engines on different nodes share prefix KV.

SGLang keeps its L1 (GPU) and L2 (host) tiers private to each engine; its L3 `HiCacheStorage` backend is the one
tier that can span nodes. Load it with

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \
      '{"backend_name": "kvmesh", "module_path": "kvmesh.integrations.sglang", "class_name": "KVMeshStorage",
        "interface_v1": 1, "ray_address": "auto", ...}'

SGLang constructs it as `KVMeshStorage(storage_config, kwargs)` in its scheduler process, then registers the host
pool, whose geometry completes the kvmesh spec. Primitives (the backend never raises out of a batch call and never
answers one with None: failures become misses or False entries, counted in `counts`):

    batch_exists(keys, extra_info) -> int      read, one directory round trip: leading pages with a live holder
    batch_get_v1(keys, host_indices) -> [bool] reads: pages from this node's slab or a peer into the host pool
    batch_set_v1(keys, host_indices) -> [bool] mutates: pages from the host pool into this node's tier, waited for
    get/set/exists, batch_get/batch_set         the same through flat page tensors (SGLang's older interface)
    clear()                                     mutates: a new generation for this spec and salt, cluster-wide
    get_stats() -> StorageMetrics               pages and bandwidth per call since the last get_stats

Identity. SGLang names pages by chained SHA-256 page hashes (seeded by the request's extra_key/cache_salt); token
ids never reach an L3 backend. A kvmesh chunk is one SGLang page (`chunk_tokens` = page size), and its key mixes
SGLang's page key into kvmesh's own namespace, so engines whose specs differ never share a page, whatever SGLang's
keys say. Byte layout (written down once):

    root  = hashing.root_hash(spec.namespace, cache_salt)
    gen   = the generation of (spec, salt): an integer in Redis at  P:sglang:{<root hex>}:gen  (created at a random
            number: see _GEN_AT_LEAST)
    group = BLAKE2b-128(root ‖ gen as <u8,                        person=b"kvmesh.sglgrp")
    key_i = BLAKE2b-128(group ‖ SGLang page key i as UTF-8,       person=b"kvmesh.sglang")

SGLang's page key already names its whole prefix, so key_i does too. The spec comes from the storage config, the
host pool and SGLang's server args: model id (name plus revision, or a fingerprint of a local model directory's
files; then `--load-format dummy`, `--quantization`, a `--json-model-override-args` digest, a `--dtype` other than
the pool's, and `--kv-cache-dtype` where it is not "auto" — a pool stored as uint8, as every fp8 format is, is refused
unless that or extra_config kv_cache_dtype names the format, and refused where the two differ: e4m3 and e5m2 pages are
the same bytes and other values), dtype, layers, KV heads, head dim, page size, TP rank and size (pipeline stages
add their layer range to the model id, attention-CP ranks their CP rank, and a NextN draft model that SGLang packs
into the pool, other than the target's checkpoint, its identity), and the KV format (`sglang_kv_format`: "sglang",
the host pool's layout and `SGLANG_FORMAT_VERSION`, bumped whenever this backend changes how it writes a page), so
engines whose pools differ in layout never share a page.

Weight updates. SGLang's `update_weights_from_*` change the weights under a running engine (and flush its own
tiers, not L3): the backend follows them (`follow_weight_updates`), from then on with the new weights' identity (a
local checkpoint directory's fingerprint, else one no other engine shares), and writes nothing until SGLang has
emptied its tiers of the old weights' pages.

Sliding-window models. SGLang keeps a Mistral- or Gemma-2-style model's KV in one uniform pool (every token of every
layer; the window is applied by attention), which this backend stores and loads whole. Its hybrid pools (an SWA
pool beside the full one, Mamba state, DSA indexer keys, DeepSeek-V4's compressed KV, draft-model KV) are refused
when SGLang registers them, at start-up, with an error naming the feature.

The directory group. All pages of one (spec, salt, generation) are registered in one directory group, so a lookup
is one HMGET whatever pages SGLang asks about: SGLang queries and writes from any page of a sequence, not just the
first, and passes the preceding keys only when `hicache_storage_pass_prefix_keys` is set. The cost is one Redis
Cluster slot per model shard and salt.

Ray. The backend runs inside SGLang's scheduler process and needs a Ray connection (`ray_address`, default
`$RAY_ADDRESS` or "auto") and the node whose KVNode is its local one (`ray_node_id`, default
`$KVMESH_RAY_NODE_ID`, else the node that connection lands on: on a real cluster with one raylet per host, the
engine's own). An engine started inside a Ray actor can export its node id as `KVMESH_RAY_NODE_ID` for its
children.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import threading
import time
import weakref
from collections import Counter
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvmesh.client import KVMeshClient, connect
from kvmesh.hashing import HASH_BYTES, client_salt, root_hash
from kvmesh.integrations.identity import local_model_id, model_fingerprint  # noqa: F401 (model_fingerprint: API)
from kvmesh.integrations.options import SGLANG
from kvmesh.raybootstrap import ensure_ray, local_node_id
from kvmesh.spec import KVFormat, KVSpec
from kvmesh.storequeue import refusals

log = logging.getLogger("kvmesh.sglang")
# the generation counter, raised to at least ARGV[1] (what the caller knows), then by ARGV[2]: one atomic step. A
# counter that is not there starts at ARGV[3], a random number (GEN_START): a Redis that lost the counter (its data)
# while every engine that knew it restarted must not send them back to a generation the nodes still hold pages of
# from before a clear (they re-register everything they hold after such a loss). So a generation is never 0 either.
# Only an engine that read the counter lately (`_trust_s`) puts back what it knows: one idle since then may have
# missed a clear, and putting back the generation that clear left would bring its pages back for everyone.
_GEN_AT_LEAST = """
local v = tonumber(redis.call('GET', KEYS[1]) or ARGV[3])
if v < tonumber(ARGV[1]) then v = tonumber(ARGV[1]) end
v = v + tonumber(ARGV[2])
redis.call('SET', KEYS[1], v)
return v
"""
GEN_START = 1 << 40  # a missing counter starts at a random number in [1, GEN_START] (exact in Lua's doubles and in
# every number-to-string conversion Redis's Lua makes; a clash with one earlier generation: 2^-40)


def _gen_start() -> int:
    return 1 + secrets.randbelow(GEN_START)


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


def generation_key(key_prefix: str, root: bytes) -> str:
    """The Redis key of the generation counter of (spec, salt) `root` (see the module docstring)."""
    return f"{key_prefix}:sglang:{{{root.hex()}}}:gen"


def generation_group(root: bytes, generation: int) -> bytes:
    return hashlib.blake2b(
        root + generation.to_bytes(8, "little"), digest_size=HASH_BYTES, person=b"kvmesh.sglgrp"
    ).digest()


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


_LIVE: weakref.WeakSet = weakref.WeakSet()  # this process's backends, told of weight updates and flushes


def follow_weight_updates() -> None:
    """Tell this process's backends when SGLang loads other weights (`update_weights_from_disk`, `_from_tensor`,
    `_from_distributed`, `_from_ipc`: each ends in `flush_cache_after_weight_update`) and when it has emptied its
    own tiers since (`HiCacheController.reset`, which a flush runs). Without it the engine went on reading the old
    weights' pages for its prompts, and wrote its new weights' pages as the old ones' for engines that still run
    them. Patched once per process."""
    try:
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    except ImportError:  # (an SGLang that updates weights elsewhere, or not at all)
        log.warning("kvmesh: this SGLang's weight updates are not followed; restart engines to change weights")
        return
    updated, reset = SchedulerWeightUpdaterManager.flush_cache_after_weight_update, HiCacheController.reset
    if getattr(updated, "_kvmesh", False):
        return

    def flush_cache_after_weight_update(self, recv_req, *args, **kwargs):
        for backend in list(_LIVE):  # (before SGLang's flush, which ends the backends' stale state)
            backend.weights_updated(getattr(recv_req, "model_path", None), getattr(recv_req, "load_format", None))
        return updated(self, recv_req, *args, **kwargs)

    def reset_tiers(self, *args, **kwargs):
        out = reset(self, *args, **kwargs)
        for backend in list(_LIVE):
            backend.stale = False
        return out

    flush_cache_after_weight_update._kvmesh = True  # type: ignore[attr-defined]
    SchedulerWeightUpdaterManager.flush_cache_after_weight_update = flush_cache_after_weight_update
    HiCacheController.reset = reset_tiers


class KVMeshStorage(HiCacheStorage):
    """SGLang's L3 tier in kvmesh. Thread-safe: SGLang calls it from its prefetch and backup threads."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        self.storage_config = storage_config
        self.options = parse_options(storage_config.extra_config)
        if storage_config.is_mla_model:
            raise ValueError("kvmesh SGLang backend: MLA models are not supported (kvmesh chunks hold K and V)")
        if storage_config.should_split_heads:
            raise ValueError(
                "kvmesh SGLang backend: split-head storage (TP sizes of different engines mixed) is not supported"
            )
        client_salt(self.options.get("cache_salt"))  # (the client's: refused here, not when SGLang registers)
        self.counts: Counter[str] = Counter()  # becomes the client's counts (exported with them) once connected
        self.client: KVMeshClient | None = None  # these three are set once SGLang registers its host pool
        self.spec: KVSpec | None = None
        self.mem_pool_host: Any = None  # SGLang's host pool
        self._io = threading.Lock()  # fetch and store share the client's buffers
        self._gen_lock = threading.Lock()
        self._root = b""
        self._generation = 0
        self._group = b""
        self._gen_at = 0.0  # when the counter was last asked for
        self._gen_seen_at = 0.0  # when it was last read (or put back) by this engine
        self._gen_lost_at = 0.0  # when this engine, too long idle to put it back, first found it missing
        self._scratch: torch.Tensor | None = None
        self._loaded: str | None = None  # the identity of weights SGLang loaded since it started, if any
        # the weights changed and SGLang has not emptied its tiers since: the pages it backs up may be the old
        # weights' (a flush refused while requests ran leaves them there), so none is written
        self.stale = False
        self._metrics: dict[str, list] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }
        ensure_ray(self.options.get("ray_address"), "kvmesh-sglang")
        follow_weight_updates()
        _LIVE.add(self)

    # -- registration -------------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """SGLang hands over its host pool: its geometry completes the spec, and the client connects."""
        super().register_mem_pool_host(mem_pool_host)
        spec = spec_for_pool(self.storage_config, mem_pool_host, self.options, server_args(), self._loaded)
        if self.client is not None and spec == self.spec:
            return
        node_id = local_node_id(self.options.get("ray_node_id"))
        try:
            client = connect(
                spec, self.options.get("redis_url"), cache_salt=self.options.get("cache_salt"), node_id=node_id
            )
        except RuntimeError as e:
            if node_id is None or "Ray node" not in str(e):
                raise
            named = "extra_config['ray_node_id']" if self.options.get("ray_node_id") else "$KVMESH_RAY_NODE_ID"
            raise ValueError(f"kvmesh SGLang backend: {named} is {node_id!r}: {e}") from None
        client.counts.update(self.counts)
        # one switch (another spec: another generation counter, another chunk shape): a get or set on another
        # thread must not refresh the old spec's generation into `_generation` between the reset and the new root
        # (the forced refresh below would then write it into the new spec's counter), nor use a closed client
        with self._io, self._gen_lock:
            old = self.client
            self.client, self.spec, self.counts = client, spec, client.counts
            self._layout = mem_pool_host.layout
            self._page_shape = tuple(mem_pool_host.get_data_page(0, flat=False).shape)
            self._root = root_hash(spec.namespace, self.options.get("cache_salt"))
            self._scratch, self._generation, self._group, self._gen_at = None, 0, b"", 0.0
            self._gen_seen_at = self._gen_lost_at = 0.0
        if old is not None:
            old.close()
        self._refresh_generation(force=True)
        if spec.chunk_bytes * 8 < client.config.slot_bytes:
            log.warning(
                "kvmesh: an SGLang page is %d bytes but the nodes' slots are %d bytes; most of each slot "
                "is wasted (set slot_bytes near the page size)",
                spec.chunk_bytes,
                client.config.slot_bytes,
            )
        log.info("kvmesh SGLang backend on node %s: %s", client.node_id, spec)

    def weights_updated(self, model_path: str | None, load_format: str | None = None) -> None:
        """SGLang loaded other weights: from now on this engine's pages are theirs, under their identity (a local
        directory's fingerprint, shared with engines that run that checkpoint; any other weights, from tensors, a
        trainer or a hub name, get an identity of their own that no other engine shares); none is written until
        SGLang has emptied its tiers (`stale`)."""
        self.stale = True
        if model_path and os.path.isdir(model_path) and load_format != "dummy":
            self._loaded = local_model_id(model_path)
        else:
            self._loaded = f"weights-update:{secrets.token_hex(16)}"
        if self.mem_pool_host is None:  # (registered later: with these weights' identity)
            return
        try:
            self.register_mem_pool_host(self.mem_pool_host)
            self.counts["sglang_weight_updates"] += 1
        except Exception as e:  # never the old identity for the new weights: no L3 until the engine restarts
            log.warning("kvmesh: weights changed and the backend could not follow (%s); storage is off", e)
            self.counts["sglang_errors_weight_update"] += 1
            self.close()

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name != "kv":  # SGLang registers its pools at start-up: the engine refuses to start, naming why
            raise ValueError(
                f"kvmesh SGLang backend: the model has {pool_feature(name)} (host pool {name!r}), "
                f"which kvmesh does not support; only models with one uniform KV pool are"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    # -- generation (clear) ---------------------------------------------------------------------------------------
    def _gen_key(self) -> str:
        assert self.client is not None, "registered"
        return generation_key(self.client.config.key_prefix, self._root)

    def _trust_s(self) -> float:
        """How lately this engine must have read the counter to put back, when it is missing, the generation it
        knows (a clear reaches every engine within `generation_refresh_s`; this allows ten of those)."""
        return max(10 * self.options.get("generation_refresh_s", 1.0), 10.0)

    def _refresh_generation(self, force: bool = False) -> bytes:
        """The directory group of the current generation, re-read at most every `generation_refresh_s`; b"" while
        the generation is unknown (the counter is missing and this engine cannot vouch for the one it knew)."""
        now = time.monotonic()
        due = force or now - self._gen_at > self.options.get("generation_refresh_s", 1.0)
        # (not while the client's breaker is open: the directory failed moments ago, and a read would wait out
        # Redis's socket timeout on SGLang's prefetch thread, at every refresh, for nothing)
        client = self.client
        if due and (client is None or force or client.view.allow()):
            with self._gen_lock:
                self._gen_at = now
                client = self.client  # (the one of `_root` now: a re-registration may have switched both)
                try:
                    assert client is not None, "registered"
                    gen = self._read_generation(client.directory.redis, now)
                except Exception as e:  # Redis away: keep the last generation
                    self.counts["sglang_generation_errors"] += 1
                    log.debug("kvmesh: generation read failed: %s", e)
                    if client is not None:
                        client.view.failed()
                    gen = self._generation
                if gen is None:
                    self._group = b""
                elif gen != self._generation or not self._group:
                    self._generation, self._group = gen, generation_group(self._root, gen)
        return self._group

    def _read_generation(self, r, now: float) -> int | None:
        """The counter's value, put back first where it is missing or lower than what this engine knows and may
        vouch for (it read the counter within `_trust_s`); None: missing, and this engine may not put it back yet."""
        key = self._gen_key()
        raw = r.get(key)
        vouch = bool(self._generation) and now - self._gen_seen_at <= self._trust_s()
        if raw is None:  # a new spec and salt, or a directory that lost the counter (its data, an older snapshot)
            if vouch:  # put back the generation this engine knows
                raw = r.eval(_GEN_AT_LEAST, 1, key, self._generation, 0, self._generation)
            elif not self._generation or now - (self._gen_lost_at or now) >= self._trust_s():
                # a first engine of this spec, or nobody who could vouch put it back in time: a random start
                raw = r.eval(_GEN_AT_LEAST, 1, key, 0, 0, _gen_start())
            else:  # an engine idle since its last read may have missed a clear: wait for one that has not
                if not self._gen_lost_at:
                    self._gen_lost_at = now
                    self.counts["sglang_generation_unknown"] += 1
                    log.warning(
                        "kvmesh: the generation counter is missing; waiting up to %.0f s for an engine that "
                        "knows the current generation to put it back (misses meanwhile)",
                        self._trust_s(),
                    )
                return None
        gen = int(raw)
        if gen < self._generation:  # the directory forgot it (lost its data, or went back to an older snapshot):
            # put back what this engine knows, or a later clear would reuse a generation whose pages the nodes
            # still hold (and re-register after such a loss): cleared pages back. One that cannot vouch for it
            # knows only that neither number is safe: a fresh one, above both
            at_least = self._generation if vouch else self._generation + _gen_start()
            gen = int(r.eval(_GEN_AT_LEAST, 1, key, at_least, 0, _gen_start()))
        self._gen_seen_at, self._gen_lost_at = now, 0.0
        return gen

    def clear(self) -> None:
        """Forget every page of this spec and salt, cluster-wide: a new generation (engines of this spec see it
        within `generation_refresh_s`); the old directory group is deleted and nodes evict its bytes in time."""
        if self.client is None:
            return
        try:
            r = self.client.directory.redis
            old = self._refresh_generation(force=True)
            # (never a generation seen before: above what this engine knows, and where the counter is missing and
            # that may be out of date (`_read_generation`), above anything it could have been since)
            at_least = self._generation if old else self._generation + _gen_start()
            gen = int(r.eval(_GEN_AT_LEAST, 1, self._gen_key(), at_least, 1, _gen_start()))
            if old:
                r.delete(*self.client.directory.group_keys(old))  # (its entries and its summaries: one slot)
            with self._gen_lock:  # (it wrote the counter: it knows the current generation)
                self._generation, self._group = gen, generation_group(self._root, gen)
                self._gen_seen_at, self._gen_lost_at = time.monotonic(), 0.0
            self.counts["sglang_clears"] += 1
        except Exception as e:
            self.counts["sglang_errors_clear"] += 1
            log.warning("kvmesh: clear failed: %s", e)

    # -- queries ------------------------------------------------------------------------------------------------
    def _lookup(self, keys: list[str], count: bool = True):
        """The directory's match of `keys`; None while the generation is unknown (a miss)."""
        group = self._refresh_generation()
        assert self.client is not None, "registered"
        if not group:
            return None
        return self.client.lookup_keys(group, page_keys(group, keys), count=count)

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of `keys` some live node holds; one directory round trip."""
        if not keys:
            return 0
        if self.client is None:
            self.counts["sglang_not_registered"] += 1
            return 0
        try:
            match = self._lookup(list(keys))
            n = match.num_chunks if match is not None else 0
        except Exception as e:
            self.counts["sglang_errors_exists"] += 1
            log.warning("kvmesh: batch_exists failed: %s", e)
            return 0
        self.counts["sglang_exists_pages_asked"] += len(keys)
        self.counts["sglang_exists_pages_hit"] += n
        return n

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- reads --------------------------------------------------------------------------------------------------
    def _fetch(self, keys: list[str], write_page) -> int:
        """Fetch the leading cached pages of `keys`; `write_page(i, chunk)` puts page i where SGLang wants it.
        Returns how many pages arrived intact (a failed holder or the deadline truncates)."""
        match = self._lookup(keys, count=False)  # (SGLang asked `batch_exists` first: that lookup is counted)
        n = match.num_chunks if match is not None else 0
        if not n:
            return 0
        s = self.spec
        assert s is not None and self.client is not None, "registered"
        with self._io:
            if self._scratch is None or self._scratch.shape[2] < n * s.chunk_tokens:
                self._scratch = torch.zeros(s.kv_shape(max(n, 16) * s.chunk_tokens), dtype=s.torch_dtype)
            got = self.client.fetch(match, out=self._scratch, deadline_s=self.options.get("fetch_timeout_s"))
            k = got.shape[2] // s.chunk_tokens
            C = s.chunk_tokens
            for i in range(k):
                write_page(i, got[:, :, i * C : (i + 1) * C])
        return k

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Pages of `keys` into the host pool at `host_indices` (page_size slots per key), straight from the
        fetched chunks; True for each page that arrived."""
        t0 = time.monotonic()
        C = self.spec.chunk_tokens if self.spec is not None else 0  # (not registered: _guarded answers 0 pages)
        ok = self._guarded(
            "get",
            len(keys),
            lambda: self._fetch(list(keys), lambda i, chunk: self._host_page(int(host_indices[i * C])).copy_(chunk)),
        )
        self._note("prefetch", ok, t0)
        return [i < ok for i in range(len(keys))]

    def batch_get(self, keys: list[str], target_locations=None, target_sizes=None) -> list:
        """Older interface: pages into `target_locations`, flat tensors in the host pool's page layout."""
        if target_locations is None or len(target_locations) != len(keys):
            self.counts["sglang_errors_get"] += 1
            return [None] * len(keys)
        t0 = time.monotonic()
        ok = self._guarded(
            "get",
            len(keys),
            lambda: self._fetch(list(keys), lambda i, chunk: self._flat_page(target_locations[i]).copy_(chunk)),
        )
        self._note("prefetch", ok, t0)
        return [target_locations[i] if i < ok else None for i in range(len(keys))]

    def get(self, key: str, target_location=None, target_sizes=None):
        if self.client is None:  # not registered yet: a miss (SGLang's single-page get says so with None)
            self.counts["sglang_not_registered"] += 1
            return None
        if target_location is None:
            target_location = self.mem_pool_host.get_dummy_flat_data_page()
        return self.batch_get([key], [target_location])[0]

    # -- writes -------------------------------------------------------------------------------------------------
    def _store(self, keys: list[str], chunks: list[torch.Tensor]) -> bool:
        """Hand the pages not yet cached to the local node and wait until it holds them and registered them."""
        if self.stale:
            self.counts["sglang_set_stale"] += 1
            return False
        group = self._refresh_generation()
        if not group:  # (the generation is unknown for now: see _read_generation)
            self.counts["sglang_set_generation_unknown"] += 1
            return False
        c = self.counts
        refused = refusals(c)
        assert self.client is not None, "registered"
        # (waited for at most a read's deadline: the lock is the prefetch thread's too, and a node that stalls
        # must not hold SGLang's reads behind a write for flush's default 30 s; a write not done by then is one
        # SGLang counts as failed, and the node still stores it)
        timeout = self.options.get("fetch_timeout_s", self.client.config.fetch_timeout_s)
        with self._io:  # (this store's own replies: a flush counted an earlier set's late reply as this one's)
            sent, stored = self.client.store_keys_waited(group, page_keys(group, keys), chunks, timeout)
        return stored == sent and refusals(c) == refused

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        t0 = time.monotonic()
        P = self.spec.chunk_tokens if self.spec else 0
        ok = self._guarded(
            "set",
            len(keys),
            lambda: (
                len(keys)
                if self._store(list(keys), [self._host_page(int(host_indices[i * P])) for i in range(len(keys))])
                else 0
            ),
        )
        self._note("backup", ok, t0)
        return [ok == len(keys)] * len(keys)

    def batch_set(self, keys: list[str], values=None, target_locations=None, target_sizes=None) -> bool:
        """Older interface: `values` are flat tensors in the host pool's page layout."""
        if values is None or len(values) != len(keys):
            self.counts["sglang_errors_set"] += 1
            return False
        t0 = time.monotonic()
        ok = self._guarded(
            "set", len(keys), lambda: len(keys) if self._store(list(keys), [self._flat_page(v) for v in values]) else 0
        )
        self._note("backup", ok, t0)
        return ok == len(keys)

    def set(self, key: str, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    # -- helpers ------------------------------------------------------------------------------------------------
    def _host_page(self, index: int) -> torch.Tensor:
        return chunk_view(self.mem_pool_host.get_data_page(index, flat=False), self._layout)

    def _flat_page(self, flat: torch.Tensor) -> torch.Tensor:
        return chunk_view(flat.view(self._page_shape), self._layout)

    def _guarded(self, what: str, n: int, fn) -> int:
        """Run a batch call's body: any failure is a miss (0 pages), counted and logged, never raised."""
        if not n:
            return 0
        if self.client is None:
            self.counts["sglang_not_registered"] += 1
            return 0
        try:
            ok = fn()
        except Exception as e:
            self.counts[f"sglang_errors_{what}"] += 1
            log.warning("kvmesh: batch %s of %d pages failed: %s", what, n, e)
            ok = 0
        self.counts[f"sglang_{what}_pages_asked"] += n
        self.counts[f"sglang_{what}_pages_ok"] += ok
        return ok

    def _note(self, kind: str, pages: int, t0: float) -> None:
        if pages and self.spec is not None:
            dt = max(time.monotonic() - t0, 1e-9)
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(pages * self.spec.chunk_bytes / dt / 1e9)  # GB/s

    def get_stats(self):
        """SGLang's `StorageMetrics`: pages and GB/s of each get/set since the last call (kvmesh's own counters,
        misses by reason included, are in `counts` and exported with the client's)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m, self._metrics = self._metrics, {k: [] for k in self._metrics}
        return StorageMetrics(**m)

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            finally:
                self.client = None
