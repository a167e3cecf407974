"""`Reservations`: GPU-tier slots a same-node writer fills device to device (`gpu_ipc.write_chunks`), between
`KVNode.reserve_gpu` and `KVNode.commit_gpu`.

    reserve(items) -> GpuReserved     mutates (under the node's lock): a slot per chunk, or None for a chunk held
                                      already, bigger than a slot, or without room; the cascade evicts down for room
    commit(rid, sums) -> int          mutates: a slot whose bytes match the writer's device sum becomes readable
                                      with that sum; the rest are released. Returns how many became readable
    expire()                          mutates: releases reservations older than `ttl_s` (the writer died or gave up)

A reserved slot is pinned and unreadable until it is committed or released. The node's lock guards the cascade;
this object's table is only touched under it.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import Counter
from collections.abc import Callable

from kvmesh.cascade import Cascade
from kvmesh.tiers.slots import StoreTicket
from kvmesh.wire import GpuReserved, StoreItem


class Reservations:
    def __init__(
        self, cascade: Cascade, lock, counts: Counter, post_changes: Callable[[], int], ttl_s: float, slab_path: str
    ) -> None:
        self.cascade = cascade
        self.lock = lock  # the node's
        self.counts = counts  # the node's stats counters (under `lock`)
        self._post_changes = post_changes  # (under `lock`) hand the cascade's changes to the registrar: its seq
        self.ttl_s = ttl_s
        self.slab_path = slab_path
        # reservation id -> (GPU-tier tickets, one per chunk asked for or None, monotonic deadline)
        self._reserved: dict[int, tuple[list[StoreTicket | None], float]] = {}
        self._ids = itertools.count(secrets.randbits(48) + 1)  # (as the node's pin ids: not a previous process's)

    def reserve(self, items: list[StoreItem]) -> GpuReserved:
        gpu = self.cascade.gpu
        if gpu is None:
            return GpuReserved(0, [None] * len(items), self.slab_path)
        tickets: list[StoreTicket | None] = [None] * len(items)
        with self.lock:
            for idx in range(len(items) - 1, -1, -1):  # as a store: last first
                it = items[idx]
                if it.nbytes <= gpu.slot_bytes:
                    tickets[idx] = self.cascade.prepare(it.key, it.group, it.nbytes)
            rid = next(self._ids)
            got = sum(t is not None for t in tickets)
            if got:
                self._reserved[rid] = (tickets, time.monotonic() + self.ttl_s)
            self.counts["gpu_reserved_chunks"] += got
            self.counts["gpu_reserve_refused"] += len(items) - got
            self._post_changes()  # the victims demoted for room
        return GpuReserved(rid, [t.slot if t is not None else None for t in tickets], self.slab_path)

    def commit(self, reservation_id: int, sums: list[int | None]) -> tuple[int, int]:
        """(chunks that became readable, the registrar's sequence number to wait for; 0: nothing to wait for)."""
        gpu = self.cascade.gpu
        with self.lock:
            entry = self._reserved.pop(reservation_id, None)
            if entry is None:
                self.counts["gpu_commit_unknown"] += 1  # expired, or not ours
                return 0, 0
        tickets = entry[0]
        if len(sums) != len(tickets):
            sums = [None] * len(tickets)  # a malformed commit: release all
        assert gpu is not None  # (the reservation holds slots in it)
        # the bytes as they are in the slot: a write that landed elsewhere (a stale mapping) is never registered
        ok = [t is not None and s is not None and gpu.checksum_of(t.slot) == s for t, s in zip(tickets, sums)]
        with self.lock:
            for idx in range(len(tickets) - 1, -1, -1):  # last first, as a store
                t, s = tickets[idx], sums[idx]
                if t is None:
                    continue
                if ok[idx]:
                    assert s is not None
                    self.cascade.complete_device(t, s)
                else:
                    self.cascade.abort(t)
                    self.counts["store_d2d_mismatch" if s is not None else "store_d2d_not_written"] += 1
            stored = sum(ok)  # (counted as stored_chunks by the cascade, as every chunk that becomes readable)
            self.counts["stored_chunks_d2d"] += stored
            return stored, self._post_changes()

    def expire(self) -> None:
        """A writer that still copies into an expired slot afterwards can only spoil the slot's next chunk's bytes,
        which its device sum then refuses on every read (the TTL is pin_ttl_s, far longer than a copy)."""
        now = time.monotonic()
        with self.lock:
            for rid in [r for r, (_, deadline) in self._reserved.items() if deadline < now]:
                for t in self._reserved.pop(rid)[0]:
                    if t is not None:
                        self.cascade.abort(t)
                self.counts["gpu_reservations_expired"] += 1
