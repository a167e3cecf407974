"""Disk tier: the slots of a `SlotPool` in one preallocated file on a local disk, each with a commit record.

File layout (written down once; a new layout bumps FORMAT):

    slot i at offset i * (HEADER + stride), stride = slot_bytes rounded up to 4 KiB
    [ header, 4 KiB ][ chunk bytes, padded to 4 KiB ]

    header = "KVMDISK1" | u32 format | u32 reserved | u64 nbytes | u64 checksum | u64 sequence
             | 16 B key | 16 B group | 16 B namespace | u64 header checksum (XXH3 of the 96 bytes before it)

A chunk is visible only once its header is written, and the header is written last: an overwrite first zeroes
the old header, then writes the bytes, then the new header. A process killed at any point leaves either a valid
header whose bytes match it, or no header; and every read checks the chunk's checksum anyway, so a torn chunk is
never served. Big sequential writes and reads, with O_DIRECT where the file system supports it (it keeps KV out
of the page cache, which would otherwise double-buffer the CPU tier), else plain I/O plus posix_fadvise.

All I/O methods block. Writes run on the KVNode's I/O threads; reads (`read_verified`) run on this tier's own
reader threads, a few in flight at once, each chunk checksummed by the thread that read it as soon as its bytes
are in, so the checksums of some chunks overlap the reads of others and the device is never idle between them.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import xxhash

from kvmesh.tiers import TIER_DISK, checksum
from kvmesh.tiers.slots import SlotPool

FORMAT = 1
MAGIC = b"KVMDISK1"
HEADER = 4096
ALIGN = 4096
_HDR = struct.Struct("<8sIIQQQ16s16s16s")  # 96 bytes, then the header checksum
_HDR_CRC = struct.Struct("<Q")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class ChunkRead:
    """One chunk to read and verify (`DiskTier.read_verified`)."""

    slot: int
    nbytes: int
    checksum: int  # what its bytes must hash to
    into: object  # page-aligned memory of at least align(nbytes) bytes (a CPU slab slot), owned by the caller


READ_OK, READ_CORRUPT, READ_FAILED = "ok", "corrupt", "failed"  # `read_verified`'s outcome per chunk


@dataclass(frozen=True, slots=True)
class Recovered:
    slot: int
    key: bytes
    group: bytes
    nbytes: int
    checksum: int
    sequence: int


class DiskTier(SlotPool):
    tier_id = TIER_DISK

    def __init__(
        self,
        directory: str,
        num_slots: int,
        slot_bytes: int,
        direct_io: bool = True,
        lock_fd: int | None = None,
        read_threads: int = 4,
    ) -> None:
        super().__init__(num_slots, slot_bytes)
        if read_threads < 1:
            raise ValueError(f"read_threads must be at least 1, got {read_threads}")
        self._lock_fd = lock_fd  # the claim on `directory` (claim_directory), released by close()
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.path = os.path.join(directory, "chunks.slab")
        self.stride = _align(slot_bytes)
        size = num_slots * (HEADER + self.stride)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(self._fd).st_size != size:
            os.ftruncate(self._fd, size)  # sparse: space is used as chunks land
        self._dfd = None
        if direct_io and hasattr(os, "O_DIRECT"):
            try:
                self._dfd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
            except OSError:  # tmpfs and some others refuse O_DIRECT
                self._dfd = None
        self._sequence = 0
        self._zero = mmap.mmap(-1, HEADER)  # page-aligned, for O_DIRECT
        self.fail_writes_with: int | None = None  # fault injection for tests: writes raise OSError(this errno)
        # reads in flight at once (threads start on first use); owned by this tier, stopped by close(). Several
        # 4 MiB reads queued at once kept a virtio disk busier than one (bench/disk.py: 4 beat 1 and 2 there)
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix="kvmesh-disk-read")
        # I/O calls using the file descriptors now: close() waits for them, and none starts after it (a write that
        # went on past close() wrote with fd numbers the process had reused, into whatever file took them)
        self._using = 0
        self._using_cv = threading.Condition()
        self._closed = False

    @property
    def direct_io(self) -> bool:
        return self._dfd is not None

    def _offset(self, slot: int) -> int:
        return slot * (HEADER + self.stride)

    def data_offset(self, slot: int) -> int:
        """Where a slot's chunk bytes start in the file (after its header)."""
        return self._offset(slot) + HEADER

    # -- SlotPool memory hooks ----------------------------------------------------------------------------------
    def buffer(self, slot: int):  # pragma: no cover - the disk tier is written with write_chunk, not by buffer
        raise TypeError("the disk tier has no memory buffer; use write_chunk/read_chunk")

    def checksum_of(self, slot: int) -> int:
        rec = self._slots[slot]
        return checksum(self.read_chunk(slot, rec.nbytes))

    # -- I/O ----------------------------------------------------------------------------------------------------
    def write_chunk(
        self, slot: int, data, nbytes: int, key: bytes, group: bytes, chunk_checksum: int, namespace: bytes = b"\0" * 16
    ) -> None:
        """Write a chunk and its commit record. `data` must be page-aligned memory of at least
        align(nbytes) bytes for O_DIRECT (CPU slab slots and `aligned_buffer()` are). Raises OSError."""
        if self.fail_writes_with is not None:
            raise OSError(self.fail_writes_with, os.strerror(self.fail_writes_with))
        with self._use():
            self._write_chunk(slot, data, nbytes, key, group, chunk_checksum, namespace)
        self._backed[slot] = 1  # its blocks are allocated now (the file is sparse): see SlotPool.park_unbacked

    def _write_chunk(self, slot, data, nbytes, key, group, chunk_checksum, namespace) -> None:
        off = self._offset(slot)
        self._sequence += 1
        hdr = bytearray(HEADER)
        body = _HDR.pack(MAGIC, FORMAT, 0, nbytes, chunk_checksum, self._sequence, key, group, namespace)
        hdr[: len(body)] = body
        hdr[len(body) : len(body) + 8] = _HDR_CRC.pack(xxhash.xxh3_64_intdigest(body))
        length = _align(nbytes)
        direct = self._dfd is not None and _is_aligned(data) and len(memoryview(data)) >= length
        fd = self._dfd if direct and self._dfd is not None else self._fd
        self._pwrite_all(fd, memoryview(self._zero) if direct else bytes(HEADER), off)  # invalidate first
        self._pwrite_all(fd, memoryview(data)[: length if direct else nbytes], off + HEADER)
        if direct:
            hbuf = mmap.mmap(-1, HEADER)
            hbuf[:] = bytes(hdr)
            self._pwrite_all(fd, memoryview(hbuf), off)
            hbuf.close()
        else:
            self._pwrite_all(fd, bytes(hdr), off)
            os.posix_fadvise(fd, off, HEADER + length, os.POSIX_FADV_DONTNEED)  # (fd: close() may have cleared _fd)

    def read_chunk(self, slot: int, nbytes: int, into=None):
        """The chunk's bytes (into `into`, page-aligned for O_DIRECT, when given). Raises OSError."""
        with self._use():
            return self._read_chunk(slot, nbytes, into)

    def _read_chunk(self, slot: int, nbytes: int, into):
        off = self._offset(slot) + HEADER
        length = _align(nbytes)
        if into is None:
            into = aligned_buffer(length)
        view = memoryview(into)
        direct = self._dfd is not None and _is_aligned(into) and len(view) >= length
        fd = self._dfd if direct and self._dfd is not None else self._fd
        want = length if direct else nbytes
        got = 0
        while got < want:
            k = os.preadv(fd, [view[got:want]], off + got)
            if k <= 0:
                raise OSError(errno.EIO, "short read from the disk tier")
            got += k
        return view[:nbytes]

    def read_verified(self, reads: Sequence[ChunkRead]) -> list[str]:
        """Read each chunk into its `into` and check it against its checksum: per chunk READ_OK, READ_CORRUPT
        (its bytes do not match: the caller drops it) or READ_FAILED, a colon and the errno's name (an I/O error,
        e.g. "failed:EIO"). The reads run on this tier's reader threads, several in flight; this call blocks until
        every one is done, so no thread writes into an `into` after it returns. Call it without the node's lock.
        Changes nothing in the tier."""
        futures = []
        try:
            for r in reads:
                futures.append(self._readers.submit(self._read_one, r))
        except RuntimeError:  # closed (its reader threads stopped): no further read can run
            pass
        done = [f.result() for f in futures]  # (those submitted before: none writes into its `into` past return)
        return done + [f"{READ_FAILED}:EBADF"] * (len(reads) - len(done))

    def _read_one(self, r: ChunkRead) -> str:
        try:
            view = self.read_chunk(r.slot, r.nbytes, into=r.into)
        except OSError as e:
            return f"{READ_FAILED}:{errno.errorcode.get(e.errno or 0, 'EIO')}"
        return READ_OK if checksum(view) == r.checksum else READ_CORRUPT

    @staticmethod
    def _pwrite_all(fd: int, data, off: int) -> None:
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], off + done)

    def recover(self) -> list[Recovered]:
        """Read every slot's commit record; the valid ones, newest write first per key. Bytes are not checked
        here (see `verify`)."""
        found: dict[bytes, Recovered] = {}
        for slot in range(self.num_slots):
            raw = os.pread(self._fd, _HDR.size + 8, self._offset(slot))
            if len(raw) < _HDR.size + 8 or raw[:8] != MAGIC:
                continue
            body = raw[: _HDR.size]
            if _HDR_CRC.unpack(raw[_HDR.size :])[0] != xxhash.xxh3_64_intdigest(body):
                continue
            _m, fmt, _r, nbytes, csum, seq, key, group, _ns = _HDR.unpack(body)
            if fmt != FORMAT or not 0 < nbytes <= self.slot_bytes:
                continue
            rec = Recovered(slot, key, group, nbytes, csum, seq)
            if key not in found or found[key].sequence < seq:
                found[key] = rec
            self._sequence = max(self._sequence, seq)
        return sorted(found.values(), key=lambda r: -r.sequence)

    def invalidate(self, slot: int) -> None:
        """Erase a slot's commit record (a chunk that failed its checksum). Raises OSError."""
        if self.fail_writes_with is not None:
            raise OSError(self.fail_writes_with, os.strerror(self.fail_writes_with))
        with self._use():
            self._pwrite_all(self._fd, bytes(HEADER), self._offset(slot))

    @contextmanager
    def _use(self):
        """Around one I/O call on the file descriptors; OSError(EBADF) once the tier is closed."""
        with self._using_cv:
            if self._closed:
                raise OSError(errno.EBADF, "the disk tier is closed")
            self._using += 1
        try:
            yield
        finally:
            with self._using_cv:
                self._using -= 1
                self._using_cv.notify_all()

    def close(self, wait_s: float = 30.0) -> None:
        """Waits (up to `wait_s`) for the reads and writes in flight on other threads; where one is still going
        on then (a hung disk), its file descriptors are left open rather than handed back for reuse under it."""
        with self._using_cv:
            self._closed = True  # no I/O call starts past this (EBADF)
        self._readers.shutdown(wait=False)  # (a read in flight is counted in `_using`: waited for below, bounded)
        with self._using_cv:
            idle = self._using_cv.wait_for(lambda: self._using == 0, timeout=wait_s)
        # where one is still going on, the directory's claim stays too: a next tier of this process must not take
        # the directory (and recover it) while that write may still land in it
        for fd in (self._dfd, self._fd, self._lock_fd) if idle else ():
            if fd is not None and fd >= 0:
                os.close(fd)
        self._dfd = self._lock_fd = None
        self._fd = -1  # closed: a read or write past close() fails (EBADF)
        if idle and not self._zero.closed:
            try:
                self._zero.close()
            except BufferError:  # a view of it outlives a failed write (its exception's traceback, kept by a log
                pass  # handler): unmapped once that goes; a shutdown must not stop here


def claim_directory(root: str, node_id: str) -> tuple[str, int]:
    """A directory of `root` for one KVNode's disk tier, locked (flock) for as long as the returned fd is open.

    Disk tiers are not tied to a Ray node id, which changes whenever a raylet or machine restarts: a KVNode takes
    the directory its node had before if it is free, else any free directory that holds chunks (a new raylet on the
    same machine adopts what an earlier one left: every chunk is verified and content-addressed, so any KVNode can
    serve it), else a new one. Two live KVNodes never share one, even on one machine (a local multi-node cluster)."""
    import fcntl

    os.makedirs(root, exist_ok=True)
    names = sorted(n for n in os.listdir(root) if n.startswith("kvmesh-disk-"))

    def owner(name: str) -> str:
        try:
            with open(os.path.join(root, name, "owner")) as f:
                return f.read().strip()
        except OSError:
            return ""

    names.sort(key=lambda n: (owner(n) != node_id, not os.path.exists(os.path.join(root, n, "chunks.slab"))))
    fresh = [n for n in (f"kvmesh-disk-{i:03d}" for i in range(len(names) + 64)) if n not in names]
    for name in names + fresh:
        path = os.path.join(root, name)
        os.makedirs(path, exist_ok=True)
        fd = os.open(os.path.join(path, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live KVNode has it
            os.close(fd)
            continue
        with open(os.path.join(path, "owner"), "w") as f:
            f.write(node_id)
        return path, fd
    raise OSError(errno.EAGAIN, f"no free disk tier directory under {root}")


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned memory for O_DIRECT I/O."""
    return mmap.mmap(-1, _align(max(nbytes, 1)))


def _is_aligned(buf) -> bool:
    import numpy as np

    try:
        return np.frombuffer(buf, dtype=np.uint8).ctypes.data % ALIGN == 0
    except (TypeError, ValueError):
        return False
