"""ctypes bindings of the CUDA runtime that torch loaded in this process, for the few calls torch does not expose.

    cudart() -> Cudart                       the process's binding (made on first use; raises CudaError without CUDA)
    Cudart.call(name, *args, reason=, error=)   one call; a failure raises `error(reason, detail)` after clearing
                                             the runtime's last error (torch would otherwise trip on it)
    Cudart.on_device(index)                  context manager: the runtime's current device for a few calls
    memcpy_2d_async(dst, dpitch, src, spitch, width, height, stream) -> bool    one strided copy (cudaMemcpyDefault);
                                             False (and nothing queued) where the runtime cannot be bound
    side_stream(device) -> torch.cuda.Stream the next of a few side streams of the device (round robin, as torch's
                                             pool), made without waiting for the device

The binding is of the same library file torch mapped (found in /proc/self/maps), so it shares torch's runtime
state: its current device, its last-error slot, its streams.
"""

from __future__ import annotations

import ctypes
import threading

import torch

CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from the (unified) addresses


class CudaError(RuntimeError):
    """A CUDA runtime call failed, or there is no CUDA here. `reason` names the kind of failure."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail

    def __reduce__(self):  # pickled as what it was built from (Ray carries it between processes)
        return type(self), (self.reason, self.detail)


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # cudaIpcMemHandle_t (c_ubyte: NUL bytes are data here)

    def raw(self) -> bytes:
        return bytes(self.reserved)

    @classmethod
    def of(cls, raw: bytes) -> IpcHandle:
        if len(raw) != 64:
            raise ValueError("a cudaIpcMemHandle_t is 64 bytes")
        h = cls()
        ctypes.memmove(ctypes.addressof(h), raw, 64)
        return h


class Cudart:
    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise CudaError("no_cuda", "torch sees no CUDA device")
        torch.cuda.init()
        lib = None
        for path in self._candidates():
            try:
                lib = ctypes.CDLL(path)
                lib.cudaIpcOpenMemHandle  # noqa: B018  (a libcudart at all)
                break
            except (OSError, AttributeError):
                lib = None
        if lib is None:
            raise CudaError("no_cudart", "no libcudart in this process")
        self.lib = lib
        vp, sz, i32, u32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint
        for name, args in (
            ("cudaMalloc", [ctypes.POINTER(vp), sz]),
            ("cudaFree", [vp]),
            ("cudaIpcGetMemHandle", [ctypes.POINTER(IpcHandle), vp]),
            ("cudaIpcOpenMemHandle", [ctypes.POINTER(vp), IpcHandle, u32]),
            ("cudaIpcCloseMemHandle", [vp]),
            ("cudaGetDevice", [ctypes.POINTER(i32)]),
            ("cudaSetDevice", [i32]),
            ("cudaGetLastError", []),
            ("cudaMemcpy2DAsync", [vp, sz, vp, sz, sz, sz, i32, vp]),
            ("cudaStreamCreateWithFlags", [ctypes.POINTER(vp), u32]),
        ):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, i32
        lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = [i32], ctypes.c_char_p

    @staticmethod
    def _candidates() -> list[str]:
        found = []
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) >= 6 and "libcudart" in parts[-1] and parts[-1] not in found:
                        found.append(parts[-1])
        except OSError:
            pass
        return found + ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]

    def call(self, name: str, *args, reason: str = "cuda_error", error: type = CudaError) -> None:
        err = getattr(self.lib, name)(*args)
        if err != 0:
            self.lib.cudaGetLastError()
            msg = self.lib.cudaGetErrorString(err)
            raise error(reason, f"{name}: {msg.decode() if msg else err}")

    def on_device(self, index: int, error: type = CudaError):
        return _DeviceScope(self, index, error)


class _DeviceScope:
    def __init__(self, rt: Cudart, index: int, error: type) -> None:
        self.rt, self.index, self.error = rt, index, error

    def __enter__(self):
        prev = ctypes.c_int()
        self.rt.call("cudaGetDevice", ctypes.byref(prev), error=self.error)
        self.prev = prev.value
        self.rt.call("cudaSetDevice", self.index, reason="device_not_visible", error=self.error)
        return self

    def __exit__(self, *exc) -> None:
        self.rt.lib.cudaSetDevice(self.prev)


_lock = threading.Lock()
_bound: list = []  # the process's one binding of the process-wide library (no per-test state: it is stateless)


def cudart() -> Cudart:
    with _lock:
        if not _bound:
            _bound.append(Cudart())
        return _bound[0]


def memcpy_2d_async(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream) -> bool:
    """Queue `height` rows of `width` bytes, row r from src + r*spitch to dst + r*dpitch, on `stream` (a
    torch.cuda.Stream). False where the runtime cannot be bound (the caller copies row by row instead)."""
    try:
        rt = cudart()
    except CudaError:
        return False
    rt.call(
        "cudaMemcpy2DAsync",
        ctypes.c_void_p(dst),
        dpitch,
        ctypes.c_void_p(src),
        spitch,
        width,
        height,
        CUDA_MEMCPY_DEFAULT,
        ctypes.c_void_p(stream.cuda_stream),
    )
    return True


SIDE_STREAMS = 8  # per device, as a ring (torch's own pool keeps 32 and hands them out round robin)
CUDA_STREAM_NON_BLOCKING = 1  # cudaStreamNonBlocking: no implicit ordering with the legacy default stream
_side_lock = threading.Lock()
_side: dict[int, list] = {}
_turn: dict[int, int] = {}


def side_stream(device) -> torch.cuda.Stream:
    """A side stream of `device`, the next of SIDE_STREAMS made once per process and never destroyed.

    Not `torch.cuda.Stream()`: the first one a process asks for sets up torch's stream pool for the device, and that
    waits for the work already queued on the device while holding the GIL (measured on an H100: 759 ms behind a busy
    compute stream, against ~1 ms for `cudaStreamCreateWithFlags`). A client's first store or fetch in an engine
    that is prefilling would block the engine's Python for that long. Made here with the runtime's own call and
    wrapped in `torch.cuda.ExternalStream` (non-blocking, as torch's pool streams are)."""
    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    with _side_lock:
        ring = _side.setdefault(index, [])
        turn = _turn.get(index, 0)
        _turn[index] = turn + 1
        if len(ring) < SIDE_STREAMS:
            ring.append(_make_stream(index))
        return ring[turn % len(ring)]


def _make_stream(index: int) -> torch.cuda.Stream:
    try:
        rt = cudart()
        handle = ctypes.c_void_p()
        with rt.on_device(index):
            rt.call("cudaStreamCreateWithFlags", ctypes.byref(handle), CUDA_STREAM_NON_BLOCKING)
        return torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", index))
    except CudaError:  # no runtime to bind: torch's own (it may wait once, as above)
        return torch.cuda.Stream(device=torch.device("cuda", index))
