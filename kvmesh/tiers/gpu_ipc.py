"""CUDA IPC for the GPU tier: the KVNode exports each GPU pool once, same-node workers map it once per process and
copy chunks device to device (or peer to peer, or through page-locked host memory).

    DevicePool(nbytes, device)                 KVNode side: one cudaMalloc'ed allocation (a uint8 `tensor` over it)
      .export(node_id, incarnation, first_slot, slot_bytes) -> PoolExport      pure; raises GpuIpcError
    PoolExport.pack() -> bytes / PoolExport.unpack(bytes)   the serialisable handle (msgpack, versioned)
    export_for(exports, slot) -> PoolExport    which pool of a tier holds a slot
    PoolMapper()                               worker side, one per process: mappings cached per (incarnation, pool)
      .open(export) -> MappedPool              mutates the cache; raises GpuIpcError (typed `reason`)
      .retire(node_id, keep=None)              mutates: unmaps every pool of a node's other incarnations
      .close()                                 unmaps everything
    MappedPool.slot(slot, nbytes) -> Tensor    uint8 view of a slot's bytes, on the pool's device
    read_chunks(srcs, dsts, expected, ...) -> DeviceRead        slot views -> device buffers (async), checksums
                                                                verified on a side stream (`verified()` semantics)
    write_chunks(srcs, dsts, ...) -> DeviceWrite                device buffers -> slot views (async), with the
                                                                device checksums of what landed in the slots

(A layer-wise read of slots, `movers.to_device` with a device-checksum check, is bench/gpu_ipc_layerwise.py's
`read_to_device`: only the benchmarks use it; a client's GPU-tier hit lands through the dataplane's DeviceSink.)

Why `cudaIpcGetMemHandle`/`cudaIpcOpenMemHandle` (through ctypes on the process's own libcudart) on a pool that
this module allocates with `cudaMalloc`:
- torch's CUDA tensor sharing (`reduce_tensor`) is built for pickling between torch.multiprocessing processes: its
  handle is a tuple of Python objects (storage class, dtype, a ref-counter file and an event handle), its consumer
  must outlive a producer-side reference count, and it shares a caching-allocator *segment*, so the bytes behind a
  freed pool are reused by other tensors of the KVNode. What we send is a 64-byte handle in a msgpack struct.
- a pool from torch's allocator may not be legacy-IPC-shareable at all (`expandable_segments` allocations are
  cuMem-based) and shares its segment with other tensors; our own cudaMalloc is exactly the pool, freed only when
  the last tensor view of it is gone (no use-after-free from a view that outlives `close`).
- cuMem shareable handles (POSIX file descriptors) need the fd passed over a Unix socket (SCM_RIGHTS) next to the
  Ray/msgpack channel; legacy IPC handles are plain bytes and work wherever the processes share the GPU. They do
  not work across containers with separate IPC/PID namespaces: `open` then reports `ipc_unsupported` and the
  caller takes the host path.

Safety rules:
- A mapping is keyed by (node_id, incarnation, pool_id); pool_id is new for every allocation. A reader only reads
  slots the KVNode pinned and named in a reply of the same incarnation, so a stale mapping (an old incarnation's,
  or a closed pool's) is never the one a reply leads to. Seeing a newer incarnation of a node unmaps its old ones.
- An export from this very process cannot be opened through IPC (CUDA forbids it); `open` then returns the
  process's own live pool (looked up by pool_id among the DevicePools alive in this process).
- Every CUDA error of ours is cleared before returning (torch would otherwise trip on it at its next launch).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import torch

from kvmesh.cudart import CudaError, Cudart, IpcHandle, side_stream
from kvmesh.cudart import cudart as _cudart
from kvmesh.tiers.devsum import Coefficients, Verify, device_checksums, verify_on_side_stream

EXPORT_VERSION = 1
_IPC_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


class GpuIpcError(CudaError):
    """A GPU-tier chunk cannot be reached device to device; the caller falls back to the host path.
    `reason`: no_cuda | no_cudart | ipc_unsupported | device_not_visible | stale | closed | out_of_memory."""


def cudart() -> Cudart:
    try:
        return _cudart()
    except GpuIpcError:
        raise
    except CudaError as e:
        raise GpuIpcError(e.reason, str(e)) from None


class _Memory:
    """Device memory exposed through `__cuda_array_interface__`, so a torch tensor can alias it. torch keeps a
    reference to this object for as long as any tensor or view of the memory lives; the memory is released
    (cudaFree / cudaIpcCloseMemHandle) only then."""

    def __init__(self, rt: Cudart, ptr: int, nbytes: int, device_index: int, release: str) -> None:
        self.rt, self.ptr, self.nbytes, self.device_index, self.release = rt, ptr, nbytes, device_index, release
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
            "strides": None,
        }

    def tensor(self) -> torch.Tensor:
        t = torch.as_tensor(self, device=torch.device("cuda", self.device_index))
        assert t.data_ptr() == self.ptr and t.numel() == self.nbytes, "torch copied the device memory"
        return t

    def __del__(self) -> None:
        try:
            getattr(self.rt.lib, self.release)(ctypes.c_void_p(self.ptr))
            self.rt.lib.cudaGetLastError()
        except Exception:  # at interpreter exit the library may be gone; the driver frees it with the process
            pass


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _local_index(uuid: str) -> int | None:
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    return None


# -- the KVNode side ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolExport:
    """Everything a same-node worker needs to map one GPU pool. Wire form: msgpack list in field order, prefixed
    by EXPORT_VERSION; fields are only ever appended."""

    node_id: str
    incarnation: str  # the KVNode incarnation that owns the pool
    pool_id: bytes  # 8 random bytes, new for every allocation
    device_uuid: str  # the GPU (ordinals differ between processes with different CUDA_VISIBLE_DEVICES)
    pid: int  # the exporting process
    handle: bytes  # cudaIpcMemHandle_t (64 bytes)
    nbytes: int
    slot_bytes: int
    first_slot: int  # the tier's slot number of this pool's slot 0
    num_slots: int

    def pack(self) -> bytes:
        return msgpack.packb(
            [
                EXPORT_VERSION,
                self.node_id,
                self.incarnation,
                self.pool_id,
                self.device_uuid,
                self.pid,
                self.handle,
                self.nbytes,
                self.slot_bytes,
                self.first_slot,
                self.num_slots,
            ]
        )

    @classmethod
    def unpack(cls, data: bytes) -> PoolExport:
        try:
            row = msgpack.unpackb(data)
            if not isinstance(row, list) or len(row) < 11 or row[0] != EXPORT_VERSION:
                raise ValueError("not a version-1 PoolExport")
            e = cls(*row[1:11])
        except (ValueError, TypeError, msgpack.UnpackException) as err:
            raise ValueError(f"bad PoolExport: {err}") from None
        if (
            not isinstance(e.handle, bytes)
            or len(e.handle) != 64
            or not isinstance(e.pool_id, bytes)
            or any(not isinstance(x, int) or x < 0 for x in (e.pid, e.nbytes, e.slot_bytes, e.first_slot, e.num_slots))
            or e.num_slots * e.slot_bytes > e.nbytes
        ):
            raise ValueError("bad PoolExport: malformed fields")
        return e

    def slot_offset(self, slot: int) -> int:
        if not self.first_slot <= slot < self.first_slot + self.num_slots:
            raise ValueError(f"slot {slot} is not in this pool")
        return (slot - self.first_slot) * self.slot_bytes


def export_for(exports: Sequence[PoolExport], slot: int) -> PoolExport:
    """The export of the pool that holds tier slot `slot` (a tier has one pool per GPU)."""
    for e in exports:
        if e.first_slot <= slot < e.first_slot + e.num_slots:
            return e
    raise ValueError(f"no exported pool holds slot {slot}")


class DevicePool:
    """One cudaMalloc'ed allocation on one GPU, owned by a GpuTier. `tensor` is a uint8 view of all of it."""

    _live: weakref.WeakValueDictionary[bytes, DevicePool] = weakref.WeakValueDictionary()  # this process's

    def __init__(self, nbytes: int, device: torch.device | str) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise GpuIpcError("no_cuda", f"a DevicePool lives on a CUDA device, not {device}")
        rt = cudart()
        index = device.index if device.index is not None else torch.cuda.current_device()
        ptr = ctypes.c_void_p()
        with rt.on_device(index, GpuIpcError):
            rt.call("cudaMalloc", ctypes.byref(ptr), nbytes, reason="out_of_memory", error=GpuIpcError)
        self.device = torch.device("cuda", index)
        self.nbytes = nbytes
        self.pool_id = secrets.token_bytes(8)
        assert ptr.value, "cudaMalloc succeeded"
        self.tensor: torch.Tensor | None = _Memory(rt, ptr.value, nbytes, index, "cudaFree").tensor()
        self._handle: bytes | None = None
        DevicePool._live[self.pool_id] = self

    def export(self, node_id: str, incarnation: str, first_slot: int, slot_bytes: int) -> PoolExport:
        if self.tensor is None:
            raise GpuIpcError("closed", "the pool was closed")
        if self._handle is None:
            rt = cudart()
            h = IpcHandle()
            with rt.on_device(self.device.index, GpuIpcError):
                rt.call(
                    "cudaIpcGetMemHandle",
                    ctypes.byref(h),
                    ctypes.c_void_p(self.tensor.data_ptr()),
                    reason="ipc_unsupported",
                    error=GpuIpcError,
                )
            self._handle = h.raw()
        return PoolExport(
            node_id,
            incarnation,
            self.pool_id,
            device_uuid(self.device.index),
            os.getpid(),
            self._handle,
            self.nbytes,
            slot_bytes,
            first_slot,
            self.nbytes // slot_bytes,
        )

    def close(self) -> None:
        """Drop the pool: its memory is freed once no view of it is left (readers in this process included)."""
        DevicePool._live.pop(self.pool_id, None)
        self.tensor = None


# -- the worker side ------------------------------------------------------------------------------------------
class MappedPool:
    """A worker's mapping of one exported pool. `tensor` aliases the KVNode's memory: read only what is pinned."""

    def __init__(self, export: PoolExport, tensor: torch.Tensor) -> None:
        self.export, self.tensor, self.device = export, tensor, tensor.device

    def slot(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        off = self.export.slot_offset(slot)
        n = self.export.slot_bytes if nbytes is None else nbytes
        if not 0 < n <= self.export.slot_bytes:
            raise ValueError(f"nbytes {n} does not fit a slot of {self.export.slot_bytes}")
        return self.tensor[off : off + n]


class PoolMapper:
    """The pools a worker process has mapped. Thread-safe; one per process is enough (mappings are per process:
    CUDA refuses to open one handle twice in a process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[tuple[str, str, bytes], MappedPool] = {}
        self._latest: dict[str, str] = {}  # node_id -> newest incarnation seen
        self._gone: dict[str, set[str]] = {}  # node_id -> incarnations retired (never mapped again)
        self.coefficients = Coefficients()

    def open(self, export: PoolExport) -> MappedPool:
        key = (export.node_id, export.incarnation, export.pool_id)
        with self._lock:
            hit = self._maps.get(key)
            if hit is not None:
                return hit
            if export.incarnation in self._gone.get(export.node_id, ()):
                raise GpuIpcError("stale", f"incarnation {export.incarnation} of {export.node_id} was retired")
            mapped = self._map(export)
            self._maps[key] = mapped
        return mapped

    def _map(self, export: PoolExport) -> MappedPool:
        if not torch.cuda.is_available():
            raise GpuIpcError("no_cuda", "this process sees no CUDA device")
        if export.pid == os.getpid():
            pool = DevicePool._live.get(export.pool_id)
            if pool is None or pool.tensor is None:
                raise GpuIpcError("closed", "the pool was closed in this process")
            return MappedPool(export, pool.tensor)
        index = _local_index(export.device_uuid)
        if index is None:
            raise GpuIpcError("device_not_visible", f"GPU {export.device_uuid} is not visible to this process")
        rt = cudart()
        ptr = ctypes.c_void_p()
        handle = IpcHandle.of(export.handle)
        with rt.on_device(index, GpuIpcError):
            rt.call(
                "cudaIpcOpenMemHandle",
                ctypes.byref(ptr),
                handle,
                _IPC_LAZY_ENABLE_PEER_ACCESS,
                reason="ipc_unsupported",
                error=GpuIpcError,
            )
        assert ptr.value, "cudaIpcOpenMemHandle succeeded"
        return MappedPool(export, _Memory(rt, ptr.value, export.nbytes, index, "cudaIpcCloseMemHandle").tensor())

    def retire(self, node_id: str, keep: str | None = None) -> int:
        """Unmap every pool of `node_id` except those of incarnation `keep` (its current one), and refuse them
        from now on. Returns how many were unmapped (their memory is released once no view is left)."""
        with self._lock:
            if keep is not None:
                self._latest[node_id] = keep
            gone = [k for k in self._maps if k[0] == node_id and k[1] != keep]
            for k in gone:
                self._gone.setdefault(node_id, set()).add(k[1])
                del self._maps[k]
            return len(gone)

    def seen(self, node_id: str, incarnation: str) -> None:
        """A reply of `incarnation` came from `node_id`: a newer incarnation retires the older ones' mappings."""
        if self._latest.get(node_id) != incarnation:
            self.retire(node_id, keep=incarnation)

    def close(self) -> None:
        with self._lock:
            self._maps.clear()


# -- copies ---------------------------------------------------------------------------------------------------
def _can_peer(dst: torch.device, src: torch.device) -> bool:
    return dst == src or torch.cuda.can_device_access_peer(dst.index, src.index)


class _Bounce:
    """Page-locked host staging for copies between GPUs without peer access: chunk by chunk, D2H on the source
    GPU's stream, then H2D on the destination's, double-buffered."""

    def __init__(self, nbytes: int) -> None:
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.free: list[torch.cuda.Event | None] = [None, None]

    def copy(self, src: torch.Tensor, dst: torch.Tensor, j: int, s_src, s_dst) -> torch.cuda.Event:
        buf = self.bufs[j % 2][: src.numel()]
        if self.free[j % 2] is not None:
            s_src.wait_event(self.free[j % 2])
        with torch.cuda.stream(s_src):
            buf.copy_(src, non_blocking=True)
            down = torch.cuda.Event()
            down.record(s_src)
        s_dst.wait_event(down)
        with torch.cuda.stream(s_dst):
            dst.copy_(buf, non_blocking=True)
            up = torch.cuda.Event()
            up.record(s_dst)
        self.free[j % 2] = up
        return up


def _copy_all(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], peer: bool | None, stream):
    """Queue dst[i] <- src[i] for all i (all srcs on one device, all dsts on one device). Returns (event at the end
    on the destination side, path name, the stream used)."""
    s_dev, d_dev = srcs[0].device, dsts[0].device
    direct = _can_peer(d_dev, s_dev) if peer is None else peer
    stream = stream or side_stream(d_dev)
    stream.wait_stream(torch.cuda.current_stream(d_dev))
    if direct:
        if s_dev != d_dev:  # the source side's queued work (e.g. the KVNode's writes are its own; an engine's
            stream.wait_stream(torch.cuda.current_stream(s_dev))  # kernels that made `srcs`) comes first
        with torch.cuda.stream(stream):
            for i0, count in _adjacent_runs(srcs, dsts):
                if count == 1:
                    dsts[i0].copy_(srcs[i0], non_blocking=True)
                else:  # chunks back to back on both sides (consecutive slots, one staging buffer): one copy
                    n = srcs[i0].numel() * count
                    dsts[i0].as_strided((n,), (1,)).copy_(srcs[i0].as_strided((n,), (1,)), non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done, ("d2d" if s_dev == d_dev else "p2p"), stream
    s_stream = side_stream(s_dev)
    s_stream.wait_stream(torch.cuda.current_stream(s_dev))
    bounce = _Bounce(max(s.numel() for s in srcs))  # (srcs is not empty: the loop sets done)
    for j, (s, d) in enumerate(zip(srcs, dsts)):
        done = bounce.copy(s, d, j, s_stream, stream)
    done.synchronize()  # the bounce buffers are freed on return
    return done, "host", stream


def _adjacent_runs(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """(first, count) runs of pairs that sit back to back in both the source and the destination storage."""
    runs, i = [], 0
    while i < len(srcs):
        j = i + 1
        while (
            j < len(srcs)
            and srcs[j].untyped_storage().data_ptr() == srcs[i].untyped_storage().data_ptr()
            and dsts[j].untyped_storage().data_ptr() == dsts[i].untyped_storage().data_ptr()
            and srcs[j].data_ptr() == srcs[j - 1].data_ptr() + srcs[j - 1].numel()
            and dsts[j].data_ptr() == dsts[j - 1].data_ptr() + dsts[j - 1].numel()
            and srcs[j].numel() == srcs[i].numel()
        ):
            j += 1
        runs.append((i, j - i))
        i = j
    return runs


@dataclass
class DeviceRead:
    """Chunks on their way from GPU-tier slots into device buffers. `done` marks the copies' end (on the
    destination device); `check` verifies the device checksums on a side stream."""

    done: torch.cuda.Event | None  # None on the CPU (done already)
    check: Verify
    path: str  # "d2d" (same GPU), "p2p" (peer to peer), "host" (through page-locked host memory), "cpu"

    def wait(self) -> None:
        if self.done is not None:
            torch.cuda.current_stream(self.check.sums.device).wait_event(self.done)

    def verified(self) -> bool:
        return self.check.result()

    def good_prefix(self) -> int:
        return self.check.good_prefix()


def read_chunks(
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    expected: Sequence[int],
    *,
    peer: bool | None = None,
    stream=None,
    coefficients: Coefficients | None = None,
) -> DeviceRead:
    """dst[i] <- src[i] (uint8 views of equal size: slots of a mapped pool -> a fetch's device staging), queued on
    `stream` (default: a new side stream after the current stream's work); then the device checksums of the
    destinations, on another side stream, against `expected` (the tier's recorded sums). `peer`: None = peer to
    peer where the GPUs allow, else through host memory; False forces the host path."""
    if len(srcs) != len(dsts) or len(srcs) != len(expected):
        raise ValueError("srcs, dsts and expected must have one entry per chunk")
    for s, d in zip(srcs, dsts):
        if s.numel() != d.numel() or s.dtype != torch.uint8 or d.dtype != torch.uint8:
            raise ValueError("sources and destinations must be uint8 views of equal size")
    if not srcs:
        return DeviceRead(None, Verify(torch.zeros(0, dtype=torch.int64), []), "none")
    if not dsts[0].is_cuda or not srcs[0].is_cuda:
        for s, d in zip(srcs, dsts):
            d.copy_(s)
        return DeviceRead(None, verify_on_side_stream(list(dsts), expected, None, coefficients), "cpu")
    done, path, _ = _copy_all(srcs, dsts, peer, stream)
    return DeviceRead(done, verify_on_side_stream(list(dsts), expected, done, coefficients), path)


@dataclass
class DeviceWrite:
    """Device buffers on their way into GPU-tier slots. `sums()` (waits) are the device checksums of the bytes as
    they landed in the slots: what the KVNode records when it completes the store."""

    done: torch.cuda.Event | None
    _sums: torch.Tensor
    path: str

    def sums(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self._sums.cpu().tolist()


def write_chunks(
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    *,
    peer: bool | None = None,
    stream=None,
    coefficients: Coefficients | None = None,
) -> DeviceWrite:
    """slot[i] <- src[i] (an engine's chunk bytes -> reserved GPU-tier slots of a mapped pool), then the device
    checksums of the slots, all on the copying stream (the store completes only once both are done)."""
    if len(srcs) != len(dsts):
        raise ValueError("srcs and dsts must have one entry per chunk")
    for s, d in zip(srcs, dsts):
        if s.numel() != d.numel() or s.dtype != torch.uint8 or d.dtype != torch.uint8:
            raise ValueError("sources and destinations must be uint8 views of equal size")
    if not srcs or not dsts[0].is_cuda or not srcs[0].is_cuda:
        for s, d in zip(srcs, dsts):
            d.copy_(s)
        return DeviceWrite(None, device_checksums(list(dsts), coefficients), "cpu")
    done, path, stream = _copy_all(srcs, dsts, peer, stream)
    dev = dsts[0].device
    side = side_stream(dev)
    side.wait_event(done)
    with torch.cuda.stream(side):
        sums = device_checksums(list(dsts), coefficients)
        end = torch.cuda.Event()
        end.record(side)
    for s in srcs:
        if s.device == dev:
            s.record_stream(stream)
    return DeviceWrite(end, sums, path)
