"""The worker side of the vLLM connector: moves chunks between kvmesh and vLLM's paged KV cache.

    register(kv_caches)                  vLLM's per-layer cache tensors of every KV cache group; learns the block
                                         layout (kvmesh.paged)
    begin_step(meta)                     start of a step: waits for saves still reading blocks vLLM now reuses
                                         (preempted requests)
    start_loads(meta)                    hands the step's loads to the loader thread (idempotent per step)
    wait_layer(name)                     synchronous loads: blocks until that layer's blocks are written
    end_step(meta)                       after the forward pass: ends synchronous loads, hands the step's saves
                                         to the saver thread
    finished(finished_req_ids)           asynchronous loads that ended; finished requests whose saves have read
                                         their blocks (the scheduler kept those blocks for them)
    load_errors()                        blocks that were promised but could not be loaded, for vLLM to recompute

Threads. Loads run on the loader's thread (kvmesh.integrations.vllm_loader: fetches coalesced across requests,
then one indexed write per layer). Saves gather full chunks from the blocks into a staging tensor (one indexed
read per layer): in the step loop ("inline", the default on the CPU, where it is a memcpy) or on the saver thread
after the step ("background", the default on GPUs, where it is a side-stream copy; vLLM keeps a finished
request's blocks until it is done). The saver thread then hands them to the local KVNode (`client.store_keys`,
asynchronous). Client calls of the two threads are serialised by `client_lock`; the engine's own thread never
waits for kvmesh except for an inline copy and in a synchronous load.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter

import numpy as np
import torch

from kvmesh.cudart import side_stream
from kvmesh.integrations.vllm_clients import EngineClients
from kvmesh.integrations.vllm_loader import WAIT_SLACK_S, Load, Loader, SyncBatch
from kvmesh.integrations.vllm_meta import SaveJob, StepMeta, WorkerReport
from kvmesh.paged import HeadMajorCodec, LearnedCodec, SplitKVCodec, gather_chunks

IDLE_WAIT_S = 0.02  # at most this long per empty engine step, waiting for an asynchronous load to end
log = logging.getLogger("kvmesh.vllm")


def _split_kv_view(name: str, t: torch.Tensor, s, bs: int) -> torch.Tensor:
    """A 5-D per-layer cache as [num_blocks, 2, bs, H, D] (a view: writes through it land in vLLM's tensor)."""
    piece = (bs, s.num_kv_heads, s.head_dim)
    fa, fi = t.shape[0] == 2 and tuple(t.shape[2:]) == piece, t.shape[1] == 2 and tuple(t.shape[2:]) == piece
    if t.dtype != s.torch_dtype or not (fa or fi):
        raise ValueError(
            f"kvmesh vLLM connector: layer {name} has a {t.dtype} cache of shape {list(t.shape)}; "
            f"expected [2, blocks, {bs}, {s.num_kv_heads}, {s.head_dim}] or "
            f"[blocks, 2, {bs}, {s.num_kv_heads}, {s.head_dim}] {s.dtype}"
        )
    if fa and fi:
        raise ValueError(f"kvmesh vLLM connector: layer {name} has 2 blocks: K/V-first or block-first is ambiguous")
    return t.transpose(0, 1) if fa else t


class _LayerDone(threading.Event):
    """A synchronous load's layer-written signal. `set` (on the loader thread, after it queued the layer's writes)
    also records a CUDA event on that thread's stream; `order_after` (on the forward's thread) makes the current
    stream wait for it, so the attention of layer i is ordered after layer i's writes whatever streams the two
    threads use, and after nothing else."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.cuda_event: torch.cuda.Event | None = None

    def set(self) -> None:
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))  # the setting thread's stream: the loader's writes
            self.cuda_event = ev
        super().set()

    def order_after(self) -> None:
        if self.cuda_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.cuda_event)


class WorkerSide:
    """`specs[g]` and `layer_names[g]` are KV cache group g's spec and attention layers (vLLM's group order)."""

    def __init__(
        self,
        specs,
        connect,
        options,
        block_size: int,
        kv_role: str,
        layer_names: list[list[str]],
        background_copy: bool,
    ) -> None:
        self.specs = tuple(specs)
        spec = self.spec = self.specs[0]
        self.options, self.block_size = options, block_size
        self.background_copy = background_copy  # see vllm_options.background_save_copy
        self.chunk = spec.chunk_tokens
        self.per_chunk = self.chunk // block_size
        self.save = kv_role in ("kv_both", "kv_producer")
        self._clients = EngineClients(self.specs, connect)
        self.counts: Counter[str] = self._clients.base.counts
        self._layer_names = [list(names) for names in layer_names]
        self.layers: list[torch.Tensor] = []  # every attention layer's cache, in model layer order
        self.layer_pos: list[tuple[int, int]] = []  # position in `layers` -> (group, index in the group)
        self.group_layers: list[list[torch.Tensor]] = []  # per group, its layers in model order
        self.layer_of: dict[str, int] = {}  # layer name -> position in `layers`
        self.codec: HeadMajorCodec | SplitKVCodec | LearnedCodec | None = None  # set by register()
        self.client_lock = threading.Lock()
        self.mu = threading.Condition()
        self._recved: list[str] = []  # asynchronous loads that ended, not yet reported
        self._async_loads = 0  # asynchronous loads queued and not ended
        self._req_loads: Counter[str] = Counter()  # request -> its asynchronous loads (one per group) not ended
        self._errors: set[int] = set()  # failed blocks not yet reported
        # a model with several KV cache groups: vLLM takes a failed load per request (block ids are per group), and
        # recomputes it from its first token (asynchronous loads only: `load_mode="sync"` is refused for it)
        self.per_request_failures = len(layer_names) > 1
        self._failed_reqs: set[str] = set()  # requests with a failed load, reported with their end
        self._failed_out: set[str] = set()  # taken with the finished loads, returned by failed_requests()
        self._reported_errors: set[int] = set()  # taken with the finished loads, returned by load_errors()
        self._pending_saves: Counter[str] = Counter()  # save jobs whose blocks have not been read yet
        self._saved_from: set[str] = set()  # requests with save jobs (the scheduler keeps their blocks)
        self._finishing: set[str] = set()  # ... that finished; reported once their saves read their blocks
        self._sync: SyncBatch | None = None
        self._started: StepMeta | None = None
        self._step_t0: float | None = None
        self.report = WorkerReport()
        self.loader = Loader(self)
        self._saves_q: queue.Queue = queue.Queue()
        self._saver = threading.Thread(
            target=self._run, args=(self._saves_q, self._run_save), name="kvmesh-vllm-save", daemon=True
        )
        self._saver.start()

    def client(self, lora_id: str | None, group: int = 0):
        return self._clients.get(lora_id, group)

    def count(self, key: str, n: int = 1) -> None:
        with self.mu:
            self.counts[key] += n

    # -- registration ---------------------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor], cpu_codec=None) -> None:
        """Take vLLM's per-layer caches (views of its paged buffers; with the hybrid allocator, layers of
        different groups may share one buffer, their block ids never overlap) and learn their block layout: on
        the CPU by writing known K/V through vLLM's own kernel (`cpu_codec()` learns it), elsewhere vLLM's logical
        [blocks, heads, block_size, 2 * head_dim] view (see kvmesh.paged)."""
        from vllm.model_executor.models.utils import extract_layer_index

        s, bs = self.spec, self.block_size  # every group has this geometry (vllm_options.groups_for_vllm)
        shape = (s.num_kv_heads, bs, 2 * s.head_dim)
        order, group_layers = [], []
        for g, names in enumerate(self._layer_names):
            names = sorted((n for n in names if n in kv_caches), key=extract_layer_index)
            if len(names) != self.specs[g].num_layers:
                raise ValueError(
                    f"kvmesh vLLM connector: {len(names)} of the {self.specs[g].num_layers} attention "
                    f"layers of KV cache group {g} have a KV cache"
                )
            for n in names:
                t = kv_caches[n]
                if t.dim() == 5:  # vLLM before its KVCacheLayout descriptor: K and V apart (see kvmesh.paged)
                    continue  # checked by _split_kv_view
                if t.dim() != 4 or tuple(t.shape[1:]) != shape or t.dtype != s.torch_dtype:
                    raise ValueError(
                        f"kvmesh vLLM connector: layer {n} has a {t.dtype} cache of shape "
                        f"{list(t.shape)}; expected [blocks, {', '.join(map(str, shape))}] {s.dtype}"
                    )
            group_layers.append(
                [_split_kv_view(n, kv_caches[n], s, bs) if kv_caches[n].dim() == 5 else kv_caches[n] for n in names]
            )
            order += [(extract_layer_index(n), n, g, i) for i, n in enumerate(names)]
        order.sort()
        layers = [group_layers[g][i] for _, _, g, i in order]
        split = {kv_caches[n].dim() == 5 for _, n, _, _ in order}
        if len(split) > 1:
            raise ValueError("kvmesh vLLM connector: some layers have 5-D caches, others 4-D")
        if split == {True}:
            self.codec = SplitKVCodec(bs, s.num_kv_heads, s.head_dim)
        elif layers[0].device.type == "cpu":
            if not all(t.is_contiguous() for t in layers):
                raise ValueError("kvmesh vLLM connector: vLLM's CPU caches are not contiguous per block")
            self.codec = cpu_codec()
        else:
            self.codec = HeadMajorCodec(bs, s.num_kv_heads, s.head_dim)
        self.group_layers, self.layers = group_layers, layers
        self.layer_pos = [(g, i) for _, _, g, i in order]
        self.layer_of = {n: p for p, (_, n, _, _) in enumerate(order)}

    # -- step -----------------------------------------------------------------------------------------------------
    def begin_step(self, meta: StepMeta) -> None:
        self._step_t0 = time.perf_counter()
        if meta.preempted:
            with self.mu:
                if not self.mu.wait_for(lambda: all(self._pending_saves[r] <= 0 for r in meta.preempted), timeout=120):
                    log.error("kvmesh: saves of preempted requests still read their blocks after 120 s")

    def start_loads(self, meta: StepMeta) -> None:
        """Plan every load of this step and queue it; never raises (a load that cannot start is failed)."""
        if self._started is meta:
            return
        self._started = meta
        with self.mu:  # each ends with one report_load(async_done=True), planned or not
            for job in meta.loads:
                if not job.sync:
                    self._async_loads += 1
                    self._req_loads[job.req_id] += 1
        loads = []
        for job in meta.loads:
            try:
                loads.append(self.loader.plan(job))
            except Exception as e:  # a bug or a bad job: vLLM recomputes what it was promised
                log.warning("kvmesh: load for %s could not start: %s", job.req_id, e)
                self.count("vllm_errors_load")
                self.report_load(Load(job, [], []), async_done=not job.sync)
        sync = [ld for ld in loads if ld.job.sync]
        for ld in loads:
            if not ld.job.sync:
                self.loader.submit(ld)
        if sync:
            self._sync = SyncBatch(sync, [_LayerDone(self.layers[0].device) for _ in self.layers])
            self.loader.submit(self._sync)

    def wait_layer(self, name: str, meta: StepMeta | None) -> None:
        if meta is not None and meta.loads and self._started is not meta:
            self.start_loads(meta)  # the forward pass came first: vLLM does not promise the order
        batch = self._sync
        i = self.layer_of.get(name)
        if batch is not None and i is not None:
            self._wait_batch(batch, batch.layer_done[i : i + 1])
            batch.layer_done[i].order_after()  # the forward's stream waits for this layer's writes alone

    def end_step(self, meta: StepMeta) -> None:
        if self.background_copy and meta.saves:  # first: the scheduler keeps these requests' blocks for us
            with self.mu:
                self._saved_from.update(job.req_id for job in meta.saves)
        if meta.loads and self._started is not meta:
            self.start_loads(meta)
        batch, self._sync = self._sync, None
        failed: set[str] = set()
        if batch is not None:
            self._wait_batch(batch, batch.layer_done)
            for ev in batch.layer_done:  # layers the forward pass did not wait for (none, normally)
                ev.order_after()
            for ld in batch.loads:  # a cancelled batch may have written some layers only: all of it failed
                if batch.cancelled or ld.failed:
                    self.report_load(ld, async_done=False, blocks=None if batch.cancelled else ld.failed)
                    failed.add(ld.job.req_id)
        if meta.prefill is not None and self._step_t0 is not None:
            with self.mu:
                self.report.prefills.append((*meta.prefill, time.perf_counter() - self._step_t0))
        self._step_t0 = None
        # What this step computed over blocks a failed load never wrote is garbage: vLLM throws it away and
        # recomputes, and it must never be stored (it would be served, under its prompt's own hash, as that
        # prompt's KV). That is the failed request's own, and any other request's in the step that shares those
        # blocks through vLLM's prefix cache (vLLM caches a step's sync-loaded blocks as it allocates them). Which
        # ones share is not known here, so a step with a failed load saves nothing; the scheduler saves those
        # requests again from where they were (`WorkerReport.resave`)
        saves = [] if failed else list(meta.saves)
        if len(saves) < len(meta.saves):
            self.count("vllm_saves_dropped_failed_load", len(meta.saves) - len(saves))
            with self.mu:
                self.report.resave.extend(dict.fromkeys(job.req_id for job in meta.saves))
        if not self.save or not saves or not self.layers:
            return
        if not self.background_copy:  # the one stall a save costs the step loop: a copy into staging
            for job in saves:
                staging = None
                try:  # (on a GPU it stays there: the store stages it page-locked or writes it into a GPU tier)
                    staging = self._gather(job)
                except Exception as e:
                    log.warning("kvmesh: save of %s failed: %s", job.req_id, e)
                    self.count("vllm_errors_save")
                if staging is not None:
                    self._saves_q.put((job, staging, None))
            return
        event = None
        if self.layers[0].is_cuda:  # the saver's copies wait for this step's kernels
            event = torch.cuda.Event()
            event.record()
        with self.mu:
            for job in saves:
                self._pending_saves[job.req_id] += 1
        for job in saves:
            self._saves_q.put((job, None, event))

    def _wait_batch(self, batch: SyncBatch, events: list[threading.Event]) -> None:
        limit = (
            time.monotonic() + (self.options.fetch_timeout_s or self.client(None).config.fetch_timeout_s) + WAIT_SLACK_S
        )
        for ev in events:
            if not ev.wait(max(0.0, limit - time.monotonic())):
                with batch.lock:  # from here on the loader writes nothing: the blocks are vLLM's again
                    batch.cancelled = True
                self.count("vllm_load_timeouts")
                for e in batch.layer_done:
                    e.set()
                return

    def finished(self, finished_req_ids, idle: bool = False) -> tuple[set[str] | None, set[str] | None]:
        """`idle`: the step ran no forward pass. If asynchronous loads are all vLLM waits for, wait a little for
        one to end: vLLM's loop would otherwise spin through empty steps, and on a small CPU starve the loader
        thread of the interpreter lock it needs between its copies."""
        with self.mu:
            if idle and self._async_loads and not self._recved:
                self.mu.wait_for(lambda: self._recved or not self._async_loads, timeout=IDLE_WAIT_S)
            for r in finished_req_ids or ():
                if r in self._saved_from:
                    self._saved_from.discard(r)
                    self._finishing.add(r)
            # vLLM frees a finished request's blocks when it hears of it in either set, and asserts if it hears
            # twice: a finished request that kept its blocks both for saves and for a load (aborted while loading
            # after its preemption) is reported once, as received, when its load has ended and its saves are done
            held = {r for r in self._recved if r in self._finishing and self._pending_saves[r] > 0}
            recving = set(self._recved) - held
            self._recved = [r for r in self._recved if r in held]
            self._reported_errors |= self._errors
            self._errors = set()
            self._failed_out |= self._failed_reqs & recving  # (reported no later than their end, as vLLM asks)
            self._failed_reqs -= recving
            done = {r for r in self._finishing if self._pending_saves[r] <= 0 and r not in self._req_loads}
            sending = done - recving
            self._finishing -= done
            for r in done:
                self._pending_saves.pop(r, None)
            self.counts["vllm_kept_blocks_released"] += len(done)
        return sending or None, recving or None

    def failed_requests(self) -> set[str]:
        """Requests among the loads that ended whose load failed (a model with several KV cache groups)."""
        with self.mu:
            out, self._failed_out = self._failed_out, set()
            self.counts["vllm_load_failed_requests"] += len(out)
        return out

    def load_errors(self) -> set[int]:
        with self.mu:
            out, self._reported_errors = self._reported_errors, set()
            self.counts["vllm_load_failed_blocks"] += len(out)
        return out

    def take_report(self) -> WorkerReport | None:
        with self.mu:
            r = self.report
            if not r.prefills and not r.transfers and not r.failed_loads and not r.resave:
                return None
            self.report = WorkerReport()
        return r

    # -- loads ----------------------------------------------------------------------------------------------------
    def _run(self, q: queue.Queue, fn) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            try:
                fn(item)
            except Exception as e:  # keep the thread alive; the item's own handler already failed it
                log.warning("kvmesh: %s failed: %s", threading.current_thread().name, e)

    def report_load(self, ld: Load, async_done: bool, blocks: list[int] | None = None) -> None:
        """Report a load: its failed blocks (all it promised when `blocks` is None) and, for an asynchronous one,
        its end, in one step (vLLM requires the errors no later than the end)."""
        job = ld.job
        failed = list(job.block_ids[job.skip_blocks : job.fill_blocks]) if blocks is None else blocks
        if async_done and self.layers and self.layers[0].is_cuda:
            # the loader's writes are queued on its thread's stream: vLLM may run the request's next forward on
            # any stream once it hears of the end, so they must have landed by then
            torch.cuda.current_stream(self.layers[0].device).synchronize()
        with self.mu:
            if self.per_request_failures:
                if failed:
                    self._failed_reqs.add(job.req_id)
            else:
                self._errors.update(failed)
            if failed:
                self.counts["vllm_load_failed_chunks"] += -(-len(failed) // self.per_chunk)
                node = next((f.unreachable for f, i in ld.parts if i >= f.got and f.unreachable), "")
                self.report.failed_loads.append((job.req_id, node))
            if async_done:  # a request's load ends when its last group's does
                self._req_loads[job.req_id] -= 1
                if self._req_loads[job.req_id] <= 0:
                    del self._req_loads[job.req_id]
                    self._recved.append(job.req_id)
                self._async_loads -= 1
                self.mu.notify_all()

    # -- saves ----------------------------------------------------------------------------------------------------
    def _gather(self, job: SaveJob) -> torch.Tensor:
        n = job.end_chunk - job.first_chunk
        spec = self.specs[job.group]
        staging = torch.empty((n, *spec.chunk_shape), dtype=spec.torch_dtype, device=self.layers[0].device)
        return gather_chunks(
            self.group_layers[job.group], self.codec, torch.tensor(job.block_ids, dtype=torch.long), staging
        )

    def _run_save(self, item) -> None:
        """(job, staging, event): store `staging` ([n, *chunk_shape], made for this store), or first gather it from
        the blocks (background copy; on a GPU after `event`, on a side stream) and release the blocks. GPU staging
        is handed over to the client's GPU store path (page-locked staging on its side stream, or device to device
        into the node's GPU tier), never copied into pageable memory here."""
        job, staging, event = item
        if staging is None:
            try:
                if event is not None:
                    stream = side_stream(self.layers[0].device)
                    with torch.cuda.stream(stream):
                        stream.wait_event(event)
                        staging = self._gather(job)
                    stream.synchronize()  # (the blocks are released below: the gather must be done)
                else:
                    staging = self._gather(job)
            except Exception as e:
                log.warning("kvmesh: save of %s failed: %s", job.req_id, e)
                self.count("vllm_errors_save")
                staging = None
            finally:
                with self.mu:  # the blocks are not read any more
                    self._pending_saves[job.req_id] -= 1
                    self.mu.notify_all()
        if staging is None:
            return
        n = job.end_chunk - job.first_chunk
        client = self.client(job.lora_id, job.group)
        hashes = client.hashes(np.frombuffer(job.tokens, dtype="<u4"), job.salt)
        with self.client_lock:
            keys = hashes[job.first_chunk : job.end_chunk]
            sent = client.store_keys(hashes[0], keys, list(staging), handover=True).handed
        self.count("vllm_saved_chunks", sent)
        if len(self.specs) > 1:
            self.count(f"vllm_saved_chunks_group{job.group}", sent)
        self.count("vllm_save_already_cached_chunks", n - sent)

    def close(self) -> None:
        self.loader.close()
        self._saves_q.put(None)
        self._saver.join(timeout=10)
        try:
            import ray
        except ImportError:  # a worker driven without Ray (the GPU machine's tests)
            ray = None
        for c in self._clients.all():
            try:
                if ray is not None and ray.is_initialized():  # at interpreter exit Ray may be gone already
                    c.flush(timeout_s=5)
            finally:
                c.close()
