"""Transfers: one run of chunks (`planner.Run`) on its way into a sink, as a `sources.Source` began it.

    Transfer.complete(deadline) -> Landed       phase 2: land the run's chunks in the sink and verify each; stops
                                                at the first chunk that is missing, late or corrupt
    Transfer.release()                          always, whatever happened (idempotent): unpins, or stops a
                                                transfer still running and waits until it no longer writes
                                                into the sink

A chunk that fails its checksum is reported to the node that holds the bad copy, with the rest of its run: the node
re-verifies each and drops the bad ones. (Reported alone, the bad chunks after it stayed listed, so a writer that
skips what is listed repaired one chunk per request: a prompt whose chunks were all damaged took as many requests
as it has chunks to be served again.)
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.dataplane.planner import Run
from kvmesh.handle import NodeCallError, Pending, Pinned
from kvmesh.tiers import checksum
from kvmesh.transport import ChecksumError
from kvmesh.wire import WireError

if TYPE_CHECKING:
    from kvmesh.dataplane.sources import Env

WAIT_SLACK_S = 1.0  # past the deadline: how long a release waits for a receiving thread to let go of the sink


@dataclass(frozen=True, slots=True)
class Landed:
    delivered: int  # leading chunks of the run that are in the sink, verified
    error: str = ""  # why it stopped short: "not_held", "checksum", "deadline", "peer_error", "holder_unknown",
    # "stale_slab"; "" when it did not
    corrupt: bool = False  # it stopped at a chunk that failed its checksum
    device: int = 0  # of the delivered chunks, those read device to device from the node's GPU tier
    adopted: int = 0  # of the delivered chunks, slab slots the sink reads in place (no host copy)


def _check(pool: Executor | None, view) -> Future:
    """The checksum of `view`, on `pool`'s threads (inline where there is none)."""
    if pool is not None:
        return pool.submit(checksum, view)
    done: Future = Future()
    done.set_result(checksum(view))
    return done


def _error_of(e: BaseException) -> str:
    return "deadline" if isinstance(e, TimeoutError) else "peer_error"


class Transfer:
    kind = ""
    # for the cost model (fetcher._timing): when the reply came, if `complete` waited for it (None: it was in
    # before, or the transfer has no reply); TCP: when its pool thread began, and when it had received all
    reply_at: float | None = None
    started_at: float | None = None
    ready_at: float | None = None

    def __init__(self, run: Run, sink) -> None:
        self.run, self.sink = run, sink

    def complete(self, deadline: float) -> Landed:
        raise NotImplementedError

    def release(self) -> None:
        pass


class Failed(Transfer):
    """A run whose request could not even go out (no such holder, no address)."""

    def __init__(self, run: Run, sink, kind: str, error: str) -> None:
        super().__init__(run, sink)
        self.kind, self._error = kind, error

    def complete(self, deadline: float) -> Landed:
        return Landed(0, self._error)


class PinnedTransfer(Transfer):
    """`slab` and `via`: the local KVNode answers with pinned slab slots; the chunks are read from the slab here."""

    def __init__(
        self, env: Env, run: Run, sink, chunk_bytes: int, kind: str, pending: Pending[Pinned], copy: bool = False
    ) -> None:
        super().__init__(run, sink)
        self.env, self.kind, self._pending, self._cb = env, kind, pending, chunk_bytes
        self._copy = copy  # copied into the sink, never adopted: unpinned as soon as it is released
        assert env.local is not None, "slab and via runs go through this node's KVNode"
        self._local = env.local
        self._pinned: Pinned | None = None
        self._waited = False
        self._adopted = False
        self._released = False

    def complete(self, deadline: float) -> Landed:
        env, run, sink, local = self.env, self.run, self.sink, self._local
        self._waited = True
        was_in = self._pending.done()
        try:
            self._pinned = p = self._pending.result(deadline - time.monotonic())
        except (NodeCallError, TimeoutError, WireError) as e:
            self._waited = False  # the reply may still come: its pin is released when it does
            return Landed(0, _error_of(e))
        if not was_in:
            self.reply_at = time.monotonic()
        if env.slab is None or p.slab_path != env.slab.path:
            env.attached.stale_slab()
            return Landed(0, "stale_slab")
        cb = self._cb
        g = len(p.gpu)  # the leading chunks pinned in the GPU tier: read device to device
        for j, row in enumerate(p.gpu):
            if row.nbytes != cb:
                return Landed(j, "not_held")
            gpu = env.gpu  # (another fetch may have dropped it meanwhile)
            if gpu is None:
                return Landed(j, "gpu_unreachable")
            try:
                src = gpu.view(row.slot, cb)
            except Exception:  # the pool cannot be read any more (GpuIpcError): the rest comes next time
                env.attached.drop_gpu(gpu)
                return Landed(j, "gpu_unreachable")
            key = run.keys[j]
            sink.adopt_device(run.start + j, src, row.checksum, lambda k=key: local.report_corrupt([k]))
            self._adopted = True
        checks: list = []  # (j, key, checksum wanted, its check) of the chunks copied so far, in order
        adopted = 0
        try:
            for j0, row in enumerate(p.chunks):
                j = g + j0
                if row.nbytes != cb:
                    return self._settle(checks, Landed(j, "not_held", device=g, adopted=adopted))
                i = run.start + j
                view = env.slab.view(row.slot * env.slot_bytes, cb)
                key = run.keys[j]
                if not self._copy and sink.adopt(
                    i, view, row.checksum, lambda k=key: local.report_corrupt([k]), row.devsum
                ):
                    self._adopted = True
                    adopted += 1
                    continue
                sink.put(i, view)
                # checked after the copy (catches a slot overwritten under us, too), on the verify threads while
                # the next chunks are copied; committed in order once its check is in (`_settle`)
                checks.append((j, key, row.checksum, _check(env.verify, view)))
            n = g + len(p.chunks)
            return self._settle(checks, Landed(n, "" if n == len(run.keys) else "not_held", device=g, adopted=adopted))
        finally:
            wait([c[3] for c in checks])  # no check reads the slab once the run is released (unpinned)

    def _settle(self, checks: list, landed: Landed) -> Landed:
        """`landed`, once the checks of the chunks copied before it ended are in: the first chunk that failed its
        checksum ends the run there instead (and is reported to the node); those before it are committed."""
        for j, _key, want, check in checks:
            if check.result() != want:
                self._local.report_corrupt(list(self.run.keys[j:]))  # (with the rest: see the module docstring)
                return Landed(j, "checksum", corrupt=True, device=landed.device, adopted=landed.adopted)
            self.sink.commit(self.run.start + j, want)
        return landed

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        local = self._local

        def unpin(p: Pinned) -> None:
            if p.chunks or p.gpu:
                local.unpin(p.pin_id)

        if not self._waited:  # never waited for (a run after the fetch was cut short), or it timed out
            if self._pending.done():
                try:
                    unpin(self._pending.result(0))
                except (NodeCallError, TimeoutError, WireError):
                    pass
            else:  # unpin whenever the reply arrives
                self._pending.abandon(unpin)
        elif self._pinned is not None and (self._pinned.chunks or self._pinned.gpu):
            if self._adopted:  # the sink still reads the slots: unpin when it lets go
                self.sink.on_release(lambda p=self._pinned: unpin(p))
            else:
                unpin(self._pinned)


class TcpTransfer(Transfer):
    """`tcp`: received on a pool thread straight into the sink's segments, each chunk checked as it arrives."""

    kind = "tcp"

    def __init__(self, env: Env, run: Run, sink, chunk_bytes: int, address: str, deadline: float) -> None:
        super().__init__(run, sink)
        self.env = env
        self._cancel = threading.Event()
        self._sums: list[int] = []
        self._future: Future = env.pool.submit(
            self._pull,
            address,
            list(run.keys),
            chunk_bytes,
            lambda j: sink.segments(run.start + j),
            deadline,
            env.here,
            self._sums,
            self._cancel,
        )
        self._future.add_done_callback(self._ready)

    def _pull(self, *args):
        self.started_at = time.monotonic()  # (not when submitted: it may have waited for a pool thread)
        return self.env.data.pull(*args)

    def _ready(self, _f: Future) -> None:
        self.ready_at = time.monotonic()

    def complete(self, deadline: float) -> Landed:
        run = self.run
        try:
            k, err = self._future.result(timeout=max(0.0, deadline - time.monotonic()) + WAIT_SLACK_S)
        except TimeoutError:
            self._cancel.set()
            return Landed(0, "deadline")
        for j in range(k):
            self.sink.commit(run.start + j, self._sums[j])
        if err is None:
            return Landed(k, "" if k == len(run.keys) else "not_held")
        if isinstance(err, ChecksumError):
            holder = self.env.attached.peer(run.holder)
            if holder is not None:
                holder.report_corrupt(list(run.keys[k:]))
            return Landed(k, "checksum", corrupt=True)
        return Landed(k, _error_of(err))

    def release(self) -> None:
        self._cancel.set()
        try:  # it writes into the sink's memory until it returns: never leave it running behind the caller
            self._future.result(timeout=WAIT_SLACK_S + 5.0)
        except Exception:
            pass


class RayTransfer(Transfer):
    """`ray`: the holder's actor sends the run through Ray's object store; each chunk is checked, then copied."""

    kind = "ray"

    def __init__(self, env: Env, run: Run, sink, chunk_bytes: int, holder) -> None:
        super().__init__(run, sink)
        self.env, self._holder, self._cb = env, holder, chunk_bytes
        self._pending = holder.pull(list(run.keys))

    def complete(self, deadline: float) -> Landed:
        run, cb = self.run, self._cb
        was_in = self._pending.done()
        try:
            p = self._pending.result(deadline - time.monotonic())
        except (NodeCallError, TimeoutError, WireError) as e:
            return Landed(0, _error_of(e))
        if not was_in:
            self.reply_at = time.monotonic()
        off = 0
        for j, (nbytes, want) in enumerate(p.rows[: len(run.keys)]):
            if nbytes != cb or off + nbytes > p.data.size:
                return Landed(j, "peer_error")
            piece = p.data[off : off + nbytes]
            if checksum(piece) != want:  # damaged on the way (the holder checked before sending)
                self._holder.report_corrupt(list(run.keys[j:]))
                return Landed(j, "checksum", corrupt=True)
            self.sink.put(run.start + j, piece)
            self.sink.commit(run.start + j, want)
            off += nbytes
        n = min(len(p.rows), len(run.keys))
        return Landed(n, "" if n == len(run.keys) else "not_held")
