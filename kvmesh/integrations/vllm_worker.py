"""The worker side of the vLLM connector: moves chunks between kvmesh and vLLM's paged KV cache.

    register(kv_caches)                  vLLM's per-layer cache tensors; learns the block layout (kvmesh.paged)
    begin_step(meta)                     start of a step: waits for saves still reading blocks vLLM now reuses
                                         (preempted requests)
    start_loads(meta)                    hands the step's loads to the loader thread (idempotent per step)
    wait_layer(name)                     synchronous loads: blocks until that layer's blocks are written
    end_step(meta)                       after the forward pass: ends synchronous loads, hands the step's saves
                                         to the saver thread
    finished(finished_req_ids)           asynchronous loads that ended; finished requests whose saves have read
                                         their blocks (the scheduler kept those blocks for them)
    load_errors()                        blocks that were promised but could not be loaded, for vLLM to recompute

Threads. The loader thread runs loads in order: fetch (one directory lookup and one `client.fetch` per run of
chunks), then one indexed write per layer. Saves gather full chunks from the blocks into a staging tensor (one
indexed read per layer): in the step loop ("inline", the default on the CPU, where it is a memcpy) or on the saver
thread after the step ("background", the default on GPUs, where it is a side-stream copy; vLLM keeps a finished
request's blocks until it is done). The saver thread then hands them to the local KVNode (`client.store_keys`,
asynchronous). Client calls of the two threads are serialised by one lock; the engine's own thread never waits
for kvmesh except for an inline copy and in a synchronous load.

Coalescing. Every chunk being fetched is in an in-flight map (chunk hash -> the fetch that brings it) until the
last load that needs it has written it: a load planned while another is fetching the same chunks waits for that
transfer instead of starting its own (concurrent requests sharing a prefix make one transfer, not one each).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from kvmesh.integrations.vllm_scheduler import LoadJob, SaveJob, StepMeta, WorkerReport
from kvmesh.paged import HeadMajorCodec, gather_chunks, learn_codec, scatter_layer

log = logging.getLogger("kvmesh.vllm")
WAIT_SLACK_S = 30.0  # beyond the fetch deadline, how long a synchronous load may hold the forward pass


@dataclass(eq=False)
class _Fetch:
    """One transfer of chunks, shared by every load that needs them. Written only by the loader thread."""

    group: bytes  # the prompt's directory group (its first chunk's hash)
    hashes: list[bytes]
    lora_id: str | None
    kv: torch.Tensor | None = None  # [L, 2, got * C, H, D] once done
    got: int = 0  # leading chunks that arrived intact
    unreachable: str = ""  # the holder node a short fetch could not reach (not for a corrupt chunk)
    done: threading.Event = field(default_factory=threading.Event)
    refs: int = 0  # loads that still need it (guarded by the worker's lock)


@dataclass(eq=False)
class _Load:
    job: LoadJob
    parts: list[tuple[_Fetch, int]]  # for chunk first_chunk + i: (fetch, index in it)
    owned: list[_Fetch]  # fetches this load runs (the others are run by loads queued before it)
    failed: list[int] = field(default_factory=list)  # block ids that could not be written


@dataclass(eq=False)
class _SyncBatch:
    """The synchronous loads of one step, written layer by layer while the forward pass runs."""

    loads: list[_Load]
    layer_done: list[threading.Event]
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False  # set (under lock) when the forward pass stopped waiting: no write after that


class WorkerSide:
    def __init__(self, spec, connect, options, block_size: int, kv_role: str, layer_names: list[str],
                 background_copy: bool) -> None:
        self.spec, self.options, self.block_size = spec, options, block_size
        self.background_copy = background_copy  # see vllm_options.background_save_copy
        self.chunk = spec.chunk_tokens
        self.per_chunk = self.chunk // block_size
        self.save = kv_role in ("kv_both", "kv_producer")
        self._connect = connect
        self._clients = {None: connect(spec)}
        self.counts: Counter[str] = self._clients[None].counts
        self._layer_names = list(layer_names)
        self.layers: list[torch.Tensor] = []
        self.layer_of: dict[str, int] = {}
        self.codec = None
        self._client_lock = threading.Lock()
        self._mu = threading.Condition()
        self._inflight: dict[bytes, tuple[_Fetch, int]] = {}
        self._recved: list[str] = []  # asynchronous loads that ended, not yet reported
        self._errors: set[int] = set()  # failed blocks not yet reported
        self._reported_errors: set[int] = set()  # taken with the finished loads, returned by load_errors()
        self._pending_saves: Counter[str] = Counter()  # save jobs whose blocks have not been read yet
        self._saved_from: set[str] = set()  # requests with save jobs (the scheduler keeps their blocks)
        self._finishing: set[str] = set()  # ... that finished; reported once their saves read their blocks
        self._sync: _SyncBatch | None = None
        self._started: StepMeta | None = None
        self._step_t0: float | None = None
        self._report = WorkerReport()
        self._loads_q: queue.Queue = queue.Queue()
        self._saves_q: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._run, args=(q, fn), name=name, daemon=True)
                         for q, fn, name in ((self._loads_q, self._run_load, "kvmesh-vllm-load"),
                                             (self._saves_q, self._run_save, "kvmesh-vllm-save"))]
        for t in self._threads:
            t.start()

    def client(self, lora_id: str | None):
        c = self._clients.get(lora_id)
        if c is None:
            c = self._clients[lora_id] = self._connect(replace(self.spec, lora_id=lora_id))
            c.counts = self.counts
        return c

    def count(self, key: str, n: int = 1) -> None:
        with self._mu:
            self.counts[key] += n

    # -- registration ---------------------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor], cpu_writer=None) -> None:
        """Take vLLM's per-layer caches (views of its paged buffers) and learn their block layout: on the CPU
        by writing known K/V through vLLM's own kernel (`cpu_writer`), elsewhere vLLM's logical
        [blocks, heads, block_size, 2 * head_dim] view (see kvmesh.paged)."""
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted((n for n in self._layer_names if n in kv_caches), key=extract_layer_index)
        if len(names) != self.spec.num_layers:
            raise ValueError(f"kvmesh vLLM connector: {len(names)} of the {self.spec.num_layers} attention layers "
                             f"have a KV cache")
        layers = [kv_caches[n] for n in names]
        s, bs = self.spec, self.block_size
        shape = (s.num_kv_heads, bs, 2 * s.head_dim)
        for n, t in zip(names, layers):
            if t.dim() != 4 or tuple(t.shape[1:]) != shape or t.dtype != s.torch_dtype:
                raise ValueError(f"kvmesh vLLM connector: layer {n} has a {t.dtype} cache of shape "
                                 f"{list(t.shape)}; expected [blocks, {', '.join(map(str, shape))}] {s.dtype}")
        if layers[0].device.type == "cpu":
            if not all(t.is_contiguous() for t in layers):
                raise ValueError("kvmesh vLLM connector: vLLM's CPU caches are not contiguous per block")
            self.codec = learn_codec(cpu_writer, shape, bs, s.num_kv_heads, s.head_dim, s.torch_dtype)
        else:
            self.codec = HeadMajorCodec(bs, s.num_kv_heads, s.head_dim)
        self.layers, self.layer_of = layers, {n: i for i, n in enumerate(names)}

    # -- step -----------------------------------------------------------------------------------------------------
    def begin_step(self, meta: StepMeta) -> None:
        self._step_t0 = time.perf_counter()
        if meta.preempted:
            with self._mu:
                if not self._mu.wait_for(lambda: all(self._pending_saves[r] <= 0 for r in meta.preempted),
                                         timeout=120):
                    log.error("kvmesh: saves of preempted requests still read their blocks after 120 s")

    def start_loads(self, meta: StepMeta) -> None:
        """Plan every load of this step and queue it; never raises (a load that cannot start is failed)."""
        if self._started is meta:
            return
        self._started = meta
        loads = []
        for job in meta.loads:
            try:
                loads.append(self._plan_load(job))
            except Exception as e:  # a bug or a bad job: vLLM recomputes what it was promised
                log.warning("kvmesh: load for %s could not start: %s", job.req_id, e)
                self.count("vllm_errors_load")
                self._fail(_Load(job, [], []), async_done=not job.sync)
        sync = [ld for ld in loads if ld.job.sync]
        for ld in loads:
            if not ld.job.sync:
                self._loads_q.put(ld)
        if sync:
            self._sync = _SyncBatch(sync, [threading.Event() for _ in self.layers])
            self._loads_q.put(self._sync)

    def wait_layer(self, name: str, meta: StepMeta | None) -> None:
        if meta is not None and meta.loads and self._started is not meta:
            self.start_loads(meta)  # the forward pass came first: vLLM does not promise the order
        batch = self._sync
        i = self.layer_of.get(name)
        if batch is not None and i is not None:
            self._wait_batch(batch, batch.layer_done[i:i + 1])

    def end_step(self, meta: StepMeta) -> None:
        if meta.loads and self._started is not meta:
            self.start_loads(meta)
        batch, self._sync = self._sync, None
        if batch is not None:
            self._wait_batch(batch, batch.layer_done)
            for ld in batch.loads:  # a cancelled batch may have written some layers only: all of it failed
                if batch.cancelled or ld.failed:
                    self._fail(ld, async_done=False, blocks=None if batch.cancelled else ld.failed)
        if meta.prefill is not None and self._step_t0 is not None:
            with self._mu:
                self._report.prefills.append((*meta.prefill, time.perf_counter() - self._step_t0))
        self._step_t0 = None
        if not self.save or not meta.saves or not self.layers:
            return
        if not self.background_copy:  # the one stall a save costs the step loop: a copy into staging
            for job in meta.saves:
                staging = None
                try:
                    staging = self._gather(job)
                    if staging.is_cuda:
                        staging = staging.to("cpu")
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
        with self._mu:
            for job in meta.saves:
                self._pending_saves[job.req_id] += 1
                self._saved_from.add(job.req_id)
        for job in meta.saves:
            self._saves_q.put((job, None, event))

    def _wait_batch(self, batch: _SyncBatch, events: list[threading.Event]) -> None:
        limit = time.monotonic() + (self.options.fetch_timeout_s or self.client(None).config.fetch_timeout_s) \
            + WAIT_SLACK_S
        for ev in events:
            if not ev.wait(max(0.0, limit - time.monotonic())):
                with batch.lock:  # from here on the loader writes nothing: the blocks are vLLM's again
                    batch.cancelled = True
                self.count("vllm_load_timeouts")
                for e in batch.layer_done:
                    e.set()
                return

    def finished(self, finished_req_ids) -> tuple[set[str] | None, set[str] | None]:
        with self._mu:
            recving = set(self._recved)
            self._recved.clear()
            self._reported_errors |= self._errors
            self._errors = set()
            for r in finished_req_ids or ():
                if r in self._saved_from:
                    self._saved_from.discard(r)
                    self._finishing.add(r)
            sending = {r for r in self._finishing if self._pending_saves[r] <= 0}
            self._finishing -= sending
            for r in sending:
                self._pending_saves.pop(r, None)
        return sending or None, recving or None

    def load_errors(self) -> set[int]:
        with self._mu:
            out, self._reported_errors = self._reported_errors, set()
            self.counts["vllm_load_failed_blocks"] += len(out)
        return out

    def take_report(self) -> WorkerReport | None:
        with self._mu:
            r = self._report
            if not r.prefills and not r.transfers and not r.failed_loads:
                return None
            self._report = WorkerReport()
        return r

    # -- loads ----------------------------------------------------------------------------------------------------
    def _plan_load(self, job: LoadJob) -> _Load:
        need = []
        if job.end_chunk > job.first_chunk:
            toks = np.frombuffer(job.tokens, dtype="<u4")
            hashes = self.client(job.lora_id).hashes(toks, job.salt)
            need, group = hashes[job.first_chunk:job.end_chunk], hashes[0]
        if not self.layers:
            need = []
        parts, owned, fresh = [], [], None
        with self._mu:
            for h in need:
                hit = self._inflight.get(h)
                if hit is None:
                    if fresh is None:
                        fresh = _Fetch(group, [], job.lora_id)
                        owned.append(fresh)
                    hit = (fresh, len(fresh.hashes))
                    fresh.hashes.append(h)
                    self._inflight[h] = hit
                else:
                    self.counts["vllm_coalesced_chunks"] += 1
                parts.append(hit)
            for f in {id(f): f for f, _ in parts}.values():
                f.refs += 1
        return _Load(job, parts, owned)

    def _run(self, q: queue.Queue, fn) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            try:
                fn(item)
            except Exception as e:  # keep the thread alive; the item's own handler already failed it
                log.warning("kvmesh: %s failed: %s", threading.current_thread().name, e)

    def _run_load(self, item) -> None:
        loads = item.loads if isinstance(item, _SyncBatch) else [item]
        try:
            for ld in loads:
                for f in ld.owned:
                    self._fetch(f)
            if isinstance(item, _SyncBatch):
                for i, ev in enumerate(item.layer_done):
                    with item.lock:
                        if item.cancelled:
                            return
                        for ld in loads:
                            self._write(ld, range(i, i + 1))
                    ev.set()
            else:
                self._write(item, range(len(self.layers)))
        except Exception as e:
            log.warning("kvmesh: load failed: %s", e)
            self.count("vllm_errors_load")
            for ld in loads:
                ld.failed = list(ld.job.block_ids[ld.job.skip_blocks:ld.job.fill_blocks])
            if isinstance(item, _SyncBatch):
                for ev in item.layer_done:
                    ev.set()
        finally:
            for ld in loads:
                self._release(ld)
            if not isinstance(item, _SyncBatch):
                self._fail(item, async_done=True, blocks=item.failed)

    def _fetch(self, f: _Fetch) -> None:
        s, c = self.spec, self.chunk
        try:
            client = self.client(f.lora_id)
            with self._client_lock:
                match = client.lookup_keys(f.group, f.hashes)
                if match.num_chunks:
                    buf = torch.empty(s.kv_shape(match.num_chunks * c), dtype=s.torch_dtype)
                    kv = client.fetch(match, out=buf, deadline_s=self.options.fetch_timeout_s)
                    f.kv, f.got = kv, kv.shape[2] // c
                    st = client.last_fetch
                    if f.got < match.num_chunks and st.error in ("peer_error", "deadline"):
                        holders = [h.node_id for h in match.chunks[f.got].holders if h.node_id != client.node_id]
                        f.unreachable = holders[0] if holders else ""
                    for source, k in (("local", st.local_chunks), ("peer", st.peer_chunks)):
                        if k:  # the two overlap in time: each is charged the whole fetch (an upper bound)
                            with self._mu:
                                self._report.transfers.append((source, k * s.chunk_bytes, st.seconds))
            self.count("vllm_fetched_chunks", f.got)
            if f.got < len(f.hashes):
                self.count("vllm_fetch_missing_chunks", len(f.hashes) - f.got)
        finally:
            f.done.set()

    def _write(self, ld: _Load, layers: range) -> None:
        """Write the chunks of `ld` that arrived into its blocks, for `layers`; blocks after the first chunk
        that did not arrive are failed (vLLM recomputes from the first failed block anyway)."""
        job, m, c = ld.job, self.per_chunk, self.chunk
        ok = 0
        limit = time.monotonic() + (self.options.fetch_timeout_s or 10.0) + WAIT_SLACK_S
        for f, i in ld.parts:  # fetches of loads queued earlier (or of this one): done, or failing by a deadline
            if not f.done.wait(max(0.0, limit - time.monotonic())) or i >= f.got:
                break
            ok += 1
        lo, hi = job.skip_blocks, min(job.fill_blocks, ok * m)
        ld.failed = list(job.block_ids[max(lo, ok * m):job.fill_blocks])
        ids = torch.tensor(job.block_ids, dtype=torch.long)
        j = 0
        while j * m < hi:  # runs of chunks that sit next to each other in one fetch: one write per layer each
            f, start = ld.parts[j]
            k = 1
            while (j + k) * m < hi and ld.parts[j + k][0] is f and ld.parts[j + k][1] == start + k:
                k += 1
            b0, b1 = j * m, min((j + k) * m, hi)
            for layer in layers:
                src = f.kv[layer, :, start * c:start * c + (b1 - b0) * self.block_size]
                scatter_layer(src, self.layers[layer], self.codec, ids[b0:b1], first=max(0, lo - b0))
            j += k
        if layers.stop == len(self.layers):
            self.count("vllm_loaded_chunks", ok)
            self.count("vllm_loaded_blocks", max(0, hi - lo))

    def _release(self, ld: _Load) -> None:
        with self._mu:
            for f in {id(f): f for f, _ in ld.parts}.values():
                f.refs -= 1
                if f.refs <= 0:
                    for h in f.hashes:
                        if self._inflight.get(h, (None,))[0] is f:
                            del self._inflight[h]
                    f.kv = None

    def _fail(self, ld: _Load, async_done: bool, blocks: list[int] | None = None) -> None:
        """Report a load: its failed blocks (all it promised when `blocks` is None) and, for an asynchronous one,
        its end, in one step (vLLM requires the errors no later than the end)."""
        job = ld.job
        failed = list(job.block_ids[job.skip_blocks:job.fill_blocks]) if blocks is None else blocks
        with self._mu:
            self._errors.update(failed)
            if failed:
                self.counts["vllm_load_failed_chunks"] += -(-len(failed) // self.per_chunk)
                node = next((f.unreachable for f, i in ld.parts if i >= f.got and f.unreachable), "")
                self._report.failed_loads.append((job.req_id, node))
            if async_done:
                self._recved.append(job.req_id)

    # -- saves ----------------------------------------------------------------------------------------------------
    def _gather(self, job: SaveJob) -> torch.Tensor:
        n = job.end_chunk - job.first_chunk
        staging = torch.empty((n, *self.spec.chunk_shape), dtype=self.spec.torch_dtype, device=self.layers[0].device)
        return gather_chunks(self.layers, self.codec, torch.tensor(job.block_ids, dtype=torch.long), staging)

    def _run_save(self, item) -> None:
        """(job, staging, event): store `staging` ([n, *chunk_shape] on the CPU), or first gather it from the
        blocks (background copy; on a GPU after `event`, on a side stream) and release the blocks."""
        job, staging, event = item
        if staging is None:
            try:
                if event is not None:
                    stream = torch.cuda.Stream(device=self.layers[0].device)
                    with torch.cuda.stream(stream):
                        stream.wait_event(event)
                        staging = self._gather(job).to("cpu")
                    stream.synchronize()
                else:
                    staging = self._gather(job)
            except Exception as e:
                log.warning("kvmesh: save of %s failed: %s", job.req_id, e)
                self.count("vllm_errors_save")
                staging = None
            finally:
                with self._mu:  # the blocks are not read any more
                    self._pending_saves[job.req_id] -= 1
                    self._mu.notify_all()
        if staging is None:
            return
        n = job.end_chunk - job.first_chunk
        client = self.client(job.lora_id)
        hashes = client.hashes(np.frombuffer(job.tokens, dtype="<u4"), job.salt)
        with self._client_lock:
            sent = client.store_keys(hashes[0], hashes[job.first_chunk:job.end_chunk], list(staging))
        self.count("vllm_saved_chunks", sent)
        self.count("vllm_save_already_cached_chunks", n - sent)

    def close(self) -> None:
        for q in (self._loads_q, self._saves_q):
            q.put(None)
        for t in self._threads:
            t.join(timeout=10)
        import ray

        for c in self._clients.values():
            try:
                if ray.is_initialized():  # at interpreter exit Ray may be gone already
                    c.flush(timeout_s=5)
            finally:
                c.close()
