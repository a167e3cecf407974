"""`StoreQueue`: a client's stores on their way to its local KVNode. Never blocks the engine.

    submit(group, keys, chunks) -> int    copies the chunks (any strides) into staging that belongs to this store
                                          and hands them to the node without waiting; returns how many were
                                          handed over (0 when MAX_INFLIGHT stores are already in flight: dropped,
                                          counted, never waited for)
    flush(timeout_s) -> int               waits until every store handed over so far is in the node's tiers and
                                          registered; returns how many chunks the node stored
    flush_own(mine, timeout_s) -> int     the same for the stores of one `submit(..., mine=)` alone (of host
                                          chunks): a caller that must know whether its own store was taken
    close()

Chunks on a GPU are first copied on the caller's stream (one device-to-device kernel, `_snapshot`): a store reads
the KV as it is when `submit` is called, and the caller may overwrite it at once. They are then copied out on a
side stream into page-locked staging and handed over by a background thread once the copy is done: neither the
caller nor its compute stream waits for the device-to-host copy, and `record_stream` keeps the snapshot's memory
from being reused before the copy read it.

Chunks on a GPU whose node's GPU pools this client maps (`gpu()`, a `GpuReads`) go device to device instead,
from the background thread, ordered after an event recorded on the caller's stream at `submit` (the KV as
computed so far): `reserve_gpu` (the node allocates GPU-tier slots), `gpu_ipc.write_chunks` on a side stream
(same GPU: D2D; another GPU of the node with peer access: peer to peer), `commit_gpu` with the device sums of what
landed (not waited for). Chunks without a slot (held, no room, no GPU tier), on a GPU that cannot reach the pool
peer to peer, or whose reservation failed take the host path above; never an error for the caller.
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
from kvmesh.handle import NodeCallError, Pending
from kvmesh.match import StoreResult
from kvmesh.spec import KVSpec
from kvmesh.tiers import checksum
from kvmesh.wire import MAX_KEYS, GpuReserved, StoreItem, WireError

log = logging.getLogger("kvmesh.client")
MAX_INFLIGHT = 16  # more pending stores than this and new ones are dropped (counted), never waited for
RESERVE_TIMEOUT_S = 5.0  # a node that does not answer a GPU-tier reservation by then: the host path


class StoreQueue:
    def __init__(self, spec: KVSpec, node, counts, gpu=None) -> None:
        """`counts`: a Counter, or a client's `ClientTelemetry`, whose counters (shared or not) are counted into."""
        self.spec = spec
        self.node = node  # handle of the local KVNode (handle.NodeHandle / LocalHandle)
        self._counts = counts
        self.gpu = gpu  # () -> the node's GPU pools as mapped here (dataplane.gpureads.GpuReads) or None
        self._lock = threading.Lock()  # _pending and _staging_jobs: the stager thread adds to them
        self._pending: list[Pending[int]] = []  # replies not yet counted by a flush (or by the busy check)
        self._settled = 0  # chunks stored by replies read (and dropped from _pending) before any flush counted them
        self._staged: queue.Queue = queue.Queue()  # stores being copied off a GPU, handed over by _stage_loop
        self._staging_jobs = 0
        self._stager: threading.Thread | None = None
        self._streams: dict = {}  # device -> side stream for device-to-host store copies
        self.refused = ""  # why the last store that handed nothing over did not: "busy", "no_device_memory"

    @property
    def counts(self) -> Counter:
        c = self._counts
        return c if isinstance(c, Counter) else c.counts

    def attach(self, node) -> None:
        """Stores go to `node` from now on: the KVNode actor that took the local one's place."""
        self.node = node

    def store(self, group: bytes, keys: list[bytes], chunk, held: list[bool], snapshot: bool, mine) -> StoreResult:
        """A client's store of `keys` (`chunk(i)`: key i's KV) of which `held` are cached already: the others are
        handed over (`submit`); what became of each."""
        todo = [i for i in range(len(keys)) if not held[i]]
        handed = self.submit(group, [keys[i] for i in todo], [chunk(i) for i in todo], snapshot, mine)
        refused = self.refused if handed < len(todo) else ""
        return StoreResult(handed, len(keys) - len(todo), len(todo) - handed, refused)

    def submit(
        self,
        group: bytes,
        keys: list[bytes],
        chunks: list[torch.Tensor],
        snapshot: bool = True,
        mine: list | None = None,
    ) -> int:
        """`snapshot=False`: the caller never writes the chunks again (a GPU store then reads them as they are).
        `mine`: a list that receives this store's replies, for `flush_own` (host chunks only: a GPU store is handed
        over by the background thread, and its replies are not collected)."""
        if not keys:
            return 0
        if len(keys) > MAX_KEYS:  # one message names at most MAX_KEYS chunks (the node refuses more, whole)
            return sum(
                self.submit(group, keys[i : i + MAX_KEYS], chunks[i : i + MAX_KEYS], snapshot, mine)
                for i in range(0, len(keys), MAX_KEYS)
            )
        with self._lock:
            if len(self._pending) + self._staging_jobs >= MAX_INFLIGHT:  # (only then: a look costs a Ray call each)
                done: list[Pending[int]] = []
                waiting: list[Pending[int]] = []
                for p in self._pending:
                    (done if p.done() else waiting).append(p)
                self._pending = waiting
                self._settled += sum(self._read(p) for p in done)  # (answered: their counts are kept)
            busy = len(self._pending) + self._staging_jobs >= MAX_INFLIGHT
        if busy:
            self.counts["store_dropped_busy"] += 1
            self.refused = "busy"
            return 0
        if chunks[0].is_cuda and snapshot:
            try:
                chunks = _snapshot(chunks)
            except torch.cuda.OutOfMemoryError:  # no room for the copy: not stored (never stale bytes)
                self.counts["store_dropped_no_device_memory"] += 1
                self.refused = "no_device_memory"
                return 0
            gpu = self.gpu() if self.gpu is not None else None
            if gpu is not None and any(_reaches(chunks[0].device, d) for d in gpu.devices):
                self._queue(("d2d", group, keys, chunks, self._mark(chunks[0].device), gpu))
            else:
                self._stage_from_device(group, keys, chunks)
        else:
            self._send_host(group, keys, chunks, mine)
        self.counts["stored_chunks"] += len(keys)
        return len(keys)

    def _side(self, device: torch.device):
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = side_stream(device)
        return stream

    @staticmethod
    def _mark(device: torch.device) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))  # the KV as computed so far, nothing later
        return ev

    def _queue(self, job: tuple) -> None:
        with self._lock:
            self._staging_jobs += 1
            if self._stager is None:
                self._stager = threading.Thread(target=self._stage_loop, name="kvmesh-client-stores", daemon=True)
                self._stager.start()
        self._staged.put(job)

    def _stage_from_device(
        self, group: bytes, keys: list[bytes], chunks: list[torch.Tensor], after: torch.cuda.Event | None = None
    ) -> tuple:
        """Queue the device-to-host copy into page-locked staging (after `after`, else after the current stream's
        work) and hand the job to the background thread; with `after` (already on that thread) return it."""
        s = self.spec
        device = chunks[0].device
        stream = self._side(device)
        if after is None:
            stream.wait_stream(torch.cuda.current_stream(device))  # the KV as computed so far, nothing later
        else:
            stream.wait_event(after)
        staging = torch.empty(len(keys) * s.chunk_bytes, dtype=torch.uint8, pin_memory=True)
        st = staging.view(s.torch_dtype).view(len(keys), *s.chunk_shape)
        with torch.cuda.stream(stream):
            for j, chunk in enumerate(chunks):
                st[j].copy_(chunk, non_blocking=True)
                chunk.record_stream(stream)  # its memory is not reused (the engine may free it) before the copy
            done = torch.cuda.Event()
            done.record(stream)
        job = ("host", group, keys, staging, done)
        if after is None:
            self._queue(job)
        return job

    def _store_d2d(self, group: bytes, keys: list[bytes], chunks: list[torch.Tensor], ready, gpu) -> None:
        """(the background thread) Device to device into the GPU tier; what did not go that way, through the host."""
        rest = self.write_to_gpu_tier(group, keys, chunks, ready, gpu)
        if rest:
            sub = [chunks[i] for i in rest]
            if sub[0].is_cuda:
                _, g, k, staging, done = self._stage_from_device(group, [keys[i] for i in rest], sub, ready)
                done.synchronize()
                self._send(g, k, staging.numpy())
            else:
                self._send_host(group, [keys[i] for i in rest], sub)

    def write_to_gpu_tier(self, group: bytes, keys: list[bytes], chunks: list[torch.Tensor], ready, gpu) -> list[int]:
        """Reserve GPU-tier slots, write the chunks into them through `gpu` (the mapped pools; `ready`: the event
        the copies wait for, None on the CPU), commit them (not waited for). Returns the indices of the chunks
        that did not go this way (for the host path)."""
        cb = self.spec.chunk_bytes
        try:
            r: GpuReserved = self.node.reserve_gpu([StoreItem(group, k, cb, 0) for k in keys]).result(RESERVE_TIMEOUT_S)
        except (NodeCallError, TimeoutError, WireError) as e:
            self.counts["store_d2d_unavailable"] += 1
            log.debug("kvmesh: no GPU-tier reservation (%s): the host path", e)
            return list(range(len(keys)))
        sums: list[int | None] = [None] * len(keys)
        reserved = any(s is not None for s in r.slots)
        if not reserved:
            pass  # held already, no room, no GPU tier: the host path
        elif len(r.slots) != len(keys) or r.slab_path != gpu.incarnation:  # slots of pools we have not mapped
            self.counts["store_d2d_stale"] += 1
        else:
            by_dev: dict = {}
            for i, slot in enumerate(r.slots):
                if slot is not None:
                    by_dev.setdefault(gpu.view(slot, cb).device, []).append(i)
            for dev, idxs in by_dev.items():
                if not _reaches(chunks[0].device, dev):
                    continue
                try:
                    got = self._write(chunks, idxs, [gpu.view(r.slots[i], cb) for i in idxs], ready, dev)
                except (RuntimeError, ValueError) as e:  # (GpuIpcError is one): released, the host path
                    self.counts["store_d2d_failed"] += 1
                    log.warning("kvmesh: a device-to-device store failed (%s): the host path", e)
                    continue
                for i, v in zip(idxs, got):
                    sums[i] = v
        written = [i for i, v in enumerate(sums) if v is not None]
        if reserved:  # (unwritten slots, None, are released by it)
            pending = self.node.commit_gpu(r.reservation_id, sums)
            with self._lock:
                self._pending.append(pending)
        self.counts["stored_chunks_d2d"] += len(written)
        self.counts["store_d2d_fallback"] += len(keys) - len(written)
        return [i for i in range(len(keys)) if sums[i] is None]

    def _write(self, chunks: list[torch.Tensor], idxs: list[int], dsts: list[torch.Tensor], ready, dev) -> list[int]:
        """chunks[idxs] -> dsts (slot views on `dev`) with `gpu_ipc.write_chunks`; their device sums (waits)."""
        from kvmesh.tiers.gpu_ipc import write_chunks

        src_dev = chunks[0].device
        if not src_dev.type == "cuda":
            return write_chunks([_flat_bytes(chunks[i]) for i in idxs], dsts).sums()
        side = self._side(src_dev)
        if ready is not None:
            side.wait_event(ready)
        with torch.cuda.stream(side):  # a strided chunk is made contiguous on the side stream, after `ready`
            srcs = [_flat_bytes(chunks[i]) for i in idxs]
            for i in idxs:
                chunks[i].record_stream(side)
        stream = side if dev == src_dev else self._side(dev)
        if stream is not side:
            stream.wait_stream(side)
        # (the caller's references to chunks and srcs live until the sums are in: the copies read live memory)
        return write_chunks(srcs, dsts, peer=True, stream=stream).sums()

    def _send_host(self, group: bytes, keys: list[bytes], chunks: list[torch.Tensor], mine: list | None = None) -> None:
        s = self.spec
        staging = np.empty(len(keys) * s.chunk_bytes, dtype=np.uint8)
        st = torch.from_numpy(staging).view(s.torch_dtype).view(len(keys), *s.chunk_shape)
        for j, chunk in enumerate(chunks):
            st[j].copy_(chunk)
        self._send(group, keys, staging, mine)

    def _stage_loop(self) -> None:
        while True:
            job = self._staged.get()
            try:
                if job is None:
                    return
                if job[0] == "d2d":
                    self._store_d2d(*job[1:])
                else:
                    _, group, keys, staging, done = job
                    done.synchronize()
                    self._send(group, keys, staging.numpy())
            except Exception as e:  # a store is best effort: count it, never raise into the engine
                self.counts["store_failures"] += 1
                log.warning("kvmesh: handing a store to the node failed: %s", e)
            finally:
                if job is not None:
                    with self._lock:
                        self._staging_jobs -= 1
                self._staged.task_done()

    def _send(self, group: bytes, keys: list[bytes], staging: np.ndarray, mine: list | None = None) -> None:
        """Checksum the staged chunks and hand them to the local node (not waited for)."""
        cb = self.spec.chunk_bytes
        items = [StoreItem(group, key, cb, checksum(staging[j * cb : (j + 1) * cb])) for j, key in enumerate(keys)]
        pending = self.node.store(items, staging)
        with self._lock:
            self._pending.append(pending)
        if mine is not None:
            mine.append(pending)

    def flush_own(self, mine: list, timeout_s: float) -> int:
        """`flush` of the replies in `mine` alone (a `submit(..., mine=)`): how many of its chunks the node stored
        and registered within `timeout_s`. `flush` counts every store no earlier flush counted: a caller that
        compared it with its own store's size took an earlier store's late reply (one whose flush timed out) for
        its own, and said a store fully taken was not. A reply not in by then stays pending (a later `flush`
        counts it); one read here is counted here only."""
        end = time.monotonic() + timeout_s
        stored = 0
        for p in mine:
            try:
                n, error = p.result(max(0.0, end - time.monotonic())), None
            except TimeoutError:
                self.counts["store_flush_timeouts"] += 1
                continue
            except (NodeCallError, WireError, OSError) as e:
                n, error = 0, e
            with self._lock:
                if any(p is q for q in self._pending):
                    self._pending = [q for q in self._pending if q is not p]
                    if error is not None:
                        self.counts["store_failures"] += 1
                else:  # read by the busy check meanwhile: its count is ours, not a later flush's
                    self._settled = max(0, self._settled - n)
            stored += n
        return stored

    def flush(self, timeout_s: float = 30.0) -> int:
        """Waits for every store handed over so far, whichever thread handed it over (a flush of one thread used to
        take the replies of all, and another thread's flush then returned at once, before its own store was in).
        Each reply is counted by one flush: the first to read it."""
        self._staged.join()  # stores still being copied off a GPU are handed over first
        with self._lock:
            waiting = list(self._pending)
        end = time.monotonic() + timeout_s  # one deadline for them all, not timeout_s each
        results: list[tuple[Pending[int], int, Exception | None]] = []
        for p in waiting:
            try:
                results.append((p, p.result(max(0.0, end - time.monotonic())), None))
            except TimeoutError:
                # not answered yet: left pending (a later flush, or the busy check, counts it; a flush with a longer
                # timeout waiting on it meanwhile still reads it), not counted a failure: it may well land
                self.counts["store_flush_timeouts"] += 1
            except (NodeCallError, WireError, OSError) as e:
                results.append((p, 0, e))
        with self._lock:
            stored, self._settled = self._settled, 0
            for p, n, error in results:
                if not any(p is q for q in self._pending):
                    continue  # counted by another flush, or by the busy check
                self._pending = [q for q in self._pending if q is not p]
                stored += n
                if error is not None:
                    self.counts["store_failures"] += 1
        return stored

    def _read(self, p: Pending[int]) -> int:
        """(under _lock) An answered reply's chunks stored, 0 (and counted as a failure) for one that failed."""
        try:
            return p.result(0.0)
        except (NodeCallError, TimeoutError, WireError, OSError):
            self.counts["store_failures"] += 1
            return 0

    def close(self) -> None:
        if self._stager is not None:
            self._staged.put(None)
            self._stager.join(timeout=10)


def _snapshot(chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    """The chunks as they are at `submit`, copied on the caller's current stream (one kernel) into memory that
    belongs to this store. The copies off the GPU run later, on a side stream or from the background thread:
    reading the caller's own memory there, a caller that reuses its KV buffer at once (a static cache, the next
    request's prefill into the same pages) would have those later bytes stored under this prompt's keys, with
    checksums that match them."""
    return list(torch.stack(chunks))


def _reaches(src: torch.device, dst: torch.device) -> bool:
    """Whether a copy from `src` into a pool on `dst` goes device to device: the same GPU, or a peer it can
    access (else the host path: a bounce through host memory would gain nothing over it). On the CPU (a GPU
    tier's CPU stand-in, in tests) only the same device."""
    if src.type != "cuda" or dst.type != "cuda":
        return src == dst
    return src == dst or torch.cuda.can_device_access_peer(src.index, dst.index)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A chunk's bytes as one contiguous uint8 vector (a copy, on the current stream, if it is strided)."""
    return t.contiguous().view(-1).view(torch.uint8)
