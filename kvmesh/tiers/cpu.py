"""CPU tier: the slots of a `SlotPool` in one shared-memory slab.

The slab is a file under /dev/shm mapped by the owning KVNode (read-write) and by every worker on the node
(`SlabReader`, read-only), so a local hit is read at memory bandwidth without the bytes passing through an actor
call. Where CUDA is available the mapping is page-locked, so copies to and from the GPU run at bus speed.
"""

from __future__ import annotations

import mmap
import os
import threading

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


class CpuTier(SlotPool):
    tier_id = TIER_CPU

    def __init__(self, path: str, num_slots: int, slot_bytes: int) -> None:
        super().__init__(num_slots, slot_bytes)
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, num_slots * slot_bytes)
            self._mm = mmap.mmap(fd, num_slots * slot_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
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
        return self._view[off:off + self.slot_bytes]

    def chunk_view(self, slot: int) -> memoryview:
        return self.buffer(slot)[: self._slots[slot].nbytes]

    def checksum_of(self, slot: int) -> int:
        return checksum(self.chunk_view(slot))

    def close(self) -> None:
        page_unlock(self._locked_at)
        self._locked_at = None
        self._view.release()
        try:
            self._mm.close()
        except BufferError:  # a view is still exported (e.g. a reader in this process); unmapped at exit
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


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
        return self._view[offset:offset + nbytes]

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
