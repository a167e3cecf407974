"""CPU tier: the slots of a `SlotPool` in one shared-memory slab.

The slab is a file under /dev/shm mapped by the owning KVNode (read-write) and by every worker on the node
(`SlabReader`, read-only), so a local hit is read at memory bandwidth without the bytes passing through an actor
call. Where CUDA is available the mapping is page-locked, so copies to and from the GPU run at bus speed.

Device checksums of slab chunks (tiers.devsum), recorded after a chunk became readable by its node's
device-checksum thread, in two phases around the computation (the owner's lock held for each, not between):

    take_devsum_work(limit) -> [DevsumWork]     mutates: takes readable chunks whose device checksum is unknown,
                                                oldest first (not pinned: the thread never keeps a chunk from being
                                                evicted; see `generation`)
    compute_devsum(work, coefficients) -> int | None
                                                pure, no lock: S of the slot's bytes, or None when those bytes no
                                                longer match the chunk's xxh3 (nothing is recorded for them)
    finish_devsum(work, devsum)                 mutates: records it if the slot still holds the same store of the
                                                same chunk (else the bytes it read may have changed under it)
    devsum_pending() -> int                     reads: readable chunks without one yet
    devsum_queued() -> int                      reads: chunks still queued for the thread

`SlabSums` is that thread: it owns the loop, beside the slab it reads.

A slot's device checksum is reset whenever it is taken for other bytes (`Slot.devsum`); a ready slot's bytes never
change otherwise (only corruption changes them, which the xxh3 re-check or the reader's check catches).
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import deque
from dataclasses import dataclass

from kvmesh.tiers import TIER_CPU, checksum
from kvmesh.tiers.slots import Slot, SlotPool, StoreTicket  # noqa: F401  (re-exported)


def page_lock(buf, read_only: bool = False) -> int | None:
    """Page-lock `buf` for fast DMA when CUDA is available. Returns the registered address (for
    `page_unlock`), or None when it did not. Never leaves a CUDA error behind for the next kernel to trip on."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        import numpy as np

        arr = np.frombuffer(buf, dtype=np.uint8)
        flags = 0x08 if read_only else 0x00  # cudaHostRegisterReadOnly / cudaHostRegisterDefault
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(arr.ctypes.data, arr.nbytes, flags)
        if int(err) != 0:
            _clear_cuda_error()  # torch checks the last CUDA error after every kernel launch
            try:  # and where cudart is linked into torch itself, one launch check of ours reads (resets) it
                torch.zeros(1, device="cuda")
            except Exception:
                pass
            return None
        return arr.ctypes.data
    except Exception:  # pinning is an optimisation; an unpinned slab still works
        return None


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's sticky-until-read last error (torch's cudart binding has no cudaGetLastError)."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            path = next((line.split()[-1] for line in f if "libcudart" in line), None)
        if path:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        pass


def page_unlock(address: int | None) -> None:
    """Undo `page_lock` before the memory is unmapped (a later mapping at the same address must not find a
    stale registration)."""
    if address is None:
        return
    import torch

    torch.cuda.cudart().cudaHostUnregister(address)


@dataclass(frozen=True, slots=True)
class DevsumWork:
    """A chunk whose device checksum is being computed: its slot, key, size and xxh3, and the slot's generation
    when it was taken."""

    slot: int
    key: bytes
    nbytes: int
    checksum: int
    generation: int


class CpuTier(SlotPool):
    tier_id = TIER_CPU

    def __init__(self, path: str, num_slots: int, slot_bytes: int) -> None:
        super().__init__(num_slots, slot_bytes)
        self.path = path
        # (slot, key) of chunks that became readable, for the device-checksum thread; stale entries (the slot
        # reused since) are skipped, and at most one per slot is worth keeping, hence the bound
        self._devsum_todo: deque[tuple[int, bytes]] = deque(maxlen=num_slots)
        self._generation = [0] * num_slots  # per slot: how many times it was taken for new bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, num_slots * slot_bytes)  # sparse: each slot is given its memory when first used
            self._mm = mmap.mmap(fd, num_slots * slot_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        # (self._backed, per slot: its memory is allocated (posix_fallocate))
        self.unbacked_refusals = 0  # stores refused because the file system had no memory left for their slot
        if hasattr(mmap, "MADV_HUGEPAGE"):  # fewer page-table entries for DMA where shmem huge pages are allowed
            try:
                self._mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self._view = memoryview(self._mm)
        self._locked_at = page_lock(self._mm)

    @property
    def page_locked(self) -> bool:
        return self._locked_at is not None

    def buffer(self, slot: int) -> memoryview:
        off = slot * self.slot_bytes
        return self._view[off : off + self.slot_bytes]

    def chunk_view(self, slot: int) -> memoryview:
        return self.buffer(slot)[: self._slots[slot].nbytes]

    def checksum_of(self, slot: int) -> int:
        return checksum(self.chunk_view(slot))

    def prepare_store(
        self, key: bytes, group: bytes, nbytes: int, on_evict=None, protect: set[bytes] | frozenset = frozenset()
    ) -> StoreTicket | None:
        ticket = super().prepare_store(key, group, nbytes, on_evict, protect)
        if ticket is None:
            return None
        if not self._backed[ticket.slot] and not self._back(ticket.slot):
            self.abort_store(ticket)  # (its victims went down the cascade as for any store)
            self.park_unbacked()  # the next stores evict from the slots that have memory
            return None
        self._generation[ticket.slot] += 1  # new bytes: a device checksum being computed over the old ones is void
        return ticket

    def _back(self, slot: int) -> bool:
        """Give a slot its memory before its first write. The slab is sparse, and a write into a page the file
        system has no memory for (a full /dev/shm, which Ray's object store shares) kills the process with SIGBUS:
        a slot that cannot get its memory refuses its store instead."""
        try:
            os.posix_fallocate(self._fd, slot * self.slot_bytes, self.slot_bytes)
        except OSError:
            self.unbacked_refusals += 1
            return False
        self._backed[slot] = 1
        return True

    def complete_store(self, ticket: StoreTicket, chunk_checksum: int) -> None:
        super().complete_store(ticket, chunk_checksum)
        self._devsum_todo.append((ticket.slot, ticket.key))

    # -- device checksums ---------------------------------------------------------------------------------------
    def take_devsum_work(self, limit: int) -> list[DevsumWork]:
        out: list[DevsumWork] = []
        while self._devsum_todo and len(out) < limit:
            slot, key = self._devsum_todo.popleft()
            s = self._slots[slot]
            if s.key != key or not s.ready or s.doomed or s.devsum is not None:
                continue  # reused, discarded or done since
            out.append(DevsumWork(slot, key, s.nbytes, s.checksum, self._generation[slot]))
        return out

    def compute_devsum(self, work: DevsumWork, coefficients=None) -> int | None:
        import torch

        from kvmesh.tiers.devsum import host_device_checksum

        view = self.buffer(work.slot)[: work.nbytes]
        sum_ = host_device_checksum(torch.frombuffer(view, dtype=torch.uint8), coefficients)
        # after S, over the same bytes: S vouches only for bytes that still match the chunk's xxh3 (bytes changed
        # in between by a reuse of the slot are caught by finish_devsum's generation check)
        return sum_ if checksum(view) == work.checksum else None

    def finish_devsum(self, work: DevsumWork, devsum: int | None) -> None:
        s = self._slots[work.slot]
        if (
            devsum is not None
            and s.key == work.key
            and s.ready
            and not s.doomed
            and self._generation[work.slot] == work.generation
        ):
            s.devsum = devsum

    def devsum_pending(self) -> int:
        return sum(1 for s in self._slots if s.ready and not s.doomed and s.devsum is None)

    def devsum_queued(self) -> int:
        """Chunks queued for the device-checksum thread (0: every readable chunk has been through it)."""
        return len(self._devsum_todo)

    def check_integrity(self, verify_checksums: bool = False) -> None:
        super().check_integrity(verify_checksums)
        if verify_checksums:
            import torch

            from kvmesh.tiers.devsum import host_device_checksum

            for i, s in enumerate(self._slots):
                if s.ready and not s.doomed and s.devsum is not None:
                    got = host_device_checksum(torch.frombuffer(self.chunk_view(i), dtype=torch.uint8))
                    assert got == s.devsum, f"slot {i} fails its device checksum"

    def close(self) -> None:
        page_unlock(self._locked_at)
        self._locked_at = None
        self._view.release()
        try:
            self._mm.close()
        except BufferError:  # a view is still exported (e.g. a reader in this process); unmapped at exit
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class SlabSums:
    """The node's device-checksum thread (`kvmesh-node-devsum`): records the device checksum of every chunk that
    becomes readable in the CPU slab (stores, copies from the GPU tier, disk reads, pull-throughs), a few at a time.
    Off the store path on purpose: a store returns as soon as its chunks are verified and registered, and a reader
    that pins a chunk before its sum is recorded checks it with xxh3, as it did before sums existed. A chunk whose
    bytes no longer match its xxh3 gets no sum (its next reader finds it corrupt and reports it, as before). Never
    pins, so it holds no chunk back from eviction. `lock` (the node's) is held to take work and to record; the sums
    are computed without it. `counts` (under `lock`): slab_devsums, slab_devsums_refused."""

    def __init__(self, tier: CpuTier, lock, counts, stop: threading.Event) -> None:
        self.tier, self.lock, self.counts, self._stop = tier, lock, counts, stop
        self.busy = 0  # chunks the thread is working on now (under the lock)
        self._thread = threading.Thread(target=self._loop, name="kvmesh-node-devsum", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)

    def queued(self) -> int:
        """Caller holds the lock: chunks waiting for a sum, and those being summed."""
        return self.tier.devsum_queued() + self.busy

    def _loop(self) -> None:
        from kvmesh.tiers.devsum import Coefficients

        coefficients = Coefficients()  # the constants, built once for this thread
        while not self._stop.is_set():
            with self.lock:
                work = self.tier.take_devsum_work(4)
                self.busy = len(work)
            if not work:
                self._stop.wait(0.02)
                continue
            sums: list[int | None] = []
            try:
                for w in work:
                    sums.append(self.tier.compute_devsum(w, coefficients))
            finally:
                sums += [None] * (len(work) - len(sums))
                with self.lock:
                    for w, d in zip(work, sums):
                        self.tier.finish_devsum(w, d)
                    self.busy = 0
                    recorded = sum(d is not None for d in sums)
                    self.counts["slab_devsums"] += recorded
                    self.counts["slab_devsums_refused"] += len(sums) - recorded


class SlabReader:
    """A worker's read-only mapping of a node's CPU slab. `SlabReader.open` shares one mapping among all the
    clients of a process (one page-locking, one set of resident pages); `close` releases a client's share."""

    _shared: dict = {}  # (path, size) -> [reader, users]
    _shared_lock = threading.Lock()

    @classmethod
    def open(cls, path: str, size: int) -> SlabReader:
        with cls._shared_lock:
            entry = cls._shared.get((path, size))
            if entry is None:
                entry = cls._shared[(path, size)] = [cls(path, size), 0]
            entry[1] += 1
            return entry[0]

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.size = size
        fd = os.open(path, os.O_RDONLY)
        try:
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._view = memoryview(self._mm)
        self._locked_at = page_lock(self._mm, read_only=True)

    @property
    def page_locked(self) -> bool:
        return self._locked_at is not None

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self._view[offset : offset + nbytes]

    def close(self) -> None:
        with self._shared_lock:
            entry = self._shared.get((self.path, self.size))
            if entry is not None and entry[0] is self:
                entry[1] -= 1
                if entry[1] > 0:
                    return  # other clients of this process still read through it
                del self._shared[(self.path, self.size)]
        page_unlock(self._locked_at)
        self._locked_at = None
        self._view.release()
        try:
            self._mm.close()
        except BufferError:
            pass
