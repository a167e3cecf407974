"""The tier cascade of one KVNode: GPU (optional) above the CPU slab above a local disk (optional). Pure
bookkeeping and memory copies over the tiers; the node holds its lock around every call, runs the disk I/O it
is handed on its I/O threads, and turns `changes` into directory updates.

    holds(key) / best_tier(key)             which tier has a chunk (the directory shows the best one)
    prepare(key, group, nbytes[, protect])  reserve a slot in the top tier; its victims are demoted, not dropped
    complete(ticket, checksum)              the chunk becomes readable (and, write_through, queued for disk)
    complete_device(ticket, device_sum)     a GPU-tier chunk written by a same-node GPU becomes readable
    prepare_host(keys) -> (n, reads)        phase 1 of a read: the leading n keys can be served from the CPU slab;
                                            `reads` are disk chunks to bring up first (CPU slots reserved)
    finish_host(keys, n, reads, ok) -> [slot]   phase 2: pins the leading run that made it into the CPU slab
    take_writes() -> [WriteJob]             disk writes to run (demotions, write-through); `finish_write` after
                                            (`writeback.py`: the write-back side, its buffers and pending writes)
    promote(keys) -> int                    copy CPU-only chunks up into the GPU tier (promotion on hit)
    discard(key)                            forget a chunk everywhere (corruption)
    ready_chunks() -> [(group, key, tier)]  everything held, with its best tier

A chunk may sit in several tiers at once (a copy made for a reader, a promotion, write-through); leaving a tier
moves it down only when no copy remains below. Copies keep the chunk's checksum: it was verified when the bytes
entered the node, and every read from disk verifies it again.

Write policies: `write_back` (default) writes a chunk to disk only when the CPU tier evicts it; `write_through`
also writes every chunk that lands in the CPU tier, so a restarted node finds everything on disk.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.tiers import TIER_CPU, TIER_DISK, TIER_GPU, TIER_NAMES
from kvmesh.tiers.cpu import CpuTier
from kvmesh.tiers.slots import SlotPool, StoreTicket
from kvmesh.writeback import WriteBack, WriteJob

if TYPE_CHECKING:
    from kvmesh.tiers.disk import DiskTier
    from kvmesh.tiers.gpu import GpuTier

WRITE_POLICIES = ("write_back", "write_through")


def _bytes(view):
    import torch  # only copies between the GPU and CPU tiers come here

    return view if isinstance(view, torch.Tensor) else torch.frombuffer(view, dtype=torch.uint8)


@dataclass(slots=True)
class DiskRead:
    key: bytes
    disk_slot: int
    ticket: StoreTicket  # the CPU slot it is read into
    nbytes: int
    checksum: int


@dataclass
class Cascade(WriteBack):
    cpu: CpuTier
    gpu: GpuTier | None = None
    disk: DiskTier | None = None
    write_policy: str = "write_back"
    writeback_buffers: int = 16  # chunks that may wait in memory for the disk; beyond that, evictions drop
    # (group, key) -> the chunk's best tier now, or None once no tier holds it; drained by the node
    changes: dict = field(default_factory=dict)
    counts: dict = field(
        default_factory=lambda: {
            "demotions": 0,
            "promotions": 0,
            "drops": 0,
            "host_copies": 0,
            "disk_writes": 0,
            "disk_reads": 0,
            "disk_write_errors": 0,
            "disk_read_errors": 0,
            "disk_checksum_failures": 0,
            "write_buffers_full": 0,
            "writeback_hits": 0,
        }
    )
    # chunks and bytes moved between this node's tiers, by (from, to) tier name; evictions by the tier they left
    flows: Counter = field(default_factory=Counter)
    flow_bytes: Counter = field(default_factory=Counter)
    evictions: Counter = field(default_factory=Counter)
    _writes: list = field(default_factory=list)
    _pool: list = field(default_factory=list)  # free write-back buffers
    _pool_made: int = 0
    _corrupt: list = field(default_factory=list)  # chunks that failed their checksum in run_reads or a copy
    _unreadable: list = field(default_factory=list)  # disk chunks whose read failed in run_reads
    _pending: dict = field(default_factory=dict)  # key -> WriteJob of a write-back still in memory
    # called for each chunk the CPU slab evicts, its bytes still in place: (slot, record, tier it is left in or
    # None when it leaves the node); the node's cluster eviction (lastcopy.py) decides there what to save
    on_leave: Callable[[int, object, int | None], None] | None = None
    # called for each disk write as it ends, its bytes still in the job's buffer: (job, whether it is on disk now);
    # a chunk that left the slab for a write the disk refused has left the node there (the node's cluster eviction)
    on_written: Callable[[WriteJob, bool], None] | None = None

    def __post_init__(self) -> None:
        assert self.write_policy in WRITE_POLICIES, self.write_policy

    @property
    def top(self) -> SlotPool:
        return self.gpu if self.gpu is not None else self.cpu

    def tiers(self) -> list[SlotPool]:
        """The tiers there are, best first."""
        return [t for t in (self.gpu, self.cpu, self.disk) if t is not None]

    @property
    def _disk(self) -> DiskTier:
        """The disk tier, where the caller knows there is one (a disk write or read is under way)."""
        assert self.disk is not None, "no disk tier"
        return self.disk

    def best_tier(self, key: bytes) -> int | None:
        for t in self.tiers():
            if t.slot_of(key) is not None:
                return t.tier_id
        return None

    def holds_group(self, group: bytes) -> bool:
        """Whether any tier holds (or is receiving) a chunk of prompt group `group`."""
        return any(t.group_counts.get(group) for t in self.tiers())

    def holds(self, key: bytes) -> bool:
        return any(key in t for t in self.tiers())

    def pinned(self, key: bytes) -> bool:
        """Whether a reader (or a writer) holds a pin on the chunk in any tier."""
        return any(t.pinned(key) for t in self.tiers())

    def writing(self, key: bytes) -> bool:
        """Whether the chunk is on its way to the disk tier (its write-back still in memory, not on disk yet)."""
        return key in self._pending

    def record_change(self, group: bytes, key: bytes) -> None:
        """The directory is to show the chunk at its best tier now (or not at all, if no tier holds it)."""
        self.changes[(group, key)] = self.best_tier(key)

    def count_read_error(self, code: str) -> None:
        """A disk read failed with `code` (an errno name): counted, and exported by it (disk_read_E*)."""
        self.counts["disk_read_errors"] += 1
        self.counts[f"disk_read_{code}"] = self.counts.get(f"disk_read_{code}", 0) + 1

    # -- placing ------------------------------------------------------------------------------------------------
    def prepare(self, key: bytes, group: bytes, nbytes: int, protect=frozenset()) -> StoreTicket | None:
        """`protect`: keys not to evict for this chunk (the rest of a read that is being put together)."""
        if self.holds(key):
            return None
        return self.top.prepare_store(key, group, nbytes, on_evict=self._evicting(self.top), protect=protect)

    def complete(self, ticket: StoreTicket, chunk_checksum: int) -> None:
        tier = self.top
        tier.complete_store(ticket, chunk_checksum)
        self._stored()
        rec = tier.record(ticket.slot)
        self.changes[(rec.group, rec.key)] = tier.tier_id
        if tier is self.cpu:
            self._write_through(ticket.slot)

    def complete_device(self, ticket: StoreTicket, device_sum: int) -> None:
        """A chunk a same-node writer copied device to device into a GPU-tier slot `prepare` reserved."""
        assert self.gpu is not None  # (prepare reserved the slot in it)
        self.gpu.complete_device_store(ticket, device_sum)
        self._stored()
        rec = self.gpu.record(ticket.slot)
        self.changes[(rec.group, rec.key)] = self.gpu.tier_id

    def _stored(self) -> None:
        """A chunk came into the node and became readable (a store, a pull-through, a device-to-device store): the
        one place `stored_chunks` is counted."""
        self.counts["stored_chunks"] = self.counts.get("stored_chunks", 0) + 1

    def abort(self, ticket: StoreTicket) -> None:
        self.top.abort_store(ticket)

    def _evicting(self, tier: SlotPool):
        def on_evict(slot: int) -> None:
            rec = tier.record(slot)
            key = rec.key
            assert key is not None  # (a victim holds a chunk)
            self.evictions[TIER_NAMES[tier.tier_id]] += 1
            if tier is self.gpu and self.cpu.slot_of(key) is None:
                self._copy(self.gpu, slot, self.cpu)  # demote instead of dropping
                self.counts["demotions"] += 1
            elif (
                tier is self.cpu
                and self.disk is not None
                and not self._above_or_on_disk(key)
                and key not in self._pending
            ):
                self._queue_write(slot, demotion=True)  # (counted a demotion once on disk: `finish_write`)
            below = self._best_except(key, tier)
            if tier is self.cpu and self.on_leave is not None:
                self.on_leave(slot, rec, below)
            if below is None:
                self.counts["drops"] += 1
            self.changes[(rec.group, key)] = below

        return on_evict

    def _above_or_on_disk(self, key: bytes) -> bool:
        return (self.gpu is not None and key in self.gpu) or key in self._disk

    def _best_except(self, key: bytes, leaving: SlotPool) -> int | None:
        for t in self.tiers():
            if t is not leaving and key in t:
                return t.tier_id
        return None

    def _copy(self, src: SlotPool, slot: int, dst: SlotPool, protect=frozenset()) -> int | None:
        """Copy the chunk in src's slot into a new slot of dst (memory tiers); None if dst had no room."""
        rec = src.record(slot)
        assert rec.key is not None  # (a chunk being copied between tiers)
        src.hold(slot)  # making room in dst may demote into src (GPU to CPU): never into this slot
        try:
            t = dst.prepare_store(rec.key, rec.group, rec.nbytes, on_evict=self._evicting(dst), protect=protect)
            if t is None:
                return None
            _bytes(dst.buffer(t.slot))[: rec.nbytes].copy_(_bytes(src.buffer(slot))[: rec.nbytes])
        finally:
            src.release(slot)
        carried = rec.checksum if dst is self.gpu else src.host_checksum(slot, dst.buffer(t.slot)[: rec.nbytes])
        if carried is None:  # a chunk from an engine's GPU whose device bytes fail their device checksum
            dst.abort_store(t)
            self._corrupt.append(rec.key)
            return None
        dst.complete_store(t, carried)
        self._flow(src, dst, rec.nbytes)
        if dst is self.cpu:
            self._write_through(t.slot)
        return t.slot

    def _flow(self, src: SlotPool, dst: SlotPool, nbytes: int) -> None:
        route = (TIER_NAMES[src.tier_id], TIER_NAMES[dst.tier_id])
        self.flows[route] += 1
        self.flow_bytes[route] += nbytes

    # -- reading ------------------------------------------------------------------------------------------------
    def prepare_host(self, keys: list[bytes]) -> tuple[int, list[DiskRead]]:
        """Bring the leading run of `keys` into the CPU slab (GPU-tier copies at once, disk reads queued for
        `run_reads`); returns how many lead and the reads. Room is made by evicting anything but the run staged so
        far: neither its earlier chunks (a copy of chunk k once evicted chunks 0..k-1 of the same read, which then
        pinned nothing) nor, by protecting keys not reached yet, every slot (a later chunk already in the slab
        kept the first from ever getting one)."""
        n, reads = 0, []
        protect: set[bytes] = set()  # keys[: n + 1]: grown key by key (a set made anew per key was O(n^2) under the
        for key in keys:  # node's lock: seconds for a prompt of thousands of small chunks, every reader waiting)
            protect.add(key)
            if self.cpu.slot_of(key) is not None:
                pass
            elif self.gpu is not None and (gslot := self.gpu.slot_of(key)) is not None:
                self.gpu.hold(gslot)  # keep it while copying
                try:
                    copied = self._copy(self.gpu, gslot, self.cpu, protect)
                finally:
                    self.gpu.release(gslot)
                if copied is None:
                    break
                self.counts["host_copies"] += 1
            elif self.writing(key):  # on its way to disk: serve it from the write-back buffer
                job = self._pending[key]
                t = self.cpu.prepare_store(
                    key, job.group, job.nbytes, on_evict=self._evicting(self.cpu), protect=protect
                )
                if t is None:
                    break
                memoryview(self.cpu.buffer(t.slot))[: job.nbytes] = memoryview(job.data)[: job.nbytes]
                self.cpu.complete_store(t, job.checksum)
                self.changes[(job.group, key)] = TIER_CPU
                self.counts["writeback_hits"] += 1
            elif self.disk is not None and (dslot := self.disk.slot_of(key)) is not None:
                rec = self.disk.record(dslot)
                self.disk.hold(
                    dslot
                )  # before making room: a CPU eviction's write-back may take a disk slot, never this one
                t = self.cpu.prepare_store(
                    key, rec.group, rec.nbytes, on_evict=self._evicting(self.cpu), protect=protect
                )
                if t is None:
                    self._disk.release(dslot)
                    break
                reads.append(DiskRead(key, dslot, t, rec.nbytes, rec.checksum))
            else:
                break
            n += 1
        return n, reads

    def finish_host(self, keys: list[bytes], n: int, reads: list[DiskRead], ok: list[bool]) -> list[int]:
        good = n
        for r, fine in zip(reads, ok):
            if self._disk.record(r.disk_slot).key == r.key:
                self._disk.unpin([r.disk_slot])
            if fine:
                self.cpu.complete_store(r.ticket, r.checksum)
                self.record_change(self.cpu.record(r.ticket.slot).group, r.key)
                self.counts["disk_reads"] += 1
                self._flow(self._disk, self.cpu, r.nbytes)
            else:
                self.cpu.abort_store(r.ticket)
                good = min(good, keys.index(r.key))
        slots = self.cpu.pin(keys[:good])
        for t in (self.gpu, self.disk):
            if t is not None:
                for key in reversed(keys[: len(slots)]):  # the head most recent: the tail is evicted first
                    t.touch(key)
        return slots

    def run_reads(self, reads: list[DiskRead]) -> list[bool]:
        """Do the disk reads of `prepare_host` (blocking I/O: call it without the node's lock): on the disk tier's
        reader threads, several in flight, each chunk verified as it lands in its reserved CPU slot. A chunk whose
        bytes fail their checksum is dropped from the disk tier for good (its commit record is erased); one whose
        read fails is dropped too (`discard_corrupt`)."""
        from kvmesh.tiers.disk import READ_CORRUPT, READ_OK, ChunkRead

        if not reads:
            return []
        outcomes = self._disk.read_verified(
            [ChunkRead(r.disk_slot, r.nbytes, r.checksum, self.cpu.buffer(r.ticket.slot)) for r in reads]
        )
        for r, outcome in zip(reads, outcomes):
            if outcome == READ_CORRUPT:
                self.counts["disk_checksum_failures"] += 1
                try:
                    self._disk.invalidate(r.disk_slot)
                except OSError:  # the record stays; the chunk is dropped from the tier below all the same
                    pass
                self._corrupt.append(r.key)
            elif outcome != READ_OK:  # an I/O error (a bad sector): a copy that cannot be read is no copy, and
                self.count_read_error(outcome.partition(":")[2] or "EIO")  # one left listed would be found, and
                self._unreadable.append(r.key)  # missed, by every lookup
        return [o == READ_OK for o in outcomes]

    def pin_host(self, keys: list[bytes]) -> list[int]:
        """Both phases at once (reads done inline): for callers that may block, such as tests."""
        n, reads = self.prepare_host(keys)
        ok = self.run_reads(reads)
        self.discard_corrupt()
        return self.finish_host(keys, n, reads, ok)

    def discard_corrupt(self) -> int:
        """Drop the chunks found corrupt or unreadable since the last call; returns how many were corrupt."""
        corrupt = len(self._corrupt)
        for key in self._corrupt + self._unreadable:
            self.discard(key)
        self._corrupt, self._unreadable = [], []
        return corrupt

    def promote(self, keys: list[bytes]) -> int:
        if self.gpu is None:
            return 0
        done = 0
        hit = set(keys)  # a promotion never evicts another chunk of the same hit
        for key in keys:
            slot = self.cpu.slot_of(key)
            if slot is None or self.gpu.slot_of(key) is not None:
                continue
            if self._copy(self.cpu, slot, self.gpu, protect=hit) is None:
                break
            rec = self.cpu.record(slot)
            self.changes[(rec.group, rec.key)] = TIER_GPU
            self.counts["promotions"] += 1
            done += 1
        return done

    def discard(self, key: bytes) -> None:
        group = None
        for tier in self.tiers():
            if (g := tier.group_of(key)) is not None:
                group = g
                tier.discard(key)
        if group is not None:
            self.changes[(group, key)] = None

    def ready_chunks(self) -> list[tuple[bytes, bytes, int]]:
        seen: dict[bytes, tuple[bytes, bytes, int]] = {}
        for tier in reversed(self.tiers()):  # best tier last, so it wins
            for group, key in tier.ready_chunks():
                seen[key] = (group, key, tier.tier_id)
        return list(seen.values())

    def drain(self) -> dict:
        out, self.changes = self.changes, {}
        return out

    def check_integrity(self, verify_checksums: bool = False) -> None:
        for tier in self.tiers():
            tier.check_integrity(verify_checksums and tier is not self.disk)
        for job in self._writes:
            assert self.disk is not None and not self.disk.record(job.ticket.slot).ready
        _ = (TIER_CPU, TIER_DISK)
