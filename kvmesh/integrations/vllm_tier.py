"""kvmesh as a secondary tier of vLLM's native multi-tier offloading (`vllm.v1.kv_offload.tiering`, vLLM >= 0.32).

vLLM's `OffloadingConnector` with the `TieringOffloadingSpec` keeps a CPU primary tier and cascades every chunk it
stores there to its secondary tiers (`fs`, `obj`, `p2p`, ...); a chunk missing from the primary tier is looked up
in them and promoted back. `KVMeshTier` is one of them, loaded by vLLM's tier factory with one entry in
`secondary_tiers`:

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
          "secondary_tiers": [{"type": "KVMeshTier", "module_path": "kvmesh.integrations.vllm_tier",
                               "ray_address": "auto"}]}}'

The contract (vllm/v1/kv_offload/tiering/base.py); every method runs on vLLM's scheduler thread and returns at
once, the directory and the bytes are handled by the tier's own thread:

    lookup(key, req) -> HIT | MISS | RETRY   reads: a key seen for the first time is RETRY; at the step's end
                                             (`on_schedule_end`) each request's new keys of each KV cache group
                                             go to the directory in one round trip; their verdicts (each key
                                             for itself: vLLM asks a sliding-window group's keys from the
                                             prompt's end backwards) answer the next lookups (`verdict_ttl_s`)
    submit_store(job)                        mutates: the job's primary-tier rows (pinned by vLLM until the job
                                             ends) are copied out and handed to this node's KVNode
    submit_load(job)                         mutates: the keys' chunks, from this node's tiers or a peer's, into
                                             the primary-tier rows vLLM allocated; a short fetch reports the
                                             leading keys that arrived (`successful_keys`), the rest become
                                             misses
    get_finished_jobs() -> [JobResult]       the jobs that ended since the last call, with bytes and seconds
                                             (vLLM's tier metrics come from them)
    take_events() -> [OffloadingEvent]       stored keys, when `enable_kv_events` and vLLM's KV events are on
    drain_jobs()                             blocks until no job touches the primary tier
    has_pending_work()                       lookups or jobs in flight: vLLM keeps stepping meanwhile

Identity. A primary-tier row is vLLM's own offload layout (all layers of one KV cache group for
`blocks_per_chunk` blocks, per worker, padded): the tier stores it as opaque bytes, so its spec's format names
that layout (`offload_format`: vLLM's KV cache layout, direct or canonical pages, tokens per hash and block,
blocks per chunk, the groups' layers, the row size, parallelism) and `TIER_FORMAT_VERSION`, and its model id the
model (a local directory's fingerprint, or a hub name with `model_revision`), KV dtype, and what else changes the
KV of the same weights (config overrides, quantization, the compute dtype where it is not the KV dtype: read from
the engine's vLLM config, which vLLM does not hand its tiers; `model_id` names all of it instead). Keys are vLLM's
offload keys (its chained block hash, which already covers the request's cache salt, LoRA and multimodal inputs,
plus the group index) mixed into the spec's namespace:

    root  = hashing.root_hash(spec.namespace)
    group = BLAKE2b-128(root ‖ b"vllm-tier",       person=b"kvmesh.vtgrp")   one directory group per spec
    key   = BLAKE2b-128(group ‖ vLLM offload key,  person=b"kvmesh.vtier")

vLLM's block hashes are the same in every engine only with the same `prefix_caching_hash_algo` and, where it is
set, the same PYTHONHASHSEED (vLLM's default seed is fixed for its cryptographic hashes).

Failures (a dead holder, Redis away, a deadline, a checksum) are misses or failed jobs, never exceptions into vLLM.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvmesh.hashing import HASH_BYTES, root_hash
from kvmesh.integrations.identity import local_model_id
from kvmesh.integrations.options import VLLM_TIER
from kvmesh.integrations.vllm_options import config_identity
from kvmesh.raybootstrap import ensure_ray, local_node_id
from kvmesh.spec import KVFormat, KVSpec

log = logging.getLogger("kvmesh.vllm.tier")
# Bumped whenever this tier changes how it writes a row's bytes: rows written before are then never read.
TIER_FORMAT_VERSION = 1
_LOAD, _LOOKUP, _STORE = 0, 1, 2  # the tier thread's priorities: promotions first, stores last

TIER_OPTIONS = VLLM_TIER.with_choices("locality", tuple(m.value for m in Locality))


def parse_tier_options(options: dict) -> dict:
    """The tier's entries in its `secondary_tiers` config (`options.VLLM_TIER`), type-checked, with defaults; an
    unknown or bad one is an OptionError (a ValueError) naming it."""
    return TIER_OPTIONS.parse(options)


def offload_format(config, row_bytes: int) -> KVFormat:
    """The format of a primary-tier row of this engine (see the module docstring)."""
    cache, par = config.cache, config.parallel
    groups = ",".join(f"{g.group_id}:{g.tokens_per_block}x{len(g.layer_names)}" for g in config.groups)
    pages = "canonical" if getattr(config, "canonical_layout", False) else "direct"
    layout = (
        f"offload:{config.kv_cache_layout or 'default'}:{pages}"
        f"{':replicated' if getattr(config, 'replicated_layout', False) else ''}:hash{cache.tokens_per_hash}"
        f":bpc{cache.blocks_per_chunk}:groups[{groups}]:row{row_bytes}:pp{par.pp_size}:pcp{par.pcp_size}"
        f":dcp{par.dcp_size}:ws{par.world_size}"
    )
    return KVFormat("vllm-offload", layout, TIER_FORMAT_VERSION)


def engine_model_config():
    """vLLM's `ModelConfig` of the engine that is building this tier, or None. The `OffloadingConfig` a tier gets
    names only the model and its KV dtype, while config overrides, quantization and the compute dtype change the
    KV an engine computes from the same weights. vLLM builds the tiers in `OffloadingConnectorScheduler(spec,
    vllm_config, kv_cache_config)` (`spec.get_manager()`), on this thread: its `vllm_config` is on the stack."""
    frame = sys._getframe(1)
    while frame is not None:
        cfg = frame.f_locals.get("vllm_config")
        model_config = getattr(cfg, "model_config", None)
        if model_config is not None:
            return model_config
        frame = frame.f_back
    return None


def tier_spec(config, row_bytes: int, options: dict, model_config=None) -> KVSpec:
    """The spec of this engine's rows: opaque bytes (one uint8 "layer" of 2 halves of row_bytes / 2).
    `model_config`: the engine's vLLM `ModelConfig` where known (`engine_model_config`), for what else changes
    its KV (config overrides, quantization, a compute dtype other than the KV dtype)."""
    if row_bytes % 2:
        raise ValueError(f"kvmesh vLLM tier: a primary-tier row of {row_bytes} bytes is not an even size")
    name = config.model.name
    if "model_id" in options:
        model_id = options["model_id"]
    elif os.path.isdir(name):
        model_id = local_model_id(name)
    elif "model_revision" in options:
        model_id = f"{name}@{options['model_revision']}"
    else:
        raise ValueError(
            f"kvmesh vLLM tier: {name!r} is not a local directory, so kvmesh cannot fingerprint its "
            f"weights; set the tier's model_revision (or model_id)"
        )
    if model_config is not None and "model_id" not in options:  # (a model_id names the configuration itself)
        model_id += config_identity(model_config, "kvmesh vLLM tier: ", "the tier's")
        compute = str(getattr(model_config, "dtype", "")).removeprefix("torch.")
        if compute and compute != config.model.dtype:  # the same weights give other KV in another compute dtype
            model_id += f"#compute={compute}"
    return KVSpec(
        model_id=f"{model_id}#kv={config.model.dtype}",
        num_layers=1,
        num_kv_heads=1,
        head_dim=row_bytes // 2,
        dtype="uint8",
        chunk_tokens=1,
        tp_size=config.parallel.tp_size,
        kv_format=offload_format(config, row_bytes),
    )


def directory_group(spec: KVSpec) -> bytes:
    return hashlib.blake2b(
        root_hash(spec.namespace) + b"vllm-tier", digest_size=HASH_BYTES, person=b"kvmesh.vtgrp"
    ).digest()


def tier_keys(group: bytes, keys: Iterable[OffloadKey]) -> list[bytes]:
    return [hashlib.blake2b(group + bytes(k), digest_size=HASH_BYTES, person=b"kvmesh.vtier").digest() for k in keys]


@dataclass(slots=True)
class _Verdict:
    """What the directory said of one key. Written on the scheduler thread only."""

    present: bool | None = None  # None while its lookup is queued or in flight
    at: float = 0.0  # monotonic time of the answer
    reqs: set[str] = field(default_factory=set)  # requests that asked


class KVMeshTier(SecondaryTierManager):
    """A `SecondaryTierManager` over kvmesh (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.CPU
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.P2P  # this node's tiers or a peer's

    def __init__(
        self, offloading_spec, primary_kv_view: memoryview, tier_type: str, backpressure_detector=None, **options: Any
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.options = parse_tier_options(options)
        if "locality" in self.options:
            self.locality = Locality(self.options["locality"])
        row = self.block_size_bytes
        self.spec = tier_spec(offloading_spec.config, row, self.options, engine_model_config())
        self.group = directory_group(self.spec)
        self.verdict_ttl_s = float(self.options["verdict_ttl_s"])
        rows = np.frombuffer(primary_kv_view.cast("B"), dtype=np.uint8)
        self._rows = torch.from_numpy(rows).view(-1, row)  # the primary tier: row c is chunk slot c
        ensure_ray(self.options.get("ray_address"), "kvmesh-vllm")
        from kvmesh.connecting import connect

        node_id = local_node_id(self.options.get("ray_node_id"))
        extra = {"fetch_timeout_s": self.options["fetch_timeout_s"]} if "fetch_timeout_s" in self.options else {}
        self.client = connect(self.spec, self.options.get("redis_url"), node_id=node_id, **extra)
        self.counts = self.client.counts
        events_on = offloading_spec.kv_events_config.enable_kv_cache_events
        self._events: list[OffloadingEvent] | None = [] if self.options.get("enable_kv_events") and events_on else None
        # scheduler-thread state
        self._verdicts: dict[OffloadKey, _Verdict] = {}
        self._req_keys: dict[str, set[OffloadKey]] = {}
        self._batch: dict[tuple[str, int], list[OffloadKey]] = {}  # (request, group) -> keys asked this step
        self._load_keys: dict[int, list[OffloadKey]] = {}  # job -> keys of an in-flight promotion
        self._store_keys: dict[int, list[OffloadKey]] = {}
        # shared with the tier thread
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # ("job", JobResult) | ("verdicts", [(key, bool)])
        self._finished: list[JobResult] = []  # taken from _done, for the next get_finished_jobs
        self._busy = 0  # tasks queued or running (guarded by _idle)
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name="kvmesh-vllm-tier", daemon=True)
        self._thread.start()
        log.info("kvmesh vLLM tier on node %s: %s", self.client.node_id, self.spec)

    # -- lookups ----------------------------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._take_done()
        v = self._verdicts.get(key)
        if v is not None and v.present is not None and time.monotonic() - v.at > self.verdict_ttl_s:
            v = None  # too old to trust: ask again
        if v is None:
            v = self._verdicts[key] = _Verdict(reqs=self._verdicts[key].reqs if key in self._verdicts else set())
            self._batch.setdefault((req_context.req_id, get_offload_group_idx(key)), []).append(key)
        v.reqs.add(req_context.req_id)
        self._req_keys.setdefault(req_context.req_id, set()).add(key)
        if v.present is None:
            return LookupResult.RETRY
        return LookupResult.HIT if v.present else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        batch, self._batch = self._batch, {}
        for keys in batch.values():  # one directory round trip per request and group, on the tier thread
            self._submit(_LOOKUP, ("lookup", keys))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        for key in self._req_keys.pop(req_context.req_id, ()):
            v = self._verdicts.get(key)
            if v is not None:
                v.reqs.discard(req_context.req_id)
                if not v.reqs and v.present is not None:
                    del self._verdicts[key]

    # -- jobs -------------------------------------------------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._store_keys[job_metadata.job_id] = keys
        self._submit(_STORE, ("store", job_metadata.job_id, keys, [int(c) for c in job_metadata.chunk_ids]))

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._load_keys[job_metadata.job_id] = keys
        self._submit(_LOAD, ("load", job_metadata.job_id, keys, [int(c) for c in job_metadata.chunk_ids]))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._take_done()
        out, self._finished = self._finished, []
        return out

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events:
            out, self._events = self._events, []
            yield from out

    def has_pending_work(self) -> bool:
        with self._idle:
            busy = self._busy
        return bool(
            busy or self._batch or self._load_keys or self._store_keys or self._finished or not self._done.empty()
        )

    def drain_jobs(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._busy == 0)

    def shutdown(self) -> None:
        self.drain_jobs()
        self._q.put((99, next(self._seq), None))
        self._thread.join(timeout=10)
        try:
            self.client.flush(timeout_s=5)
        except Exception as e:
            log.debug("kvmesh: flush at shutdown failed: %s", e)
        self.client.close()

    # -- scheduler-thread side of the results -----------------------------------------------------------------
    def _take_done(self) -> None:
        """Apply what the tier thread finished: verdicts now, job results kept for `get_finished_jobs` (also called
        from `lookup`, whose caller never sees them: a job result dropped there is a promotion vLLM waits for
        forever, its primary-tier slots never ready)."""
        now = time.monotonic()
        while True:
            try:
                kind, payload = self._done.get_nowait()
            except queue.Empty:
                return
            if kind == "verdicts":
                for key, present in payload:
                    v = self._verdicts.get(key)
                    if v is not None and v.present is None:
                        if not v.reqs:  # every request that asked has finished meanwhile
                            del self._verdicts[key]
                        else:
                            v.present, v.at = present, now
                continue
            result: JobResult = payload
            loaded = self._load_keys.pop(result.job_id, None)
            if loaded is not None and not result.success:  # these are misses now, not hits to promote again
                ok = set(result.successful_keys or ())
                for key in loaded:
                    if key not in ok and key in self._verdicts:
                        self._verdicts[key].present, self._verdicts[key].at = False, now
            stored = self._store_keys.pop(result.job_id, None)
            if stored is not None and result.success:
                for key in stored:  # a verdict that said "absent" is stale now
                    v = self._verdicts.get(key)
                    if v is not None and v.present is False:
                        v.present, v.at = True, now
                if self._events is not None:
                    self._events.append(
                        OffloadingEvent(
                            keys=stored,
                            medium=self.medium,
                            removed=False,
                            locality=self.locality,
                            ownership=self.tier_type,
                        )
                    )
            self._finished.append(result)

    # -- the tier thread --------------------------------------------------------------------------------------
    def _submit(self, priority: int, task) -> None:
        with self._idle:
            self._busy += 1
        self._q.put((priority, next(self._seq), task))

    def _serve(self) -> None:
        while True:
            _, _, task = self._q.get()
            if task is None:
                return
            try:
                getattr(self, f"_run_{task[0]}")(*task[1:])
            except Exception as e:  # each _run_ reports its own failure; this keeps the thread alive
                log.warning("kvmesh vLLM tier: %s failed: %s", task[0], e)
            finally:
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()

    def _run_lookup(self, keys: list[OffloadKey]) -> None:
        held = [False] * len(keys)
        try:
            held = self.client.held_keys(self.group, tier_keys(self.group, keys))
        except Exception as e:
            self.counts["vllm_tier_errors_lookup"] += 1
            log.warning("kvmesh vLLM tier: lookup failed: %s", e)
        # each key for itself, not the run from the first: vLLM asks a sliding-window group's keys from the
        # prompt's end backwards, so the chunks past the cached prefix come first (a full-attention group's
        # prefix lookup stops at its first miss anyway)
        self._done.put(("verdicts", list(zip(keys, held))))
        self.counts["vllm_tier_lookup_keys"] += len(keys)
        self.counts["vllm_tier_lookup_hits"] += sum(held)

    def _run_store(self, job_id: int, keys: list[OffloadKey], chunk_ids: list[int]) -> None:
        t0 = time.monotonic()
        ok, sent = False, 0
        try:
            chunks = [self._rows[i].view(self.spec.chunk_shape) for i in chunk_ids]
            # (copies the rows out; waited for: a store the node refused after receiving it, or one it did not
            # finish within a read's deadline, is a failed job, which vLLM's backpressure and metrics read)
            timeout = self.options.get("fetch_timeout_s") or self.client.config.fetch_timeout_s
            res = self.client.store_keys_waited(self.group, tier_keys(self.group, keys), chunks, timeout)
            sent, ok = res.handed, res.ok
            if not ok:
                self.counts["vllm_tier_store_refused_chunks"] += res.dropped + res.handed - (res.stored or 0)
        except Exception as e:
            self.counts["vllm_tier_errors_store"] += 1
            log.warning("kvmesh vLLM tier: store of %d chunks failed: %s", len(keys), e)
        self.counts["vllm_tier_stored_chunks"] += sent
        self._done.put(
            (
                "job",
                JobResult(job_id, ok, transfer_time=time.monotonic() - t0, transfer_bytes=sent * self.block_size_bytes),
            )
        )

    def _run_load(self, job_id: int, keys: list[OffloadKey], chunk_ids: list[int]) -> None:
        t0 = time.monotonic()
        got = 0
        try:
            match = self.client.lookup_keys(self.group, tier_keys(self.group, keys))
            if match.num_chunks:
                kv = self.client.fetch(
                    match, out=self.client.scratch(match.num_chunks), deadline_s=self.options.get("fetch_timeout_s")
                )
                got = kv.shape[2]
                half = self.block_size_bytes // 2
                for i in range(got):  # row = K half ‖ V half of the opaque chunk (see tier_spec)
                    row = self._rows[chunk_ids[i]]
                    row[:half].copy_(kv[0, 0, i, 0])
                    row[half:].copy_(kv[0, 1, i, 0])
        except Exception as e:
            self.counts["vllm_tier_errors_load"] += 1
            log.warning("kvmesh vLLM tier: load of %d chunks failed: %s", len(keys), e)
        self.counts["vllm_tier_loaded_chunks"] += got
        if got < len(keys):
            self.counts["vllm_tier_load_missing_chunks"] += len(keys) - got
        self._done.put(
            (
                "job",
                JobResult(
                    job_id,
                    got == len(keys),
                    successful_keys=tuple(keys[:got]) if 0 < got < len(keys) else None,
                    transfer_time=time.monotonic() - t0,
                    transfer_bytes=got * self.block_size_bytes,
                ),
            )
        )
