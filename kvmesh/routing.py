"""Placement: which candidate node (or serving replica) would give a prompt its first token soonest.

    route(client, tokens, candidates) -> [RouteEstimate]   read, one directory round trip: the prompt's longest
                                       live prefix and every replica's load report, pipelined together
                                       (`Directory.lookup_with_loads`); the estimates best first
    report_load(client, pending_prefill_tokens, queue_depth, replica_id) -> bool   mutates: a replica's load
                                       in the directory (False: the directory did not take it)
    parse_candidates(candidates) -> [Candidate]   reads: checks the input (TypeError/ValueError naming it)
    estimate(...) -> [RouteEstimate]   pure: the estimates from what the directory said

`KVMeshClient.route` and `KVMeshClient.report_load` are these, on the client's directory, node view and cost model.

How a candidate on node N is priced (whole chunks; the last prompt token is always computed, as the engines do):
  - the directory's longest prefix of the prompt whose every chunk has a live holder: only current
    incarnations of nodes whose lease holds count (a dead node's copies are never priced);
  - `local_tokens`: the leading chunks of it that N itself holds, in any tier; `peer_tokens`: the rest of it,
    pulled from another live holder (its fastest tier);
  - the cost model's plan for that mix of sources (load all / compute the front while the rest loads /
    recompute: whatever it estimates fastest), `recompute_tokens` being what the plan computes;
  - the queue wait: the pending prefill tokens N's replica reported, prefilled at its rate, or the caller's own
    estimate of the work it sent there and has not seen complete (`queued_s`, a router's in-flight requests),
    whichever is longer;
  - `expected_ttft_s` = queue wait + the plan's time to the end of prefill.
The prefill rate is the one the candidate's replica measured and reported with its load (`report_load` sends the
reporting client's fitted prefill model once it has observed prefills), else the calling client's own fitted
model, else a linear prior at `prefill_tokens_per_s` (a router's process runs no model: it observes none). A load
report older than `LOAD_STALE_LEASES` lease periods (Redis's clock, as leases) reads as unknown (`load=None`: no
queue wait is added). A directory that fails gives every candidate
`known=False, expected_ttft_s=None, why="directory_error"`, never an exception.
"""

from __future__ import annotations

import math
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import numpy as np
import redis

from kvmesh.cost import CostModel, PrefillModel
from kvmesh.directory import Holder, LoadRecord
from kvmesh.hashing import as_tokens
from kvmesh.tiers import TIER_DISK

LOAD_STALE_LEASES = 3  # a load report older than this many lease periods is unknown
LOAD_KEEP_LEASES = 20  # ... and older than this many is dropped from the directory by the next report
PREFILL_TOKENS_PER_S = 5000.0  # the prefill prior of a client that has observed no prefill yet
MAX_REPLICA_ID = 256  # characters


@dataclass(frozen=True, slots=True)
class Candidate:
    """One candidate as given, and where it runs."""

    given: object  # what the caller passed: a node id, or a replica (anything with `node_id`)
    node_id: str
    replica_id: str | None  # its load report's key, when the candidate is a replica


@dataclass(frozen=True, slots=True)
class ReportedLoad:
    """A candidate's load as its replica(s) last reported it."""

    pending_prefill_tokens: int
    queue_depth: int
    age_s: float  # of the oldest report it sums
    replicas: int  # how many reports it sums (a bare node id: every replica of the spec on the node)
    prefill: tuple[float, ...] | None = None  # the replica's measured prefill model (coefficients), if reported


@dataclass(frozen=True, slots=True)
class RouteEstimate:
    candidate: object  # as given to route()
    node_id: str
    local_tokens: int  # leading prompt tokens this node holds itself (any tier), whole chunks
    peer_tokens: int  # further leading tokens another live node holds (pullable)
    recompute_tokens: int  # tokens the cost model's plan computes (the prompt less what it loads)
    load: ReportedLoad | None  # None: not reported, or stale
    expected_ttft_s: float | None  # None when not known
    known: bool  # False: the directory did not answer; nothing else here is meaningful
    why: str  # "local", "peer", "local+peer" (what the plan loads from), "recompute", "directory_error"
    queue_wait_s: float | None = None  # the part of expected_ttft_s spent waiting for the queue ahead
    prefill_s: float | None = None  # the rest: the plan's time to the end of prefill (loads and compute)


def parse_candidates(candidates) -> list[Candidate]:
    """Ray node ids (hex str), or objects with a `node_id` (Serve's RunningReplica, a replica's info); a
    `replica_id` on one (a str, or with a `unique_id`, as Serve's ReplicaID) names its load report."""
    if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Iterable):
        raise TypeError(
            f"candidates must be a list of Ray node ids or replicas with a node_id, got {type(candidates).__name__}"
        )
    items = list(candidates)
    if not items:
        raise ValueError("candidates must not be empty")
    out = []
    for i, c in enumerate(items):
        if isinstance(c, str):
            node, rid = c, None
        elif hasattr(c, "node_id"):
            node, rid = c.node_id, getattr(c, "replica_id", None)
            rid = getattr(rid, "unique_id", rid)
            rid = rid if isinstance(rid, str) and rid else None
        else:
            raise TypeError(
                f"candidates[{i}] must be a Ray node id (hex str) or have a node_id attribute, got {type(c).__name__}"
            )
        if not isinstance(node, str) or not node or any(ch not in string.hexdigits for ch in node):
            raise ValueError(f"candidates[{i}] has node id {node!r}: not a Ray node id (hex str)")
        out.append(Candidate(c, node, rid))
    return out


def linear_prefill(tokens_per_s: float) -> PrefillModel:
    """A prefill model that takes `tokens_per_s` at any length: the prior of a client that measured none."""
    m = PrefillModel()
    for n_new, n_past in ((256, 0), (4096, 0), (256, 4096)):  # pins the fit to c = 0, a = 1/rate, b = 0
        m.observe(n_new, n_past, n_new / tokens_per_s)
    return m


def _queue_s(cost: CostModel, load: ReportedLoad) -> float:
    """Seconds of prefill queued on a candidate: its `queue_depth` requests, each of an even share of its pending
    tokens, prefilled one after another. (One prefill of all the tokens at once would price their attention as if
    each attended to all the others: with a measured quadratic term, many times the queue's real work.)"""
    n, tokens = max(1, load.queue_depth), load.pending_prefill_tokens
    if tokens <= 0:
        return 0.0
    n = min(n, tokens)
    return n * (cost.prefill.seconds(-(-tokens // n), 0) or 0.0)


def _link(holder: Holder, node_id: str) -> str:
    where = "local" if holder.node_id == node_id else "peer"
    return f"{where}-disk" if holder.tier == TIER_DISK else where


def load_namespace(spec) -> bytes:
    """The namespace load reports are matched by: the spec's, less its LoRA adapter and TP rank (one replica serves
    the base model and its adapters through one queue at one prefill rate, on all its ranks; a router for an
    adapter prices a bare node id by that replica's report)."""
    if spec.lora_id is None and spec.tp_rank == 0:
        return spec.namespace
    return replace(spec, lora_id=None, tp_rank=0).namespace


def _load_of(
    c: Candidate, loads: list[LoadRecord], now_ms: int, stale_ms: int, namespace: bytes = b""
) -> ReportedLoad | None:
    """A replica candidate's own report; a bare node id's: those of the replicas on the node that serve the spec
    of `namespace` (a node shared by several models also runs replicas of the others: their queues are not this
    model's, and their measured prefill rates are another model's). A report without a namespace (an earlier
    release's) counts for any."""
    fresh = [
        r
        for r in loads
        if now_ms - r.at_ms <= stale_ms
        and (
            r.replica_id == c.replica_id
            if c.replica_id is not None
            else r.node_id == c.node_id and (not namespace or not r.namespace or r.namespace == namespace)
        )
    ]
    if not fresh or now_ms <= 0:  # (no node table read yet: no clock to judge ages by)
        return None
    measured = max(fresh, key=lambda r: (r.prefill is not None, r.at_ms)).prefill
    return ReportedLoad(
        sum(r.pending_prefill_tokens for r in fresh),
        sum(r.queue_depth for r in fresh),
        max(0.0, (now_ms - min(r.at_ms for r in fresh)) / 1000),
        len(fresh),
        measured,
    )


def fitted_prefill(coef) -> PrefillModel | None:
    """A prefill model with a reported fit's coefficients (c, a, b), or None where they are not usable."""
    try:
        arr = np.asarray(coef, dtype=float)
    except (TypeError, ValueError):
        return None
    if arr.shape != (3,) or not np.all(np.isfinite(arr)) or np.any(arr < 0) or not arr[1:].any():
        return None
    m = PrefillModel()
    m._coef = arr
    return m


def estimate(
    cands: list[Candidate],
    holders: list[tuple[Holder, ...]],
    prompt_tokens: int,
    chunk_tokens: int,
    chunk_bytes: int,
    loads: list[LoadRecord],
    now_ms: int,
    stale_ms: int,
    cost: CostModel,
    queued_s: Mapping[str, float] | None = None,
    namespace: bytes = b"",
) -> list[RouteEstimate]:
    """Pure: the estimates, best first (unknown TTFTs last, ties in the given order). `holders`: the live holders
    of each chunk of the prompt's longest live prefix; `cost` must have a prefill estimate (a candidate whose
    replica reported a measured one is priced with that); `queued_s`: seconds of work the caller knows it has
    queued on a candidate (by replica id, else node id); `namespace`: the prompt's spec, whose replicas a bare
    node id stands for (`_load_of`)."""
    usable = min(len(holders), (prompt_tokens - 1) // chunk_tokens)
    out = []
    base = cost
    for c in cands:
        load = _load_of(c, loads, now_ms, stale_ms, namespace)
        measured = fitted_prefill(load.prefill) if load is not None and load.prefill is not None else None
        if measured is not None:
            cost = CostModel(base.links, base.margin)
            cost.prefill = measured
        else:
            cost = base
        local = 0
        while local < usable and any(h.node_id == c.node_id for h in holders[local]):
            local += 1
        links = []
        for row in holders[:usable]:
            own = [h for h in row if h.node_id == c.node_id]
            links.append(_link(own[0] if own else min(row, key=lambda h: h.tier), c.node_id))
        plan = cost.plan(prompt_tokens, chunk_tokens, chunk_bytes, links)
        if plan.end > 0:
            prefill_s = plan.est_reuse_s
            used = {links[i].split("-")[0] for i in range(plan.front, plan.end)}
            why = "+".join(w for w in ("local", "peer") if w in used)
        else:
            prefill_s = (
                plan.est_recompute_s if plan.est_recompute_s is not None else cost.prefill.seconds(prompt_tokens, 0)
            )
            why = "recompute"
        assert prefill_s is not None  # (the cost model has a prefill estimate)
        wait = _queue_s(cost, load) if load else 0.0
        if queued_s:
            wait = max(wait, float(queued_s.get(c.replica_id or c.node_id, 0.0)))
        out.append(
            RouteEstimate(
                c.given,
                c.node_id,
                local * chunk_tokens,
                (usable - local) * chunk_tokens,
                prompt_tokens - plan.load_chunks * chunk_tokens,
                load,
                wait + prefill_s,
                True,
                why,
                wait,
                prefill_s,
            )
        )
    return sorted(out, key=lambda e: e.expected_ttft_s if e.expected_ttft_s is not None else float("inf"))


def unknown(cands: list[Candidate], prompt_tokens: int) -> list[RouteEstimate]:
    return [RouteEstimate(c.given, c.node_id, 0, 0, prompt_tokens, None, None, False, "directory_error") for c in cands]


def route(
    client,
    tokens,
    candidates,
    cache_salt=None,
    *,
    prefill_tokens_per_s: float | None = None,
    queued_s: Mapping[str, float] | None = None,
) -> list[RouteEstimate]:
    """`KVMeshClient.route`: see the module docstring."""
    toks = as_tokens(tokens)
    if len(toks) == 0:
        raise ValueError("tokens must hold at least one token")
    rate = PREFILL_TOKENS_PER_S if prefill_tokens_per_s is None else prefill_tokens_per_s
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
        raise ValueError(f"prefill_tokens_per_s must be a positive number, got {prefill_tokens_per_s!r}")
    cands = parse_candidates(candidates)
    hashes = client.hashes(toks, cache_salt)
    client.counts["routes"] += 1
    if not client.view.allow():  # the directory failed moments ago: a fast "unknown", not a timeout per call
        client.counts["route_directory_skipped"] += 1
        return unknown(cands, len(toks))
    table = client.view.table()
    try:
        holders, _, loads = client.directory.lookup_with_loads(
            hashes[0] if hashes else b"", hashes, table, prefer=client.node_id, newer=client.view.current, chained=True
        )
    except redis.RedisError:
        client.counts["route_directory_errors"] += 1
        client.view.failed()
        return unknown(cands, len(toks))
    cost = client.cost
    if not cost.prefill.ready:
        cost = CostModel(cost.links, cost.margin)
        cost.prefill = linear_prefill(float(rate))
    lease_ms = int(client.config.lease_s * 1000)
    return estimate(
        cands,
        holders,
        len(toks),
        client.spec.chunk_tokens,
        client.spec.chunk_bytes,
        loads,
        table.now_ms,
        LOAD_STALE_LEASES * lease_ms,
        cost,
        queued_s,
        load_namespace(client.spec),
    )


def report_load(client, pending_prefill_tokens: int, queue_depth: int, replica_id: str) -> bool:
    """`KVMeshClient.report_load`: see the module docstring."""
    for name, v in (("pending_prefill_tokens", pending_prefill_tokens), ("queue_depth", queue_depth)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**63:
            raise ValueError(f"{name} must be a non-negative int below 2**63, got {v!r}")
    if not isinstance(replica_id, str) or not replica_id or len(replica_id) > MAX_REPLICA_ID:
        raise ValueError(
            f"replica_id must be a non-empty str of at most {MAX_REPLICA_ID} characters, got {replica_id!r}"
        )
    if not client.node_id:
        raise ValueError("report_load needs a client on a Ray node (kvmesh.connect)")
    if not client.view.allow():
        return False
    coef = client.cost.prefill._coef  # what this replica measured, for the routers' estimates of its queue
    try:
        client.directory.report_load(
            replica_id,
            client.node_id,
            pending_prefill_tokens,
            queue_depth,
            int(LOAD_KEEP_LEASES * client.config.lease_s * 1000),
            tuple(float(x) for x in coef) if coef is not None else None,
            load_namespace(client.spec),
        )
    except redis.RedisError:
        client.counts["report_load_errors"] += 1
        client.view.failed()
        return False
    return True
