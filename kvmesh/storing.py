"""`Stores`: a KVNode's store path, on the request threads (a client's store, a pull-through that lands in a
buffer, a peer's handoff). Per chunk, last first: `Cascade.prepare` (victims demoted, not dropped), the copy into
the top tier, the check of what landed against the writer's checksum, `complete` (or `abort`); then, under the
node's lock, the cascade's changes go to the registrar and its disk writes to the I/O threads. A store returns
once its chunks are registered (or after REGISTER_WAIT_S: they stay queued).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from kvmesh.cascade import Cascade
from kvmesh.diskio import DiskIO
from kvmesh.registrar import Registrar
from kvmesh.tiers import checksum
from kvmesh.wire import StoreItem, WireError

WRITEBACK_WAIT_S = 2.0  # a store waits at most this long, in all, for write-back buffers (then evictions drop)
REGISTER_WAIT_S = 3.0  # a store returns once its chunks are registered, or after this (they stay queued)


class Stores:
    def __init__(
        self,
        cascade: Cascade,
        lock,
        counts: Counter,
        disk_io: DiskIO,
        post_changes: Callable[[], int],
        registrar: Registrar,
        stop: threading.Event,
    ) -> None:
        """`lock`: the node's (guards the cascade and `counts`); `post_changes` (under it): the cascade's changes
        to the registrar, its writes to `disk_io`; `registrar`: waited for until the chunks are registered."""
        self.cascade, self.tier, self.lock, self.counts = cascade, cascade.cpu, lock, counts
        self.disk_io, self._post_changes, self.registrar, self._stop = disk_io, post_changes, registrar, stop

    def store(self, items: list[StoreItem], buf: np.ndarray) -> int:
        if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size != sum(i.nbytes for i in items):
            raise WireError("StoreRequest: buffer size does not match the header")
        offsets = list(itertools.accumulate((i.nbytes for i in items), initial=0))
        counts: Counter[str] = Counter()
        stored = 0
        waits_until = time.monotonic() + WRITEBACK_WAIT_S
        # Last chunk first: the policy then holds a prompt's head as most recent, so eviction trims tails.
        for idx in range(len(items) - 1, -1, -1):
            item = items[idx]
            if item.nbytes > self.tier.slot_bytes:
                counts["store_refused_too_big"] += 1
                continue
            src = buf[offsets[idx] : offsets[idx + 1]]
            if not self._writeback_room(waits_until):
                counts["store_writeback_waits_expired"] += 1
            with self.lock:
                ticket = self.cascade.prepare(item.key, item.group, item.nbytes)
                top = self.cascade.top
                self.disk_io.put_writes()  # (to the disk now, not at the end: they free buffers)
            if ticket is None:
                counts["store_skipped" if self.cascade.holds(item.key) else "store_refused_full"] += 1
                continue
            if top is self.tier:  # copy, then check what landed
                dst = np.frombuffer(self.tier.buffer(ticket.slot), dtype=np.uint8)[: item.nbytes]
                np.copyto(dst, src)
                ok = checksum(dst) == item.checksum
            else:  # check the bytes before they go up to the device
                ok = checksum(src) == item.checksum
                if ok:
                    import torch

                    top.buffer(ticket.slot)[: item.nbytes].copy_(torch.from_numpy(src))
            with self.lock:
                if ok:
                    self.cascade.complete(ticket, item.checksum)  # (counted there: stored_chunks)
                    stored += 1
                else:
                    self.cascade.abort(ticket)
                    counts["store_corrupt_in_transit"] += 1
        with self.lock:
            self.counts.update(counts)
            seq = self._post_changes()
        self.registrar.wait(seq, REGISTER_WAIT_S)
        return stored

    def _writeback_room(self, until: float) -> bool:
        """Before a store evicts with every write-back buffer in use (a burst larger than the slab): wait, not
        under the lock, until the disk writers give one back, so that the evicted chunk goes to the disk instead of
        being dropped (a prompt's middle dropped makes its tail on disk useless to a lookup). False if `until`
        came first (a disk much slower than the stores: then they drop, as before, counted)."""
        while True:
            with self.lock:
                if not self.cascade.writeback_full():
                    return True
            if time.monotonic() >= until or self._stop.is_set():
                return False
            time.sleep(0.001)
