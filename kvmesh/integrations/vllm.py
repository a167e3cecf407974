"""vLLM KV connector: `KVMeshConnector`, so vLLM engines on different Ray nodes share prefix KV through kvmesh.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVMeshConnector",
        "kv_connector_module_path": "kvmesh.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"ray_address": "auto"}}'

vLLM builds two instances per engine (`KVConnectorBase_V1`): a scheduler-side one (what to load and save:
kvmesh.integrations.vllm_scheduler) and one per worker (moving the bytes: kvmesh.integrations.vllm_worker). With
`VLLM_ENABLE_V1_MULTIPROCESSING=0` both live in the engine's process. Every hook is guarded: a kvmesh failure is a
miss or a recompute, counted in `counts` (the client's counters: lookups, hits, miss_<reason>, fetched/stored
chunks, vllm_* for the connector's own), and never an exception into vLLM.

Loads. `get_num_new_matched_tokens` makes one directory round trip for the longest run of cached chunks after
vLLM's own prefix cache, cut by the cost model (`cost_model`, fed with the prefill and fetch times the workers
measure). With `load_mode="async"` (the default) the request waits outside the batch while the worker's loader
thread fetches and writes its blocks, whatever the order of the worker hooks; with `"sync"` the load runs in the
step that needs it and layer i's attention waits only for layer i's blocks. Chunks that fail to arrive (a dead
holder, a deadline, a checksum) are reported through `get_block_ids_with_load_errors` and vLLM recomputes them:
the connector sets vLLM's `kv_load_failure_policy` to "recompute" (a cache miss must not fail a request).

Saves. The prompt chunks that become fully computed in a step are gathered from their blocks after the step's
forward pass (one indexed read per layer into a staging tensor) and handed to the local KVNode by the worker's
saver thread (`store_keys`, asynchronous). The copy into staging is the one thing a save costs the step loop
(`save_copy="inline"`, the default on the CPU); with `"background"` (the default on GPUs) even that runs after the
step, and then `request_finished` keeps a finished request's blocks until its copies are done, and
`handle_preemptions` holds back the reuse of a preempted request's blocks the same way.

Identity. Chunks are keyed by kvmesh's own chained hashes of the prompt's token ids (kvmesh.hashing) under a spec
derived from the vLLM config (kvmesh.integrations.vllm_options.specs_for_vllm): model name and revision, or a local
model directory's fingerprint, KV dtype (and the compute dtype when it differs), quantization, config overrides,
layers, KV heads per TP shard, head dim, TP rank and size, chunk tokens (a multiple of the block size), the
request's LoRA adapter, the KV cache group (one spec per group: a hybrid model's full-attention and sliding-window
layers never mix), and the KV format (`vllm_kv_format`: "vllm", the block layout this connector learned on the CPU
or selected on a GPU, and `VLLM_FORMAT_VERSION`); the salt is the request's `cache_salt` (behind the engine's
`cache_salt` option if set). Engines whose specs differ never share a chunk. The bytes of a chunk are in kvmesh's
engine-neutral order, [layers, 2, chunk_tokens, kv_heads, head_dim] (kvmesh.paged converts each platform's block
layout); with `kv_format="neutral"` the format is left out of the identity, so vLLM and a transformers worker of
the same model and spec share chunks.

Hybrid models. The connector supports vLLM's hybrid allocator (`SupportsHMA`): with full-attention and
sliding-window layers, each group is loaded and saved on its own, a sliding-window group only within its window
(see kvmesh.integrations.vllm_scheduler). Mamba state, chunked local attention, MLA and encoder-decoder models are
refused at start-up (vllm_options.groups_for_vllm).

Ray. The engine process joins Ray (`ray_address`, default `$RAY_ADDRESS` or "auto") unless it is already connected
(e.g. an engine inside a Ray actor), and uses the KVNode of `ray_node_id` (default `$KVMESH_RAY_NODE_ID`, else the
node its Ray connection lands on).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvmesh.integrations.vllm_meta import StepMeta
from kvmesh.integrations.vllm_options import ConnectorOptions, background_save_copy, parse_options, specs_for_vllm
from kvmesh.integrations.vllm_scheduler import SchedulerSide
from kvmesh.integrations.vllm_worker import WorkerSide
from kvmesh.raybootstrap import ensure_ray, local_node_id
from kvmesh.spec import KVFormat

log = logging.getLogger("kvmesh.vllm")
# Bumped whenever this connector changes how it writes a chunk's bytes: chunks written before are then never read.
VLLM_FORMAT_VERSION = 1
_SOURCES = {"host": CacheHitSource.HOST, "p2p": CacheHitSource.P2P, "disk": CacheHitSource.DISK}


def _ensure_ray(options: ConnectorOptions) -> None:
    ensure_ray(options.ray_address, "kvmesh-vllm")


def _connector_for(options: ConnectorOptions):
    """spec -> a KVMeshClient on this engine's node, with the connector's overrides."""
    from kvmesh.connecting import connect

    node_id = local_node_id(options.ray_node_id)
    extra: dict[str, Any] = {"fetch_timeout_s": options.fetch_timeout_s} if options.fetch_timeout_s else {}
    # the scheduler reports each request's reuse (record_request); the workers' fetches (per TP rank, per KV group)
    # would count the same tokens again
    return lambda spec: connect(spec, options.redis_url, node_id=node_id, count_fetches=False, **extra)


def _cpu_writer(vllm_config, block_size: int, head_dim: int, num_kv_heads: int):
    """The CPU backend's own cache-write kernel, as kvmesh.paged.learn_codec wants it."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    cache_dtype = vllm_config.cache_config.cache_dtype
    isa = _get_attn_isa(vllm_config.model_config.dtype, block_size, head_dim, cache_dtype)
    compute = vllm_config.model_config.dtype  # the kernel takes K/V in the model's dtype, whatever the cache's

    def write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor) -> None:
        n = cache.shape[0]
        k_cache, v_cache = cache.view(n, num_kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            key.to(compute).contiguous(),
            value.to(compute).contiguous(),
            k_cache,
            v_cache,
            torch.arange(block_size, 2 * block_size),
            isa,
            kv_cache_dtype=cache_dtype,
        )

    return write


def _fp8_view_dtype(cache_dtype: str | None) -> torch.dtype | None:
    """The fp8 format an engine's quantized KV cache holds (vLLM keeps it as uint8), None for "auto"."""
    if not cache_dtype or cache_dtype == "auto":
        return None
    if cache_dtype in ("fp8", "fp8_e4m3"):  # (vLLM's CPU and CUDA "fp8": e4m3fn)
        return torch.float8_e4m3fn
    if cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    raise ValueError(f"kvmesh vLLM connector: kv_cache_dtype {cache_dtype!r} is not supported on the CPU backend")


def learn_cpu_codec(vllm_config, block_size: int, head_dim: int, num_kv_heads: int, kv_dtype: torch.dtype):
    """How vLLM's CPU kernel packs a block (kvmesh.paged.learn_codec). An fp8 cache stores K/V as one byte each:
    the coordinates go through the kernel as digits exact in fp8, and the block's bytes are read back as fp8."""
    from kvmesh.paged import learn_codec

    writer = _cpu_writer(vllm_config, block_size, head_dim, num_kv_heads)
    shape = (num_kv_heads, block_size, 2 * head_dim)
    fp8 = _fp8_view_dtype(vllm_config.cache_config.cache_dtype)
    if fp8 is None:
        return learn_codec(writer, shape, block_size, num_kv_heads, head_dim, kv_dtype)

    def write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor) -> None:
        raw = torch.zeros(cache.shape, dtype=kv_dtype)
        writer(key, value, raw)
        cache.copy_(raw.view(fp8).to(cache.dtype))

    return learn_codec(write, shape, block_size, num_kv_heads, head_dim, torch.float32, digit_base=8)


def vllm_kv_format(vllm_config, kv_spec) -> KVFormat:
    """The KV format of this engine's chunks: on the CPU the block packing learned from vLLM's own cache-write
    kernel (its ISA and a digest of the permutation: an engine whose kernel packs differently gets another
    format), on a GPU the head-major logical view kvmesh reads (kvmesh.paged.HeadMajorCodec) and the attention
    backend when one is configured."""
    import hashlib

    bs, heads, head = kv_spec.block_size, kv_spec.num_kv_heads, kv_spec.head_size
    device = vllm_config.device_config.device_type
    if device == "cpu":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(vllm_config.model_config.dtype, bs, head, vllm_config.cache_config.cache_dtype)
        codec = learn_cpu_codec(vllm_config, bs, head, heads, kv_spec.dtype)
        digest = hashlib.blake2b(codec.to_block.numpy().tobytes(), digest_size=8).hexdigest()
        layout = f"cpu:{isa}:bs{bs}:{digest}"
    else:
        backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        layout = f"{device}:head-major:bs{bs}" + (f":{getattr(backend, 'name', backend)}" if backend else "")
    return KVFormat("vllm", layout, VLLM_FORMAT_VERSION)


class KVMeshConnector(KVConnectorBase_V1, SupportsHMA):
    """kvmesh as vLLM's external prefix cache (see the module docstring)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("kvmesh vLLM connector: vLLM gave no KV cache config (vLLM >= 0.32 is required)")
        self.options = parse_options(self._kv_transfer_config.kv_connector_extra_config)
        _ensure_ray(self.options)
        groups = kv_cache_config.kv_cache_groups
        tp_rank = 0
        if role == KVConnectorRole.WORKER:
            try:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                tp_rank = get_tensor_model_parallel_rank()
            except Exception:  # not initialised (a single worker)
                tp_rank = 0
        kv_format = (
            vllm_kv_format(vllm_config, groups[0].kv_cache_spec)
            if self.options.kv_format == "engine" and groups
            else None
        )
        specs = specs_for_vllm(vllm_config, kv_cache_config, self.options, tp_rank, kv_format=kv_format)
        if len(groups) > 1 and self.options.load_mode == "sync":
            raise ValueError(
                "kvmesh vLLM connector: load_mode='sync' is not supported for a model with several KV cache groups "
                f"({len(groups)}: sliding-window and full-attention layers): vLLM cannot recompute a failed load "
                "made in the step there; use load_mode='async' (the default)"
            )
        spec = specs[0]
        block_size = groups[0].kv_cache_spec.block_size
        kv_role = self._kv_transfer_config.kv_role
        connect = _connector_for(self.options)
        background = background_save_copy(self.options, vllm_config.device_config.device_type)
        if background and any(s.window for s in specs):
            # vLLM frees a sliding window's blocks while the request runs: copy them out within the step
            log.info("kvmesh: save copies run inline (the model has sliding-window layers)")
            background = False
        self._idle_step = False  # the current step ran no forward pass (worker side)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(specs, connect, self.options, block_size, kv_role, background)
            self.counts = self._sched.counts
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.info("kvmesh: setting kv_load_failure_policy to 'recompute' (a failed load is a cache miss)")
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
        else:
            self._worker = WorkerSide(
                specs, connect, self.options, block_size, kv_role, [g.layer_names for g in groups], background
            )
            self.counts = self._worker.counts
        self.spec, self.specs = spec, specs
        log.info(
            "kvmesh vLLM connector (%s) on node %s: %s",
            role.name,
            (self._sched or self._worker_side).client(None).node_id,
            specs,
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return (extra_config or {}).get("load_mode") == "sync"  # layer-wise waits run between graph pieces

    def _guard(self, what: str, fallback, fn, *args):
        try:
            return fn(*args)
        except Exception as e:
            self.counts[f"vllm_errors_{what}"] += 1
            log.warning("kvmesh: %s failed: %s", what, e, exc_info=log.isEnabledFor(logging.DEBUG))
            return fallback

    @property
    def _sched_side(self) -> SchedulerSide:
        assert self._sched is not None, "a scheduler-side call on a worker-side connector"
        return self._sched

    @property
    def _worker_side(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on a scheduler-side connector"
        return self._worker

    # -- scheduler side -------------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._guard("lookup", (0, False), self._sched_side.lookup, request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:  # allocated() plans a job (a failing one at worst) and never raises
            null = next((b.block_id for group in blocks.blocks for b in group if b.is_null), None)
            self._sched_side.allocated(
                request, [list(ids) for ids in blocks.get_block_ids()], num_external_tokens, null
            )

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        got = self._guard("sources", {}, self._sched_side.sources, request, num_external_tokens)
        out = {_SOURCES[k]: v for k, v in got.items()}
        if sum(out.values()) != num_external_tokens:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return out

    def build_connector_meta(self, scheduler_output) -> StepMeta:
        return self._guard("build", StepMeta(), self._sched_side.build_step, scheduler_output)

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched_side.prefix_cache = kv_cache_manager

    def update_connector_output(self, connector_output) -> None:
        # (vLLM has rolled back the requests that hold failed blocks by now, and left those blocks in its prefix
        # cache under the recompute policy: see SchedulerSide.uncache_failed)
        self._guard("uncache", None, self._sched_side.uncache_failed, connector_output.invalid_block_ids)
        self._guard(
            "output",
            None,
            self._sched_side.worker_output,
            connector_output.finished_recving,
            connector_output.kv_connector_worker_meta,
        )

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        # no guard: keeping blocks that no worker will report would leak them, and the check cannot fail
        return self._sched_side.finished(request), None

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict | None]:
        return self._sched_side.finished(request), None  # the same: loads and saves of every group end together

    # -- worker side ----------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        learn = None
        if first.device.type == "cuda":  # the fused device checksum compiles here, not in the first load's step
            from kvmesh.tiers.devsum import fused_ok

            fused_ok(first.device)
        if first.device.type == "cpu":
            s = self.spec
            bs = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size  # every group has this geometry

            def learn():
                return learn_cpu_codec(self._vllm_config, bs, s.head_dim, s.num_kv_heads, s.torch_dtype)

        self._worker_side.register(kv_caches, learn)  # a layout kvmesh cannot move is a configuration error: raise

    def handle_preemptions(self, kv_connector_metadata) -> None:
        self._guard("preempt", None, self._worker_side.begin_step, kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        # vLLM calls this in every step; a step without a forward pass has no attention metadata
        self._idle_step = getattr(forward_context, "attn_metadata", None) is None
        meta = self._connector_metadata
        if isinstance(meta, StepMeta) and meta.loads:
            self._worker_side.start_loads(meta)  # fails individual loads itself, never raises

    def wait_for_layer_load(self, layer_name: str) -> None:
        meta = self._connector_metadata if isinstance(self._connector_metadata, StepMeta) else None
        self._guard("wait_layer", None, self._worker_side.wait_layer, layer_name, meta)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        return  # the saver reads whole chunks once per step (wait_for_save), not one layer per call

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, StepMeta):
            self._guard("save", None, self._worker_side.end_step, meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        idle, self._idle_step = self._idle_step, False
        return self._worker_side.finished(finished_req_ids, idle)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side.load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]):
        """vLLM's `get_finished`, with the failed loads of a model with several KV cache groups: vLLM maps failed
        block ids back to requests only with one group (and stops the engine otherwise), so those come per
        request, which it recomputes from the first token."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker_side.failed_requests() if self._worker is not None else set()
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), failed)

    def build_connector_worker_meta(self):
        return self._worker_side.take_report()

    def shutdown(self) -> None:
        for side in (self._sched, self._worker):
            if side is not None:
                self._guard("shutdown", None, side.close)
