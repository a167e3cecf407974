"""`StoreQueue`: a client's stores on their way to its local KVNode. Never blocks the engine.

    submit(group, keys, chunks) -> int    copies the chunks (any strides) into staging that belongs to this store
                                          and hands them to the node without waiting; returns how many were
                                          handed over (0 when MAX_INFLIGHT stores are already in flight: dropped,
                                          counted, never waited for)
    flush(timeout_s) -> int               waits until every store handed over so far is in the node's tiers and
                                          registered; returns how many chunks the node stored
    close()

Chunks on a GPU are copied out on a side stream into page-locked staging and handed over by a background thread
once the copy is done: neither the caller nor its compute stream waits for the device-to-host copy, and
`record_stream` keeps freed KV memory from being reused before the copy read it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter

import numpy as np
import torch

from kvmesh.handle import NodeCallError, Pending
from kvmesh.spec import KVSpec
from kvmesh.tiers import checksum
from kvmesh.wire import StoreItem, WireError

log = logging.getLogger("kvmesh.client")
MAX_INFLIGHT = 16  # more pending stores than this and new ones are dropped (counted), never waited for


class StoreQueue:
    def __init__(self, spec: KVSpec, node, counts: Counter) -> None:
        self.spec = spec
        self.node = node  # handle of the local KVNode (handle.NodeHandle / LocalHandle)
        self.counts = counts
        self._lock = threading.Lock()  # _pending and _staging_jobs: the stager thread adds to them
        self._pending: list[Pending[int]] = []
        self._staged: queue.Queue = queue.Queue()  # stores being copied off a GPU, handed over by _stage_loop
        self._staging_jobs = 0
        self._stager: threading.Thread | None = None
        self._streams: dict = {}  # device -> side stream for device-to-host store copies

    def submit(self, group: bytes, keys: list[bytes], chunks: list[torch.Tensor]) -> int:
        if not keys:
            return 0
        with self._lock:
            if len(self._pending) + self._staging_jobs >= MAX_INFLIGHT:  # (only then: a look costs a Ray call each)
                self._pending = [p for p in self._pending if not p.done()]
            busy = len(self._pending) + self._staging_jobs >= MAX_INFLIGHT
        if busy:
            self.counts["store_dropped_busy"] += 1
            return 0
        if chunks[0].is_cuda:
            self._stage_from_device(group, keys, chunks)
        else:
            s = self.spec
            staging = np.empty(len(keys) * s.chunk_bytes, dtype=np.uint8)
            st = torch.from_numpy(staging).view(s.torch_dtype).view(len(keys), *s.chunk_shape)
            for j, chunk in enumerate(chunks):
                st[j].copy_(chunk)
            self._send(group, keys, staging)
        self.counts["stored_chunks"] += len(keys)
        return len(keys)

    def _stage_from_device(self, group: bytes, keys: list[bytes], chunks: list[torch.Tensor]) -> None:
        s = self.spec
        device = chunks[0].device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the KV as computed so far, nothing later
        staging = torch.empty(len(keys) * s.chunk_bytes, dtype=torch.uint8, pin_memory=True)
        st = staging.view(s.torch_dtype).view(len(keys), *s.chunk_shape)
        with torch.cuda.stream(stream):
            for j, chunk in enumerate(chunks):
                st[j].copy_(chunk, non_blocking=True)
                chunk.record_stream(stream)  # its memory is not reused (the engine may free it) before the copy
            done = torch.cuda.Event()
            done.record(stream)
        with self._lock:
            self._staging_jobs += 1
            if self._stager is None:
                self._stager = threading.Thread(target=self._stage_loop, name="kvmesh-client-stores", daemon=True)
                self._stager.start()
        self._staged.put((group, keys, staging, done))

    def _stage_loop(self) -> None:
        while True:
            job = self._staged.get()
            try:
                if job is None:
                    return
                group, keys, staging, done = job
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

    def _send(self, group: bytes, keys: list[bytes], staging: np.ndarray) -> None:
        """Checksum the staged chunks and hand them to the local node (not waited for)."""
        cb = self.spec.chunk_bytes
        items = [StoreItem(group, key, cb, checksum(staging[j * cb:(j + 1) * cb])) for j, key in enumerate(keys)]
        pending = self.node.store(items, staging)
        with self._lock:
            self._pending.append(pending)

    def flush(self, timeout_s: float = 30.0) -> int:
        self._staged.join()  # stores still being copied off a GPU are handed over first
        with self._lock:
            pending, self._pending = self._pending, []
        stored = 0
        for p in pending:
            try:
                stored += p.result(timeout_s)
            except (NodeCallError, TimeoutError, WireError):
                self.counts["store_failures"] += 1
        return stored

    def close(self) -> None:
        if self._stager is not None:
            self._staged.put(None)
            self._stager.join(timeout=10)
