"""The worker side's loader: brings chunks from kvmesh into vLLM's blocks, on a thread of its own.

    plan(job) -> Load       on the engine's thread: the job's chunk hashes, each either joined to a fetch already
                            planned (in flight) or added to a new fetch this load runs
    submit(load | batch)    queue it; loads run in order, so a fetch another load joins has always run first
    run(load | batch)       fetch (one directory lookup and one fetch per fetch), then one indexed write per layer
                            of every run of chunks into the load's blocks; an asynchronous load reports its end
                            through the worker, a synchronous batch sets one event per layer

Where the chunks land. vLLM's blocks on a GPU: through the data plane's device sink (`client.fetch_to_device`):
same-node chunks by DMA straight from the node's page-locked slab, peer chunks through page-locked staging of the
fetch's own, into a device staging tensor layer by layer; each layer's writes into the blocks wait (on the GPU) for
that layer's copy alone. The slab chunks are verified while the DMA runs (on the GPU, by the device checksums
their node recorded, over the bytes as they landed; a chunk without one by xxh3 on CPU threads). A synchronous
load (the forward pass reads layer i as soon as it is written) writes only the chunks before the first that fails,
once every check is in. An asynchronous load writes every chunk that arrived while the checks run, then waits for
them: the blocks of the first chunk that failed and of every chunk after it are failed blocks, which vLLM
recomputes (overwriting what was written there) before anything reads them, since vLLM reads none of a load's
blocks before the load is reported. Blocks on the CPU (vLLM's CPU backend): `client.fetch` into a CPU tensor
(verified as it lands), then the writes.

Coalescing: the in-flight map (chunk hash -> (fetch, index)) holds every chunk from planning until the last load
that needs it has written it, so concurrent requests that share a prefix make one transfer, not one each.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvmesh.integrations.vllm_meta import LoadJob
from kvmesh.match import link_observations
from kvmesh.movers import LayerwiseLoad
from kvmesh.paged import scatter_chunks, scatter_layer

log = logging.getLogger("kvmesh.vllm")
WAIT_SLACK_S = 30.0  # beyond the fetch deadline: how long a load waits for a fetch it joined, and the forward
# pass for a synchronous load


@dataclass(eq=False)
class Fetch:
    """One transfer of chunks, shared by every load that needs them. Written only by the loader thread."""

    group: bytes  # the prompt's directory group (its first chunk's hash)
    hashes: list[bytes]
    lora_id: str | None
    kv_group: int  # the KV cache group the chunks belong to (index into the worker's specs)
    kv: torch.Tensor | None = None  # blocks on the CPU: [L, 2, got * C, H, D] once done
    load: LayerwiseLoad | None = None  # blocks on a device: staging [got, L, 2, C, H, D] on it, layer l usable
    # on a stream after load.wait(l); released (slab chunks unpinned) with the last load that needs it
    got: int = 0  # leading chunks that arrived (on a device: intact once `verified()` has run)
    checked: bool = False  # a device fetch's checks are in, and `got` counts only intact chunks
    unreachable: str = ""  # the holder node a short fetch could not reach (not for a corrupt chunk)
    done: threading.Event = field(default_factory=threading.Event)
    refs: int = 0  # loads that still need it (guarded by the worker's lock)

    def verified(self) -> int:
        """The leading chunks that arrived intact: for a device fetch, waits for its checks (once)."""
        if self.load is not None and not self.checked:
            self.got = min(self.got, self.load.first_unverified())
            self.checked = True
        return self.got


@dataclass(eq=False)
class Load:
    job: LoadJob
    parts: list[tuple[Fetch, int]]  # for chunk first_chunk + i: (fetch, index in it)
    owned: list[Fetch]  # fetches this load runs (the others are run by loads queued before it)
    failed: list[int] = field(default_factory=list)  # block ids that could not be written
    ids: torch.Tensor | None = None  # job.block_ids on the blocks' device, made by the first write (one copy, not
    # one per layer: a copy from pageable memory would also wait for the stream's earlier writes)


@dataclass(eq=False)
class SyncBatch:
    """The synchronous loads of one step, written layer by layer while the forward pass runs."""

    loads: list[Load]
    layer_done: list  # per model layer: the worker's layer-written event (a threading.Event that orders streams)
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False  # set (under lock) when the forward pass stopped waiting: no write after that


class Loader:
    """Owned by a `WorkerSide` (`worker`), whose clients, client lock, caches, counters and reports it uses."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.inflight: dict[bytes, tuple[Fetch, int]] = {}  # guarded by worker.mu
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="kvmesh-vllm-load", daemon=True)
        self._thread.start()

    def submit(self, item) -> None:
        self._q.put(item)

    def _serve(self) -> None:
        while (item := self._q.get()) is not None:
            try:
                self.run(item)
            except Exception as e:  # run() fails the load itself; keep serving
                log.warning("kvmesh: loader: %s", e)

    def plan(self, job: LoadJob) -> Load:
        w = self.worker
        need = []
        if job.end_chunk > job.first_chunk:
            toks = np.frombuffer(job.tokens, dtype="<u4")
            hashes = w.client(job.lora_id, job.group).hashes(toks, job.salt)
            need, group = hashes[job.first_chunk : job.end_chunk], hashes[0]
        if not w.layers:
            need = []
        parts, owned, fresh = [], [], None
        with w.mu:
            for h in need:
                hit = self.inflight.get(h)
                if hit is None:
                    if fresh is None:
                        fresh = Fetch(group, [], job.lora_id, job.group)
                        owned.append(fresh)
                    hit = (fresh, len(fresh.hashes))
                    fresh.hashes.append(h)
                    self.inflight[h] = hit
                else:
                    w.counts["vllm_coalesced_chunks"] += 1
                parts.append(hit)
            for f in {id(f): f for f, _ in parts}.values():
                f.refs += 1
        return Load(job, parts, owned)

    def run(self, item) -> None:
        w = self.worker
        loads = item.loads if isinstance(item, SyncBatch) else [item]
        try:
            for ld in loads:
                for f in ld.owned:
                    self._fetch(f)
            if isinstance(item, SyncBatch):
                for p, ev in enumerate(item.layer_done):  # in model layer order, whatever group each is in
                    g, i = w.layer_pos[p]
                    with item.lock:
                        if item.cancelled:
                            return
                        for ld in loads:
                            if ld.job.group == g:
                                self._write(ld, range(i, i + 1), verify_first=True)
                    ev.set()
            else:
                self._write(item, range(len(w.group_layers[item.job.group])), verify_first=False)
        except Exception as e:
            log.warning("kvmesh: load failed: %s", e)
            w.count("vllm_errors_load")
            for ld in loads:
                ld.failed = list(ld.job.block_ids[ld.job.skip_blocks : ld.job.fill_blocks])
            if isinstance(item, SyncBatch):
                for ev in item.layer_done:
                    ev.set()
        finally:
            for ld in loads:
                self._release(ld)
            if not isinstance(item, SyncBatch):
                w.report_load(item, async_done=True, blocks=item.failed)

    def _fetch(self, f: Fetch) -> None:
        w = self.worker
        s, c = w.specs[f.kv_group], w.chunk
        try:
            client = w.client(f.lora_id, f.kv_group)
            device = w.layers[0].device
            with w.client_lock:
                match = client.lookup_keys(f.group, f.hashes)
                if match.num_chunks and device.type == "cuda":
                    f.load, f.got = client.fetch_to_device(match, device, deadline_s=w.options.fetch_timeout_s)
                elif match.num_chunks:
                    buf = torch.empty(s.kv_shape(match.num_chunks * c), dtype=s.torch_dtype)
                    kv = client.fetch(match, out=buf, deadline_s=w.options.fetch_timeout_s)
                    f.kv, f.got = kv, kv.shape[2] // c
                st = client.last_fetch
            # (a device fetch is verified while the DMA runs; its writers wait for the checks: `Fetch.verified`)
            if match.num_chunks:
                if f.got < match.num_chunks and st.error in ("peer_error", "deadline"):
                    holders = [h.node_id for h in match.chunks[f.got].holders if h.node_id != client.node_id]
                    f.unreachable = holders[0] if holders else ""
                observed = link_observations(st.runs, s.chunk_bytes)  # (per link, in each run's own time)
                with w.mu:
                    w.report.transfers.extend(observed)
            w.count("vllm_fetched_chunks", f.got)
            if f.got < len(f.hashes):
                w.count("vllm_fetch_missing_chunks", len(f.hashes) - f.got)
        finally:
            f.done.set()

    def _write(self, ld: Load, layers: range, verify_first: bool) -> None:
        """Write the chunks of `ld` that arrived into its blocks, for `layers`; blocks after the first chunk
        that did not arrive intact are failed (vLLM recomputes from the first failed block anyway).
        `verify_first`: write only chunks whose checks are in and passed (the forward pass may read the blocks
        at once); else write what arrived, then wait for the checks and fail the blocks from the first bad chunk
        on (an asynchronous load: nothing reads its blocks before it is reported)."""
        w = self.worker
        job, m, c = ld.job, w.per_chunk, w.chunk
        group_layers = w.group_layers[job.group]
        ok = 0
        limit = time.monotonic() + (w.options.fetch_timeout_s or 10.0) + WAIT_SLACK_S
        for f, i in ld.parts:  # fetches of loads queued earlier (or of this one): done, or failing by a deadline
            if not f.done.wait(max(0.0, limit - time.monotonic())) or i >= (f.verified() if verify_first else f.got):
                break
            ok += 1
        lo, hi = job.skip_blocks, min(job.fill_blocks, ok * m)
        ld.failed = list(job.block_ids[max(lo, ok * m) : job.fill_blocks])
        if ld.ids is None:
            ids = torch.tensor(job.block_ids, dtype=torch.long)
            dev = group_layers[0].device
            ld.ids = ids if dev.type == "cpu" else ids.pin_memory().to(dev, non_blocking=True)
        ids = ld.ids
        j = 0
        while j * m < hi:  # runs of chunks that sit next to each other in one fetch: one write per layer each
            f, start = ld.parts[j]
            k = 1
            while (j + k) * m < hi and ld.parts[j + k][0] is f and ld.parts[j + k][1] == start + k:
                k += 1
            b0, b1 = j * m, min((j + k) * m, hi)
            for layer in layers:
                if f.load is not None:  # this stream waits (on the GPU) for this layer's copy alone
                    f.load.wait(layer)
                    scatter_chunks(
                        f.load.staging[start : start + k, layer],
                        group_layers[layer],
                        w.codec,
                        ids[b0:b1],
                        first=max(0, lo - b0),
                    )
                    continue
                assert f.kv is not None  # (a fetch into host memory)
                src = f.kv[layer, :, start * c : start * c + (b1 - b0) * w.block_size]
                scatter_layer(src, group_layers[layer], w.codec, ids[b0:b1], first=max(0, lo - b0))
            j += k
        if not verify_first:  # the checks of what was written (they ran while it was written)
            good = next((n for n, (f, i) in enumerate(ld.parts[:ok]) if i >= f.verified()), ok)
            if good < ok:
                w.count("vllm_load_unverified_chunks", ok - good)
                ok, hi = good, min(job.fill_blocks, good * m)
                ld.failed = list(job.block_ids[max(lo, ok * m) : job.fill_blocks])
        if layers.stop == len(group_layers):
            w.count("vllm_loaded_chunks", ok)
            if len(w.specs) > 1:
                w.count(f"vllm_loaded_chunks_group{job.group}", ok)
            w.count("vllm_loaded_blocks", max(0, hi - lo))

    def _release(self, ld: Load) -> None:
        w = self.worker
        done = []
        with w.mu:
            for f in {id(f): f for f, _ in ld.parts}.values():
                f.refs -= 1
                if f.refs <= 0:
                    for h in f.hashes:
                        if self.inflight.get(h, (None,))[0] is f:
                            del self.inflight[h]
                    f.kv = None
                    if f.load is not None:
                        done.append(f.load)
                        f.load = None
        for load in done:  # waits for its copies (not for the writes from its staging), then unpins the slab chunks
            load.release()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)
