"""Pull-through: a KVNode brings chunks from a peer for its own readers, through the data plane's `Fetcher`, into
sinks of its own tiers. Concurrent readers of a chunk share its one transfer (`inflight.InflightPulls`). Whether
the chunks pulled stay on this node, registered, for the readers that come later (a replica), or are dropped once
this pull's readers unpin them, is `replication.Replicas`' call: a prompt group pulled by enough distinct nodes
within a window is kept, up to a bound on replicated bytes.

    SlotSink     into reserved CPU-slab slots: the socket writes the shared memory, each chunk becomes readable
                 (and is registered) once it arrived verified; slots of chunks that did not arrive are freed
    BufferSink   into a buffer, then the node's store path (when a GPU tier sits above the slab)
    PullThrough  the node's part: claim, pull (one `Fetcher.fetch` from the holder), release, then pin for the reader

`PullThrough` builds its own `Fetcher` (with this node's connections to its peers' DataServers and the
`kvmesh-node-pull-*` threads), so the node itself never imports the data plane.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvmesh.cascade import Cascade
from kvmesh.config import KVMeshConfig
from kvmesh.dataplane.fetcher import Fetcher, FetchOptions
from kvmesh.dataplane.sinks import Sink
from kvmesh.dataplane.sources import Env
from kvmesh.directory import Holder
from kvmesh.inflight import InflightPulls
from kvmesh.match import ChunkMatch
from kvmesh.nodeview import NodeView
from kvmesh.replication import Replicas
from kvmesh.tiers import TIER_CPU
from kvmesh.transport import DataClient
from kvmesh.wire import PullThrough as PullRequest
from kvmesh.wire import StoreItem


class SlotSink(Sink):
    """Chunk i lands in `tickets[i]`'s slab slot."""

    def __init__(self, cascade: Cascade, lock, post_changes: Callable[[], int], tickets: list, nbytes: int) -> None:
        self.cascade, self.lock, self._post_changes = cascade, lock, post_changes
        self.tickets, self.nbytes = tickets, nbytes
        self._sums: dict[int, int] = {}

    def _buf(self, i: int) -> np.ndarray:
        return np.frombuffer(self.cascade.cpu.buffer(self.tickets[i].slot), dtype=np.uint8)[: self.nbytes]

    def segments(self, i: int) -> list[np.ndarray]:
        return [self._buf(i)]

    def put(self, i: int, src) -> None:
        np.copyto(self._buf(i), np.frombuffer(src, dtype=np.uint8))

    def commit(self, i: int, chunk_checksum: int) -> None:
        self._sums[i] = chunk_checksum

    def finish(self, n: int) -> int:
        with self.lock:
            for j, t in enumerate(self.tickets):
                if j < n:
                    self.cascade.complete(t, self._sums[j])
                else:
                    self.cascade.abort(t)
            self._post_changes()
        return n


class BufferSink(Sink):
    """Chunks land back to back in one buffer, then go through the node's store path (checked again there)."""

    def __init__(self, store: Callable, keys: list[bytes], group: bytes, nbytes: int) -> None:
        self.store, self.keys, self.group, self.nbytes = store, keys, group, nbytes
        self.buf = np.empty(len(keys) * nbytes, dtype=np.uint8)
        self._sums: dict[int, int] = {}

    def segments(self, i: int) -> list[np.ndarray]:
        return [self.buf[i * self.nbytes : (i + 1) * self.nbytes]]

    def put(self, i: int, src) -> None:
        np.copyto(self.segments(i)[0], np.frombuffer(src, dtype=np.uint8))

    def commit(self, i: int, chunk_checksum: int) -> None:
        self._sums[i] = chunk_checksum

    def finish(self, n: int) -> int:
        if not n:
            return 0
        items = [StoreItem(self.group, k, self.nbytes, self._sums[j]) for j, k in enumerate(self.keys[:n])]
        return self.store(items, self.buf[: n * self.nbytes])


class PullThrough:
    """A node's pull-throughs. `run(request)` brings what it can of the request's chunks by its deadline (or waits
    for the readers already bringing them); the caller then pins what is here."""

    def __init__(
        self,
        node_id: str,
        lock,
        counts: Counter,
        cascade: Cascade,
        replicas: Replicas,
        view: NodeView,
        peers: Callable,
        store: Callable,
        post_changes: Callable[[], int],
        config: KVMeshConfig,
    ) -> None:
        """`lock`: the node's (guards the cascade, `counts` and the chunks in flight); `peers(node_id)`: a handle of
        that node's KVNode, or None; `store(items, buf)`: the node's store path (chunks that land in a buffer when a
        GPU tier sits above the slab); `post_changes` (under the lock): the cascade's changes to the registrar."""
        self.node_id, self._lock, self.counts, self.cascade, self.replicas = node_id, lock, counts, cascade, replicas
        self.view, self._store, self._post_changes = view, store, post_changes
        self.pull_batch_bytes = config.pull_batch_bytes  # a peer run's batches: at most this many bytes each
        self._inflight = InflightPulls()  # chunks being pulled for this node's readers (under the node's lock)
        self._data = DataClient()  # this node's connections to peers' DataServers
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvmesh-node-pull")
        self.fetcher = Fetcher(Env(node_id, None, None, 0, peers, view, self._data, self._pool))

    def close(self) -> None:
        self._data.close()
        self._pool.shutdown(wait=False)

    def _count(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1

    def run(self, req: PullRequest) -> None:
        deadline = time.monotonic() + req.deadline_ms / 1000
        with self._lock:
            mine, theirs = self._inflight.claim(req.keys, self.cascade.holds)
        pulled = 0
        try:
            if mine:
                pulled = self._pull(req, mine, deadline)
        finally:
            with self._lock:
                events = self._inflight.release(mine)
                self.counts["pull_through_calls"] += 1
                self.counts["pull_through_pulled_chunks"] += pulled
                self.counts["pull_through_waited_chunks"] += len(theirs)
            for ev in events:
                ev.set()
        for ev in theirs.values():  # another reader's transfer of these chunks; the tier says how it went
            if not ev.wait(max(0.0, deadline - time.monotonic())):
                break

    def _pull(self, req: PullRequest, keys: list[bytes], deadline: float) -> int:
        """Bring the leading run of `keys` from the holder into this node's tiers; returns how many chunks landed.
        Those `Replicas.admit` keeps are registered (replicas), the rest only serve this pull's readers. Failures
        end the run early and are counted, never raised."""
        cascade, replicas = self.cascade, self.replicas
        if req.holder == self.node_id or self.view.info(req.holder, req.incarnation) is None:
            self._count("pull_through_holder_unknown")
            return 0
        readers = replicas.readers(req.group)  # (one Redis round trip, none where every pull is kept)
        asked = keys
        with self._lock:
            keep = replicas.admit(readers, req.nbytes, len(keys))
            # chunks not kept are never registered, and are dropped once their readers unpin them; not those a
            # store placed here meanwhile (the readers' count above is a Redis round trip): those stay registered
            replicas.mark_transient([k for k in keys[keep:] if not cascade.holds(k)], req.group, req.nbytes)
            direct = cascade.top is cascade.cpu and req.nbytes <= cascade.cpu.slot_bytes
            if direct:
                tickets = []
                protect = frozenset(req.keys)
                for key in keys:
                    t = cascade.prepare(key, req.group, req.nbytes, protect)
                    if t is None:  # no unpinned slot to evict, or a store of it just began
                        break
                    tickets.append(t)
                keys = keys[: len(tickets)]
        n = 0
        try:
            if keys:
                sink = (
                    SlotSink(cascade, self._lock, self._post_changes, tickets, req.nbytes)
                    if direct
                    else BufferSink(self._store, keys, req.group, req.nbytes)
                )
                holder = (Holder(req.holder, req.incarnation, TIER_CPU),)
                per_batch = max(1, self.pull_batch_bytes // req.nbytes)
                opts = FetchOptions(req.nbytes, deadline, req.transport, False, req.group, per_batch)
                n, stats = self.fetcher.fetch([ChunkMatch(k, holder) for k in keys], sink, opts)
                if stats.error:
                    self._count(f"pull_through_error_{stats.error}")
        finally:
            with self._lock:
                replicas.settle(asked, req.nbytes, keep, n, cascade.holds)
                kept = min(keep, n)
                self.counts["replicated_chunks_added"] += kept
                self.counts["replicated_bytes_added"] += kept * req.nbytes
                self.counts[
                    "replication_refused_cold" if readers < replicas.min_readers else "replication_refused_bytes"
                ] += max(0, n - keep)
        return n
