"""Typed handles in front of KVNodes: the caller's side of the KVNode actor's wire messages (`actor.KVNodeActor`
is the node's side). Never imports the node.

    NodeHandle(actor, node_id)    a KVNode actor, through Ray. Calls return a `Pending` (the request is on its way;
                                  `result(timeout)` waits for the typed reply)
    LocalHandle(node)             a `KVNode` object of this process, same interface (no Ray: unit tests, the GPU
                                  machine); its calls run at once, in the caller's thread

A handle's calls, and whether they change the node:

    hello() -> NodeHello                        reads: the node's record, incarnation and config
    pin(keys) -> Pending[Pinned]                mutates: pins the leading run of held chunks in the CPU slab
    unpin(pin_id)                               mutates; not waited for
    pull(keys) -> Pending[Pulled]               reads: the leading run of held chunks, verified, through Ray's store
    pull_through(PullThrough) -> Pending[Pinned]  mutates: pins the leading run here, first pulling from the holder
                                                the chunks not here yet (readers of this node share one transfer)
    store(items, buf) -> Pending[int]           mutates: places chunks in the tiers and registers them
    reserve_gpu(items) -> Pending[GpuReserved]  mutates: reserves GPU-tier slots for chunks a same-node writer
                                                copies in device to device (evicting down the cascade for room)
    commit_gpu(reservation_id, sums) -> Pending[int]   mutates: the written chunks become readable and are
                                                registered (nil sum: released); a reservation never committed is
                                                released after the node's pin TTL
    report_corrupt(keys)                        mutates: the node re-verifies the chunks and drops bad ones; not
                                                waited for
    stats() -> dict, check_integrity(...), shutdown()

Expected failures (the actor died, Ray timed out, a malformed reply) raise `NodeCallError` (a `ConnectionError`)
or `TimeoutError` from `result`; callers of the data plane turn them into shorter reads, never into exceptions for
their own callers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgpack
import numpy as np

from kvmesh.config import KVMeshConfig
from kvmesh.wire import (
    GpuReserved,
    NodeInfo,
    PinnedChunk,
    PullThrough,
    StoreItem,
    WireError,
    pack_gpu_commit,
    pack_gpu_reserve,
    pack_keys,
    pack_pull_through,
    pack_store,
    unpack_chunk_header,
    unpack_gpu_reserved,
    unpack_pin_reply,
)

NAMESPACE = "kvmesh"
ACTOR_PREFIX = "kvnode-"
T = TypeVar("T")


def actor_name(node_id: str) -> str:
    return f"{ACTOR_PREFIX}{node_id}"


class NodeCallError(ConnectionError):
    """A call to a KVNode did not get an answer: its actor is gone, or its reply was malformed."""


class NodeUnavailable(NodeCallError):
    """Ray could not reach the KVNode's process for now (`ActorUnavailableError`: it is restarting, or its
    connection was refused for a moment); the call may not have run, and a later one may be answered."""


@dataclass(frozen=True, slots=True)
class NodeHello:
    info: NodeInfo
    config: KVMeshConfig
    gpu_exports: tuple[bytes, ...] = ()  # the GPU tier's pools (tiers.gpu_ipc.PoolExport, packed), for CUDA IPC

    def pack(self) -> bytes:
        return msgpack.packb(
            [1, self.info.pack(), self.info.incarnation, self.config.to_dict(), list(self.gpu_exports)],
            use_bin_type=True,
        )

    @classmethod
    def unpack(cls, data: bytes) -> NodeHello:
        o = msgpack.unpackb(data, raw=False)
        _v, info, inc, cfg = o[:4]
        exports = tuple(e for e in o[4] if isinstance(e, bytes)) if len(o) > 4 and isinstance(o[4], list) else ()
        return cls(NodeInfo.unpack(info, inc), KVMeshConfig.from_dict(cfg), exports)


@dataclass(frozen=True, slots=True)
class Pinned:
    """The leading run of the chunks asked for that the node holds, pinned in its CPU slab until `unpin(pin_id)`
    (or the node's pin TTL). `chunks[i]` is the i-th key asked for."""

    pin_id: int
    chunks: list[PinnedChunk]  # in the CPU slab, for the keys after the GPU-tier ones
    slab_path: str  # the slab the slots index (a restarted node has a new one)
    gpu: Sequence[PinnedChunk] = ()  # the leading keys pinned in the GPU tier (asked with gpu=True); checksum = the
    # device checksum recorded when the chunk was placed (tiers.devsum)


@dataclass(frozen=True, slots=True)
class Pulled:
    """The leading run of the chunks asked for, verified by the holder: (nbytes, checksum) per chunk, and their
    bytes back to back in `data`."""

    rows: list[tuple[int, int]]
    data: np.ndarray


# -- pending replies ---------------------------------------------------------------------------------------------
class Pending(Generic[T]):
    """A reply on its way. `result(timeout)` waits for it (raises `NodeCallError` or `TimeoutError`); `abandon`
    says the caller stopped waiting: `cleanup(reply)` then runs if the reply still arrives (e.g. to unpin)."""

    def result(self, timeout: float | None) -> T:
        raise NotImplementedError

    def abandon(self, cleanup: Callable[[T], None]) -> None:
        raise NotImplementedError

    def done(self) -> bool:
        """Whether the reply (or its error) is in, without waiting."""
        raise NotImplementedError


class Done(Pending[T]):
    """A reply already here (a `LocalHandle` call ran in the caller's thread), or the error it raised."""

    def __init__(self, value: T | None = None, error: Exception | None = None) -> None:
        self._value, self._error = value, error

    @classmethod
    def of(cls, fn: Callable[[], T]) -> Done[T]:
        try:
            return cls(fn())
        except (WireError, ConnectionError, TimeoutError, OSError) as e:
            return cls(error=e)

    def result(self, timeout: float | None) -> T:
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]  # (set whenever _error is None: a reply, or None for T=None)

    def abandon(self, cleanup: Callable[[T], None]) -> None:
        if self._error is None:
            cleanup(self._value)  # type: ignore[arg-type]

    def done(self) -> bool:
        return True


class _RayPending(Pending[T]):
    def __init__(self, ref, decode: Callable[[object], T], orphans: Orphans) -> None:
        self._ref, self._decode, self._orphans = ref, decode, orphans

    def result(self, timeout: float | None) -> T:
        import ray

        try:
            raw = ray.get(self._ref, timeout=None if timeout is None else max(0.0, timeout))
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError("the KVNode did not answer in time") from None
        except ray.exceptions.ActorUnavailableError as e:
            raise NodeUnavailable(f"KVNode call failed: {type(e).__name__}") from None
        except ray.exceptions.RayError as e:
            raise NodeCallError(f"KVNode call failed: {type(e).__name__}") from None
        try:
            return self._decode(raw)
        except WireError as e:
            raise NodeCallError(f"KVNode reply malformed: {e}") from None

    def abandon(self, cleanup: Callable[[T], None]) -> None:
        self._orphans.add(self._ref, lambda raw: cleanup(self._decode(raw)))

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait([self._ref], timeout=0)
        return bool(ready)


class Orphans:
    """Replies whose callers stopped waiting (a pin that came after its fetch's deadline): each is cleaned up (its
    pin released) once it arrives. `reap()` runs on every fetch and on the owner's background thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._refs: dict = {}  # ref -> cleanup

    def __len__(self) -> int:
        return len(self._refs)

    def add(self, ref, cleanup: Callable[[object], None]) -> None:
        with self._lock:
            self._refs[ref] = cleanup

    def reap(self, timeout: float = 0.0) -> int:
        """Clean up the replies that arrived (waiting up to `timeout` for all of them)."""
        with self._lock:
            if not self._refs:
                return 0
            refs = list(self._refs)
        import ray

        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for ref in ready:
            with self._lock:
                cleanup = self._refs.pop(ref, None)
            if cleanup is None:
                continue
            try:
                cleanup(ray.get(ref))
            except Exception:  # the node is gone or the reply is unreadable: nothing left to release
                pass
        return len(ready)


# -- the caller's side -------------------------------------------------------------------------------------------
def _pinned(raw) -> Pinned:
    return Pinned(*unpack_pin_reply(raw))


def _pulled(raw) -> Pulled:
    if not isinstance(raw, (tuple, list)) or len(raw) != 2:
        raise WireError("PullReply: expected (header, buffer)")
    header, data = raw
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1:
        raise WireError("PullReply: buffer must be a 1-d uint8 array")
    return Pulled(unpack_chunk_header(header), data)


def _count(raw) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise WireError("StoreReply: expected an int")
    return raw


class NodeHandle:
    """A KVNode actor through Ray."""

    def __init__(self, actor, node_id: str, requester: str = "", orphans: Orphans | None = None) -> None:
        self.actor = actor
        self.node_id = node_id
        self.requester = requester  # the caller's node id: lets the holder account its traffic
        self.orphans = orphans if orphans is not None else Orphans()

    @classmethod
    def find(cls, node_id: str, requester: str = "", orphans: Orphans | None = None) -> NodeHandle | None:
        """The KVNode of `node_id`, or None where there is none (or no Ray connection: never start one here)."""
        import ray

        if not ray.is_initialized():
            return None
        try:
            return cls(ray.get_actor(actor_name(node_id), namespace=NAMESPACE), node_id, requester, orphans)
        except ValueError:
            return None

    def _call(self, method: str, decode, *args) -> Pending:
        try:
            ref = getattr(self.actor, method).remote(*args)
        except Exception as e:  # the actor handle is dead
            return Done(error=NodeCallError(f"KVNode call failed: {e}"))
        return _RayPending(ref, decode, self.orphans)

    def hello(self, timeout: float = 30.0) -> NodeHello:
        return self._call("hello", NodeHello.unpack).result(timeout)

    def pin(self, keys: list[bytes], gpu: bool = False, hold_s: float = 0.0) -> Pending[Pinned]:
        return self._call("pin", _pinned, pack_keys(keys, self.requester, gpu, int(hold_s * 1000)))

    def unpin(self, pin_id: int) -> None:
        self._call("unpin", lambda r: r, pin_id)

    def pull(self, keys: list[bytes]) -> Pending[Pulled]:
        return self._call("pull", _pulled, pack_keys(keys, self.requester))

    def pull_through(self, request: PullThrough) -> Pending[Pinned]:
        return self._call("pull_through", _pinned, pack_pull_through(request))

    def store(self, items: list[StoreItem], data: np.ndarray) -> Pending[int]:
        return self._call("store", _count, pack_store(items), data)

    def reserve_gpu(self, items: list[StoreItem]) -> Pending[GpuReserved]:
        return self._call("reserve_gpu", unpack_gpu_reserved, pack_gpu_reserve(items, self.requester))

    def commit_gpu(self, reservation_id: int, sums: list[int | None]) -> Pending[int]:
        return self._call("commit_gpu", _count, pack_gpu_commit(reservation_id, sums))

    def report_corrupt(self, keys: list[bytes]) -> None:
        self._call("report_corrupt", lambda r: r, pack_keys(keys))

    def stats(self, timeout: float = 30.0) -> dict:
        return self._call("stats", lambda r: r).result(timeout)


class LocalHandle:
    """A `KVNode` object in this process, behind the same interface as `NodeHandle`."""

    def __init__(self, node, requester: str = "") -> None:
        self.node = node
        self.node_id = node.node_id
        self.requester = requester
        self.orphans = None

    def _live(self):
        if getattr(self.node, "closed", False):  # as a dead actor's handle would
            raise NodeCallError(f"KVNode {self.node_id[:8]} is shut down")
        return self.node

    def hello(self, timeout: float = 30.0) -> NodeHello:
        return self._live().hello()

    def pin(self, keys: list[bytes], gpu: bool = False, hold_s: float = 0.0) -> Pending[Pinned]:
        return Done.of(lambda: self._live().pin(keys, self.requester, gpu, hold_s))

    def unpin(self, pin_id: int) -> None:
        if not getattr(self.node, "closed", False):
            self.node.unpin(pin_id)

    def pull(self, keys: list[bytes]) -> Pending[Pulled]:
        return Done.of(lambda: self._live().pull(keys, self.requester))

    def pull_through(self, request: PullThrough) -> Pending[Pinned]:
        return Done.of(lambda: self._live().pull_through(request))

    def store(self, items: list[StoreItem], data: np.ndarray) -> Pending[int]:
        return Done.of(lambda: self._live().store(items, data))

    def reserve_gpu(self, items: list[StoreItem]) -> Pending[GpuReserved]:
        return Done.of(lambda: self._live().reserve_gpu(items, self.requester))

    def commit_gpu(self, reservation_id: int, sums: list[int | None]) -> Pending[int]:
        return Done.of(lambda: self._live().commit_gpu(reservation_id, sums))

    def report_corrupt(self, keys: list[bytes]) -> None:
        if not getattr(self.node, "closed", False):
            self.node.report_corrupt(keys)

    def stats(self, timeout: float = 30.0) -> dict:
        return self._live().stats()
