"""`Fetches`: a client's fetches in flight. It owns the threads and connections a fetch runs on (peer receives,
checksum threads, the `DataClient`), the `Fetcher` over the client's `LocalAttachment`, the deadlines of the
fetches running now (`close` waits for them, by their deadlines, before the threads go) and the device loads not
released yet (`close` releases them: their slab chunks would stay pinned till the pins' TTL otherwise)."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from kvmesh.attachment import LocalAttachment
from kvmesh.config import KVMeshConfig
from kvmesh.dataplane.fetcher import Fetcher, FetchOptions
from kvmesh.dataplane.sinks import DeviceSink, Sink
from kvmesh.dataplane.sources import Env
from kvmesh.match import FetchStats, Match
from kvmesh.nodeview import NodeView
from kvmesh.spec import KVSpec
from kvmesh.transport import DataClient

log = logging.getLogger("kvmesh.client")
PULL_THREADS = 8  # concurrent peer receives of one client (runs from different holders, batches of one)
CLOSE_WAIT_S = 5.0  # close() waits at most this long for the fetches in flight to end


class Fetches:
    def __init__(
        self, spec: KVSpec, config: KVMeshConfig, attachment: LocalAttachment, view: NodeView, closed: threading.Event
    ) -> None:
        self.spec, self.config, self._closed = spec, config, closed
        self.pool = ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="kvmesh-pull")
        self.verify_pool = ThreadPoolExecutor(4, thread_name_prefix="kvmesh-verify")
        self.data = DataClient()
        env = Env.of(attachment.node_id or "", attachment, view, self.data, self.pool, self.verify_pool)
        self.fetcher = Fetcher(env)
        self._running = threading.Condition()  # guards `_deadlines` and `_loads`
        self._deadlines: dict[object, float] = {}  # deadlines of the fetches in flight, by token
        self._loads: list[weakref.ref] = []  # fetch_to_device's loads, released by close() unless they were
        self._scratch: torch.Tensor | None = None

    def scratch(self, num_tokens: int) -> torch.Tensor:
        """(`KVMeshClient.scratch`.) Grown to twice its size at least, so that a growing prompt reallocates rarely."""
        buf = self._scratch
        if buf is None or buf.shape[2] < num_tokens:
            grown = max(num_tokens, 2 * buf.shape[2] if buf is not None else 0)
            buf = self._scratch = torch.zeros(self.spec.kv_shape(grown), dtype=self.spec.torch_dtype)
        return buf  # shape[2] >= num_tokens; fetch fills the front

    def options(self, match: Match, deadline_s: float | None) -> FetchOptions:
        c = self.config
        return FetchOptions(
            self.spec.chunk_bytes,
            time.monotonic() + (deadline_s or c.fetch_timeout_s),
            c.peer_transport,
            c.coalesce_pulls,
            match.group or (match.chunks[0].hash if match.start == 0 and match.chunks else b""),
            max(1, c.pull_batch_bytes // self.spec.chunk_bytes),
        )

    def device_sink(self, device: torch.device, min_copy_bytes: int = 8 << 20) -> DeviceSink:
        return DeviceSink(self.spec, device, self.verify_pool, min_copy_bytes)

    def verified_tensor(self, load, n: int, device: torch.device) -> torch.Tensor:
        """A `fetch` to a device: the leading `n` chunks of `load` that passed their checks, as one KV tensor."""
        s = self.spec
        if load is None:
            return torch.empty(s.kv_shape(0), dtype=s.torch_dtype, device=device)
        load.synchronize()
        n = min(n, load.first_unverified())
        result = load.staging[:n].permute(1, 2, 0, 3, 4, 5).reshape(s.kv_shape(n * s.chunk_tokens))
        load.release()
        return result

    def run(self, match: Match, sink: Sink, opts: FetchOptions) -> tuple[object, FetchStats]:
        """`match`'s chunks into `sink`: (the sink's result, what happened). A closed client refuses."""
        token = object()
        with self._running:
            if self._closed.is_set():
                raise ValueError("fetch on a closed KVMeshClient")
            self._deadlines[token] = opts.deadline
        try:
            return self.fetcher.fetch(match.chunks, sink, opts)
        except RuntimeError as e:  # a close() that gave up waiting shut the pools down under this fetch
            if self._closed.is_set():
                raise ValueError("KVMeshClient closed while this fetch ran") from e
            raise
        finally:
            with self._running:
                del self._deadlines[token]
                self._running.notify_all()

    def keep(self, load) -> None:
        """A device load handed to the caller: released by `close` unless the caller did."""
        if load is not None and load.on_release:
            with self._running:
                self._loads = [r for r in self._loads if (held := r()) is not None and held.on_release]
                self._loads.append(weakref.ref(load))

    def close_and_wait(self) -> None:
        """Sets `closed` (no fetch begins after it), then waits for the fetches in flight to end (by their
        deadlines, CLOSE_WAIT_S at most): their threads and slab stay until then; one still waiting on a peer after
        it ends short. Then releases the loads to a device never released."""
        with self._running:
            self._closed.set()
            until = min(max(self._deadlines.values(), default=0.0) + 1.0, time.monotonic() + CLOSE_WAIT_S)
            while self._deadlines and (left := until - time.monotonic()) > 0:
                self._running.wait(left)
        for ref in self._loads:
            load = ref()
            if load is None:
                continue
            try:
                load.release()
            except Exception as e:  # (a device error: the pins still lapse at their TTL)
                log.warning("kvmesh client: releasing a load at close failed: %s", e)

    def close(self) -> None:
        self.data.close()
        self.pool.shutdown(wait=False)
        self.verify_pool.shutdown(wait=False)
