"""The write-back side of the tier cascade (`cascade.Cascade` is a `WriteBack`): chunks bound for the disk tier
are copied aside into page-aligned buffers (at most `writeback_buffers` of them) and handed to the node's disk I/O
threads as `WriteJob`s; `finish_write` ends each. Its state (`_writes`, `_pool`, `_pool_made`, `_pending`) is the
cascade's own, under the node's lock as the rest of it.

    take_writes() -> [WriteJob]     disk writes to run (demotions, write-through)
    finish_write(job, ok)           a write ended: the chunk is on disk (or, refused, dropped if nothing else holds it)
    writeback_full() -> bool        a store now would evict with every buffer in use (the node's store waits)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.tiers.slots import SlotPool, StoreTicket

if TYPE_CHECKING:
    from kvmesh.tiers.cpu import CpuTier
    from kvmesh.tiers.disk import DiskTier


@dataclass(slots=True)
class WriteJob:
    """One chunk bound for the disk tier; `data` (a page-aligned pool buffer) holds its bytes."""

    ticket: StoreTicket  # the disk slot, reserved (writing)
    data: object
    nbytes: int
    group: bytes
    checksum: int
    buffer: object = None  # the pool buffer to return
    demotion: bool = False  # the chunk left the CPU tier for the disk (a write-back, not a write-through)


class WriteBack:
    if TYPE_CHECKING:  # (the cascade's fields and methods this part uses)
        cpu: CpuTier
        disk: DiskTier | None
        write_policy: str
        writeback_buffers: int
        changes: dict
        counts: dict
        _writes: list
        _pool: list
        _pool_made: int
        _pending: dict
        on_written: Callable[[WriteJob, bool], None] | None

        @property
        def _disk(self) -> DiskTier: ...
        def _evicting(self, tier: SlotPool) -> Callable[[int], None]: ...
        def _flow(self, src: SlotPool, dst: SlotPool, nbytes: int) -> None: ...
        def best_tier(self, key: bytes) -> int | None: ...

    def _write_through(self, cpu_slot: int) -> None:
        if self.disk is None or self.write_policy != "write_through":
            return
        key = self.cpu.record(cpu_slot).key
        assert key is not None  # (the chunk just stored)
        if self.disk.slot_of(key) is None:
            self._queue_write(cpu_slot)  # if the buffers are all in use, write-back on eviction still applies

    def _queue_write(self, cpu_slot: int, demotion: bool = False) -> bool:
        """Copy a CPU chunk aside into a write buffer and queue it for the disk; the slab slot stays free to be
        evicted and reused at once (write-back), and a store is never refused for a write in flight."""
        from kvmesh.tiers.disk import aligned_buffer

        rec = self.cpu.record(cpu_slot)
        if not self._pool and self._pool_made >= self.writeback_buffers:
            self.counts["write_buffers_full"] += 1
            return False
        assert rec.key is not None  # (a chunk being evicted or written through)
        t = self._disk.prepare_store(rec.key, rec.group, rec.nbytes, on_evict=self._evicting(self._disk))
        if t is None:
            return False
        if self._pool:
            buf = self._pool.pop()
        else:
            buf = aligned_buffer(self.cpu.slot_bytes)
            self._pool_made += 1
        memoryview(buf)[: rec.nbytes] = self.cpu.chunk_view(cpu_slot)
        job = WriteJob(t, buf, rec.nbytes, rec.group, rec.checksum, buffer=buf, demotion=demotion)
        self._writes.append(job)
        self._pending[rec.key] = job  # readable from the buffer until it is on disk
        return True

    def writeback_full(self) -> bool:
        """Whether a store now would evict from the CPU tier with every write-back buffer in use: the evicted
        chunk would be dropped instead of going to the disk. The node's store waits (briefly, not under the lock)
        for the disk writers to give a buffer back first."""
        return (
            self.disk is not None
            and not self._pool
            and self._pool_made >= self.writeback_buffers
            and not self.cpu.free_bytes  # (no free slot: a store evicts)
        )

    def take_writes(self) -> list[WriteJob]:
        out, self._writes = self._writes, []
        return out

    def finish_write(self, job: WriteJob, ok: bool) -> None:
        key = job.ticket.key
        if self._pending.get(key) is job:
            del self._pending[key]
        if ok:
            self._disk.complete_store(job.ticket, job.checksum)
            self.counts["disk_writes"] += 1
            self.counts["demotions"] += job.demotion
            self._flow(self.cpu, self._disk, job.nbytes)
        else:
            self._disk.abort_store(job.ticket)
            self.counts["disk_write_errors"] += 1
            if self.best_tier(key) is None:  # it had left the CPU tier for this write: gone from the node
                self.counts["drops"] += 1
        if self.on_written is not None:
            self.on_written(job, ok)
        if job.buffer is not None:
            self._pool.append(job.buffer)
        self.changes[(job.group, key)] = self.best_tier(key)
