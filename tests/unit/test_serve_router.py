"""kvmesh.integrations.serve's pure parts: how a request carries its tokens, and the bounded-load guard."""

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

pytest.importorskip("ray.serve", reason="needs kvmesh[serve]")

from kvmesh.integrations.serve import KVMeshRouter, request_tokens, router_config  # noqa: E402
from kvmesh.spec import KVSpec  # noqa: E402


@dataclass
class Request:  # what the router reads of Serve's PendingRequest
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)


@dataclass
class Replica:
    replica_id: str
    node_id: str = "aa"


def test_tokens_come_from_the_tokens_kwarg_or_the_first_positional_argument():
    assert request_tokens(Request(kwargs={"tokens": [1, 2, 3]})) == [1, 2, 3]
    assert request_tokens(Request(args=[(4, 5)], kwargs={"max_new_tokens": 3})) == (4, 5)
    arr = np.arange(4)
    assert request_tokens(Request(args=[arr])) is arr
    t = torch.arange(3)
    assert request_tokens(Request(args=[t])) is t
    # anything else is routed by load alone
    for req in (Request(), Request(args=["a text prompt"]), Request(args=[[]]), Request(args=[[1.5, 2.0]]),
                Request(args=[np.zeros((2, 2), dtype=np.int64)]), Request(args=[[True, False]])):
        assert request_tokens(req) is None


def router(eps: float, in_flight: dict, min_cap: int = 1) -> KVMeshRouter:
    r = KVMeshRouter.__new__(KVMeshRouter)  # (the guard needs no Serve runtime)
    r.eps, r.in_flight, r.min_cap, r.work = eps, dict(in_flight), min_cap, {}
    return r


def test_no_replica_gets_more_than_ceil_of_1_plus_eps_times_the_average():
    reps = [Replica("a"), Replica("b"), Replica("c")]
    # nothing in flight: cap = ceil(1.25 * 1 / 3) = 1, everyone qualifies
    assert [x.replica_id for x in router(0.25, {}).allowed(reps)] == ["a", "b", "c"]
    # a has 1, others 0: cap = ceil(1.25 * 2 / 3) = 1: a is full
    assert [x.replica_id for x in router(0.25, {"a": 1}).allowed(reps)] == ["b", "c"]
    # 6 in flight (4, 1, 1): cap = ceil(1.25 * 7 / 3) = 3: a stays out until the others catch up
    assert [x.replica_id for x in router(0.25, {"a": 4, "b": 1, "c": 1}).allowed(reps)] == ["b", "c"]
    # a large eps lets the favourite take more: cap = ceil(3 * 7 / 3) = 7
    assert len(router(2.0, {"a": 4, "b": 1, "c": 1}).allowed(reps)) == 3
    # whatever the counts, the least loaded replica always qualifies
    for counts in ({"a": 9}, {"a": 3, "b": 3, "c": 2}, {"a": 0, "b": 7, "c": 7}):
        m = sum(counts.values())
        allowed = router(0.0, counts).allowed(reps)
        assert allowed and all(counts.get(x.replica_id, 0) + 1 <= math.ceil((m + 1) / 3) for x in allowed)


def test_min_cap_lets_a_holder_take_a_few_requests_at_light_load_but_not_a_flood():
    reps = [Replica("a"), Replica("b"), Replica("c")]
    # light load: a (the holder of a prefix) has 1 in flight; ceil(1.25 * 2 / 3) = 1 would shut it out, the floor
    # of 4 leaves the choice to the expected TTFT (which prices a's queue)
    assert [x.replica_id for x in router(0.25, {"a": 1}, min_cap=4).allowed(reps)] == ["a", "b", "c"]
    assert [x.replica_id for x in router(0.25, {"a": 3}, min_cap=4).allowed(reps)] == ["a", "b", "c"]
    # a flood: a at the floor is full, and above the floor the proportional cap rules again
    assert [x.replica_id for x in router(0.25, {"a": 4}, min_cap=4).allowed(reps)] == ["b", "c"]
    assert [x.replica_id for x in router(0.25, {"a": 10, "b": 2, "c": 2}, min_cap=4).allowed(reps)] == ["b", "c"]
    assert len(router(0.25, {"a": 7, "b": 6, "c": 6}, min_cap=4).allowed(reps)) == 3  # cap = ceil(1.25 * 20 / 3)


def test_the_routers_own_queued_work_counts_down_from_the_oldest_request():
    r = router(0.25, {})
    r.work = {"q1": ("a", 1.0, 10.0), "q2": ("a", 0.5, 10.4), "q3": ("b", 0.2, 10.0)}
    # at 10.3 a has had 0.3 s for its 1.5 s: 1.2 s left; b is done with its 0.2 s
    assert r.queued_s(10.3) == pytest.approx({"a": 1.2, "b": 0.0})


def test_a_request_routed_but_never_sent_stops_counting_in_its_replicas_queue():
    """Serve calls neither on_send_request nor on_request_completed for a request cancelled while it waited for
    room: its entry would stay for the router's life, one per such request, its estimate in the queue for good."""
    from kvmesh.integrations.serve import WORK_TTL_S

    r = router(0.25, {})
    r.work = {"lost": ("a", 0.5, 0.0), "q1": ("a", 1.0, WORK_TTL_S + 10.0)}
    assert r.queued_s(WORK_TTL_S + 10.3) == pytest.approx({"a": 0.7})
    assert list(r.work) == ["q1"]


def test_router_config_carries_a_json_safe_spec_and_checks_eps():
    s = KVSpec("m", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)
    cfg = router_config(s, eps=0.5, cache_salt="t")
    kw = cfg.request_router_kwargs
    assert KVSpec.from_canonical_bytes(bytes.fromhex(kw["spec"])) == s and kw["eps"] == 0.5
    assert kw["min_cap"] == 4
    with pytest.raises(ValueError, match="eps"):
        router_config(s, eps=-1)
    with pytest.raises(ValueError, match="min_cap"):
        router_config(s, min_cap=0)
    with pytest.raises(TypeError, match="spec"):
        router_config("m")


def test_router_config_refuses_what_the_router_could_never_use():
    """router_config took any prefill_tokens_per_s, redis_url and options. They are used in the router's process
    only: a rate route() refuses raised ValueError out of every request's choose_replicas, and an option name
    kvmesh.connect does not know raised TypeError out of the router's initialize_state (its _try_connect catches
    ValueError and connection errors only). Refused here, naming the argument, as eps and min_cap are."""
    s = KVSpec("m", 2, 2, 16, "bfloat16")
    for rate in (0, -1, float("nan"), float("inf"), "fast", True):
        with pytest.raises(ValueError, match="prefill_tokens_per_s"):
            router_config(s, prefill_tokens_per_s=rate)
    with pytest.raises(TypeError, match="redis_url"):
        router_config(s, redis_url=6379)
    with pytest.raises(TypeError, match="lease_z"):
        router_config(s, lease_z=5.0)
    cfg = router_config(s, prefill_tokens_per_s=8000, redis_url="redis://127.0.0.1:6379/0", lookup_timeout_s=0.2)
    assert cfg.request_router_kwargs["options"] == {"lookup_timeout_s": 0.2}
