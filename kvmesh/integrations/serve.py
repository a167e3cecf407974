"""Ray Serve: send each request to the replica that gives it its first token soonest, by kvmesh's directory and
cost model (`KVMeshClient.route`), with a bounded-load guard so that one hot prefix does not flood its holder.

    router_config(spec, *, eps, ...) -> RequestRouterConfig   what a deployment passes as `request_router_config`
    KVMeshRouter                   the `ray.serve.request_router.RequestRouter`: one `route` per request (one
                                   directory round trip, off the event loop), replicas ranked by expected TTFT
    request_tokens(request) -> token ids | None   how a request carries its prompt (below)
    LoadReporter(client)           in a replica: counts its requests and the prompt tokens they will prefill and
                                   publishes them with the replica's measured prefill rate
                                   (`KVMeshClient.report_load`), which the routers' estimates read as queue wait

A request carries its prompt's token ids as the keyword argument `tokens`, or as its first positional argument (a
list or tuple of ints, or a 1-D integer numpy array or torch tensor): `handle.remote(token_ids)` or
`handle.remote(tokens=token_ids, ...)`. A request without them (an HTTP request, a text prompt) is routed by load
alone: the replica with the fewest of this router's requests in flight.

Queue wait: a replica's expected TTFT includes the wait for what is ahead of it there, the longer of what its
replica reported (`LoadReporter`) and this router's own view: the estimated prefill time of each request it sent
there and has not seen complete, less the time the replica has had to work on them since the oldest was sent. So
the estimate itself balances: a holder busy with long prefills loses to a peer that can pull the prefix.

Bounded load (consistent hashing with bounded loads, Mirrokni et al. 2018), a backstop against a flood that the
estimates misjudge (work that is not prefill, reports that lag): with `m` requests of this router in flight over
`n` candidate replicas, a replica is a candidate for the next one only while it has fewer than
max(min_cap, ceil((1 + eps) * (m + 1) / n)) in flight; among those, the order is expected TTFT (ties: fewer in
flight). The `min_cap` floor (default 4) lets the holder of a prefix take a few requests at once at light load,
where ceil((1 + eps) * (m + 1) / n) would be 1 and push every second request to a replica that must pull or
recompute. At least one replica always qualifies. Each router (each handle's process, each proxy) counts only its
own requests.

Estimates are made in the router's process, which runs no model: a replica's prefill rate is the one it measured
and reported with its load; before it has reported one, the router's `prefill_tokens_per_s` option (kvmesh.routing's
prior when unset). A directory that fails gives unknown estimates: requests are then routed by load alone until it
answers again. A router that cannot connect when Serve builds it (a directory that does not answer, refuses AUTH or
is not Redis; no KVNode on its node) logs why in one line (`kvmesh.DirectoryUnavailable`'s words: the URL with its
password redacted, and the cause), routes by load alone, and tries to connect again every `RECONNECT_S`: requests
are served meanwhile, never held by a router that does not exist.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvmesh._extras import MissingExtra
from kvmesh.hashing import client_salt
from kvmesh.spec import KVSpec

try:
    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
except ModuleNotFoundError as e:  # Ray without its serve extra (starlette, fastapi, uvicorn, ...)
    raise MissingExtra(
        f"kvmesh.integrations.serve needs Ray Serve ({e.name}): pip install 'kvmesh[serve]'", name=e.name
    ) from None

DEFAULT_EPS = 0.25
DEFAULT_MIN_CAP = 4
RECONNECT_S = 10.0  # how often a router that could not connect tries again
WORK_TTL_S = 60.0  # a routed request not seen complete by then no longer counts in its replica's queue

log = logging.getLogger("kvmesh.serve")


def router_config(
    spec: KVSpec,
    *,
    eps: float = DEFAULT_EPS,
    min_cap: int = DEFAULT_MIN_CAP,
    cache_salt: str | None = None,
    redis_url: str | None = None,
    prefill_tokens_per_s: float | None = None,
    **options,
) -> RequestRouterConfig:
    """The `request_router_config` of a deployment whose replicas are kvmesh workers of `spec`. `eps`: the
    bounded-load slack (0 = perfectly even, larger = more reuse); `min_cap`: in-flight requests any replica may
    have whatever the average; `cache_salt`: the tenant the prompts belong to; `redis_url` and `options`
    (KVMeshConfig fields): the router's `kvmesh.connect` (default: its node's KVNode's)."""
    if not isinstance(spec, KVSpec):
        raise TypeError(f"spec must be a kvmesh.KVSpec, got {type(spec).__name__}")
    _check_eps(eps)
    _check_min_cap(min_cap)
    client_salt(cache_salt)  # (the router's client's salt: refused here, not at its first connect)
    # ... and so are a prefill rate no route() takes, a URL that is no string and an option kvmesh.connect does not
    # know: in the router's process they failed every request's route, or its connect, far from this call
    rate = prefill_tokens_per_s
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf):
        raise ValueError(f"prefill_tokens_per_s must be a positive number, got {rate!r}")
    if redis_url is not None and not isinstance(redis_url, str):
        raise TypeError(f"redis_url must be a str or None, got {type(redis_url).__name__}")
    from kvmesh.config import KVMeshConfig

    unknown = sorted(set(options) - set(KVMeshConfig.__dataclass_fields__))
    if unknown:
        raise TypeError(f"unknown kvmesh option(s): {', '.join(unknown)}")
    kwargs = dict(
        spec=spec.canonical_bytes().hex(),
        eps=float(eps),
        min_cap=int(min_cap),
        cache_salt=cache_salt,
        redis_url=redis_url,
        prefill_tokens_per_s=prefill_tokens_per_s,
        options=options,
    )
    return RequestRouterConfig(request_router_class=KVMeshRouter, request_router_kwargs=kwargs)


def _check_eps(eps) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or not math.isfinite(eps):
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")


def _check_min_cap(min_cap) -> None:
    if isinstance(min_cap, bool) or not isinstance(min_cap, int) or min_cap < 1:
        raise ValueError(f"min_cap must be a positive int, got {min_cap!r}")


def request_tokens(request: PendingRequest):
    """The prompt's token ids a request carries (`tokens=` or the first positional argument), else None."""
    toks = request.kwargs.get("tokens") if request.kwargs else None
    if toks is None and request.args:
        toks = request.args[0]
    if isinstance(toks, (list, tuple)):
        return (
            toks if toks and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in toks) else None
        )
    is_array = isinstance(toks, np.ndarray) or (type(toks).__module__.startswith("torch") and hasattr(toks, "dim"))
    return toks if is_array and getattr(toks, "ndim", 0) == 1 and getattr(toks, "shape", (0,))[0] > 0 else None


class KVMeshRouter(RequestRouter):
    """Selected through `router_config(spec, ...)`; Serve constructs it in every process that routes to the
    deployment and calls `initialize_state` with the config's kwargs."""

    def initialize_state(
        self,
        spec: str = "",
        eps: float = DEFAULT_EPS,
        min_cap: int = DEFAULT_MIN_CAP,
        cache_salt: str | None = None,
        redis_url: str | None = None,
        prefill_tokens_per_s: float | None = None,
        options: dict | None = None,
        **_,
    ) -> None:

        _check_eps(eps)
        _check_min_cap(min_cap)
        self.eps = float(eps)
        self.min_cap = int(min_cap)
        self.cache_salt = cache_salt
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self._connect_args = (KVSpec.from_canonical_bytes(bytes.fromhex(spec)), redis_url, cache_salt, options or {})
        self.client = None
        self.connect_error: str | None = None  # why the router has no client, while it has none
        self._next_connect = 0.0
        self._try_connect()
        self.in_flight: dict[ReplicaID, int] = {}  # this router's requests sent and not completed, per replica
        # ... and their estimated prefill seconds: request id -> (replica, seconds, when routed)
        self.work: dict[str, tuple[str, float, float]] = {}
        self.last_estimates: list = []  # the last request's estimates (RouteEstimate), for tests and debugging
        # route() blocks on one directory round trip (bounded by lookup_timeout_s): run it off the event loop, one
        # at a time (a client takes one caller at a time)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvmesh-serve-route")
        self._lock = threading.Lock()

    def _try_connect(self) -> None:
        """Connect the router's client; on failure say why once (per distinct reason) and try again later."""
        import kvmesh

        spec, redis_url, cache_salt, options = self._connect_args
        self._next_connect = time.monotonic() + RECONNECT_S
        try:
            self.client = kvmesh.connect(spec, redis_url, cache_salt=cache_salt, **options)
        # DirectoryUnavailable is a ConnectionError; ValueError: another directory than the local KVNode's
        except (ConnectionError, TimeoutError, RuntimeError, ValueError) as e:
            why = f"{type(e).__name__}: {e}"
            if why != self.connect_error:
                log.error("kvmesh router: %s; routing by load alone, connecting again every %g s", why, RECONNECT_S)
            self.connect_error = why
            return
        if self.connect_error is not None:
            log.warning("kvmesh router: connected after %s", self.connect_error)
        self.connect_error = None

    # -- in-flight accounting: Serve calls on_send_request for every request sent, on_request_completed once each
    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self.work.pop(internal_request_id, None)
        n = self.in_flight.get(replica_id, 0) - 1
        if n > 0:
            self.in_flight[replica_id] = n
        else:
            self.in_flight.pop(replica_id, None)

    def allowed(self, replicas: list[RunningReplica]) -> list[RunningReplica]:
        """The replicas under the bounded-load cap for one more request."""
        total = sum(self.in_flight.get(r.replica_id, 0) for r in replicas)
        cap = max(getattr(self, "min_cap", 1), math.ceil((1 + self.eps) * (total + 1) / len(replicas)))
        return [r for r in replicas if self.in_flight.get(r.replica_id, 0) + 1 <= cap]

    def queued_s(self, now: float) -> dict[str, float]:
        """Per replica (its unique id), the estimated prefill seconds of this router's requests there not yet seen
        complete, less the time the replica has had for them since the oldest was routed (a replica prefills one
        request at a time: by then it has worked on them that long)."""
        total: dict[str, float] = {}
        first: dict[str, float] = {}
        # a request routed but never sent (cancelled while it waited for room) is never completed either: Serve
        # calls neither hook for it. Its entry goes after WORK_TTL_S, not at the router's end
        for request_id in [k for k, (_, _, at) in self.work.items() if now - at > WORK_TTL_S]:
            del self.work[request_id]
        for rid, seconds, at in self.work.values():
            total[rid] = total.get(rid, 0.0) + seconds
            first[rid] = min(first.get(rid, at), at)
        return {rid: max(0.0, s - (now - first[rid])) for rid, s in total.items()}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        allowed = self.allowed(candidate_replicas)
        load = {r.replica_id: self.in_flight.get(r.replica_id, 0) for r in allowed}
        toks = request_tokens(pending_request) if pending_request is not None else None
        ttft: dict[ReplicaID, float] = {}
        work: dict[ReplicaID, float] = {}
        if self.client is None and time.monotonic() >= self._next_connect:
            self._next_connect = math.inf  # one attempt at a time, off the event loop
            await asyncio.get_running_loop().run_in_executor(self._pool, self._try_connect)
        if toks is not None and self.client is not None:
            located = [r for r in allowed if r.node_id]
            if located:
                queued = self.queued_s(time.monotonic())
                est = await asyncio.get_running_loop().run_in_executor(self._pool, self._route, toks, located, queued)
                self.last_estimates = est
                ttft = {e.candidate.replica_id: e.expected_ttft_s for e in est if e.expected_ttft_s is not None}
                work = {e.candidate.replica_id: e.prefill_s for e in est if e.prefill_s is not None}
        # best expected TTFT first (unknown ones last), then fewer in flight, then at random; one replica per rank,
        # so Serve tries them in this order (and backs off and asks again if every one is full)
        random.shuffle(allowed)
        ranked = sorted(allowed, key=lambda r: (ttft.get(r.replica_id, math.inf), load[r.replica_id]))
        request_id = getattr(getattr(pending_request, "metadata", None), "internal_request_id", None)
        if ranked and request_id and ranked[0].replica_id in work:  # (Serve sends it to the first rank with room)
            self.work[request_id] = (ranked[0].replica_id.unique_id, work[ranked[0].replica_id], time.monotonic())
        return [[r] for r in ranked]

    def _route(self, toks, replicas, queued):
        from kvmesh import routing

        with self._lock:
            return routing.route(
                self.client, toks, replicas, None, prefill_tokens_per_s=self.prefill_tokens_per_s, queued_s=queued
            )


class LoadReporter:
    """A replica's load, published through kvmesh for the routers' estimates. Use one per replica:

            reporter = LoadReporter(client)              # replica id: Serve's, inside a replica
            with reporter.request(prompt_ids):           # queued and prefilling until prefilled() or the end
                ...

    `request(prompt_ids)` counts the tokens this replica will prefill as kvmesh estimates them for its node (the
    prompt less what it holds or would pull: one directory round trip, `route` on its own node), so a queue of
    requests whose prefixes are cached reads as the little work it is; `request(n)` counts `n` tokens as given.

        A background thread publishes whenever the load changed (coalescing bursts) and at least every `lease_s`
        (reports older than a few lease periods read as unknown). `close()` stops it."""

    def __init__(self, client, replica_id: str | None = None) -> None:
        if replica_id is None:
            from ray import serve

            replica_id = serve.get_replica_context().replica_id.unique_id
        self.client = client
        self.replica_id = replica_id
        self.pending_prefill_tokens = 0  # prompt tokens of requests not yet prefilled
        self.queue_depth = 0  # requests queued or running
        self._cv = threading.Condition()
        self._dirty = True
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvmesh-serve-load", daemon=True)
        self._thread.start()

    def request(self, prompt_tokens) -> _Tracked:
        if not isinstance(prompt_tokens, (int, np.integer)) or isinstance(prompt_tokens, bool):
            prompt_tokens = self.compute_tokens(prompt_tokens)
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be a non-negative int or token ids, got {prompt_tokens!r}")
        return _Tracked(self, prompt_tokens)

    def compute_tokens(self, tokens) -> int:
        """The prompt tokens this replica's node would prefill for `tokens` (all of them when the directory does
        not answer)."""
        node = self.client.node_id
        if self.client.closed:  # (the replica is shutting down: its client went first)
            return len(tokens)
        est = self.client.route(tokens, [node]) if node else []
        return int(est[0].recompute_tokens) if est and est[0].known else len(tokens)

    def _change(self, tokens: int, depth: int) -> None:
        with self._cv:
            self.pending_prefill_tokens += tokens
            self.queue_depth += depth
            self._dirty = True
            self._cv.notify()

    def _run(self) -> None:
        period = self.client.config.lease_s
        while True:
            with self._cv:
                if not self._dirty and not self._closed:
                    self._cv.wait(period)
                if self._closed or self.client.closed:
                    return
                self._dirty = False
                pending, depth = self.pending_prefill_tokens, self.queue_depth
            try:
                self.client.report_load(pending, depth, self.replica_id)
            except ValueError:  # closed meanwhile: nothing more to report
                if self.client.closed:
                    return
                raise

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=2)


class _Tracked:
    """One request in a LoadReporter: counted from enter to exit; its prompt tokens until `prefilled()`."""

    def __init__(self, reporter: LoadReporter, tokens: int) -> None:
        self._reporter, self._tokens = reporter, tokens

    def __enter__(self) -> _Tracked:
        self._reporter._change(self._tokens, 1)
        return self

    def prefilled(self) -> None:
        if self._tokens:
            self._reporter._change(-self._tokens, 0)
            self._tokens = 0

    def __exit__(self, *exc) -> None:
        self._reporter._change(-self._tokens, -1)
        self._tokens = 0
