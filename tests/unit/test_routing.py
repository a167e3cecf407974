"""kvmesh.routing's pure parts: candidates in, estimates out (no Redis, no Ray)."""

from dataclasses import dataclass

import pytest

from kvmesh.cost import CostModel, LinkModel
from kvmesh.directory import Holder, LoadRecord
from kvmesh.routing import Candidate, estimate, linear_prefill, parse_candidates
from kvmesh.tiers import TIER_CPU, TIER_DISK

A, B, C = "aa" * 28, "bb" * 28, "cc" * 28
CT, CB = 32, 64 << 10  # chunk tokens, chunk bytes


@dataclass
class ReplicaId:
    unique_id: str


@dataclass
class Replica:  # what Serve hands a router: a node id and a replica id with a unique_id
    node_id: str
    replica_id: ReplicaId


def cost(tps: float = 1000.0) -> CostModel:
    # links far faster than prefill: loading beats recomputing wherever there is something to load
    c = CostModel({"local": LinkModel(1e10, 1e-4), "peer": LinkModel(1e9, 1e-3),
                   "local-disk": LinkModel(5e8, 1e-3), "peer-disk": LinkModel(4e8, 2e-3)})
    c.prefill = linear_prefill(tps)
    return c


def cands(*nodes) -> list[Candidate]:
    return parse_candidates(list(nodes))


def test_candidates_are_node_ids_or_replicas_and_bad_ones_are_typed_errors():
    got = parse_candidates([A, Replica(B, ReplicaId("r1"))])
    assert [(c.node_id, c.replica_id) for c in got] == [(A, None), (B, "r1")]
    with pytest.raises(ValueError, match="empty"):
        parse_candidates([])
    with pytest.raises(TypeError, match="candidates"):
        parse_candidates(A)  # one id, not a list of them
    with pytest.raises(TypeError, match=r"candidates\[1\]"):
        parse_candidates([A, 42])
    with pytest.raises(ValueError, match=r"candidates\[0\]"):
        parse_candidates(["not-hex"])
    with pytest.raises(ValueError, match=r"candidates\[0\]"):
        parse_candidates([Replica(None, ReplicaId("r"))])


def test_linear_prefill_prior_is_the_given_rate_at_any_length():
    m = linear_prefill(2000.0)
    assert m.seconds(1000, 0) == pytest.approx(0.5, rel=1e-6)
    assert m.seconds(4000, 8000) == pytest.approx(2.0, rel=1e-6)


def test_the_local_holder_ranks_first_then_a_peer_puller_then_recompute():
    # 4 chunks cached: all on A; chunks 0-1 also on B; C holds nothing. Prompt of 5 chunks + 1 token.
    row_ab, row_a = (Holder(A, 1, TIER_CPU), Holder(B, 2, TIER_CPU)), (Holder(A, 1, TIER_CPU),)
    holders = [row_ab, row_ab, row_a, row_a]
    n = 5 * CT + 1
    est = estimate(cands(C, B, A), holders, n, CT, CB, [], 10_000, 5_000, cost())
    assert [e.node_id for e in est] == [A, B, C]
    a, b, c = est
    assert (a.local_tokens, a.peer_tokens, a.recompute_tokens, a.why) == (4 * CT, 0, CT + 1, "local")
    assert (b.local_tokens, b.peer_tokens, b.why) == (2 * CT, 2 * CT, "local+peer")
    assert (c.local_tokens, c.peer_tokens, c.why) == (0, 4 * CT, "peer")
    assert all(e.known and e.load is None for e in est)
    assert a.expected_ttft_s < b.expected_ttft_s < c.expected_ttft_s


def test_the_last_prompt_token_is_always_computed():
    holders = [(Holder(A, 1, TIER_CPU),)] * 2
    (e,) = estimate(cands(A), holders, 2 * CT, CT, CB, [], 10_000, 5_000, cost())
    assert (e.local_tokens, e.recompute_tokens) == (CT, CT)  # chunk 1 holds the last token: computed


def test_nothing_cached_is_a_recompute_at_the_prefill_rate():
    (e,) = estimate(cands(A), [], 1000, CT, CB, [], 10_000, 5_000, cost(1000.0))
    assert (e.why, e.recompute_tokens) == ("recompute", 1000)
    assert e.expected_ttft_s == pytest.approx(1.0, rel=1e-3)


def test_a_disk_copy_is_priced_on_its_disk_link():
    disk, cpu = [(Holder(A, 1, TIER_DISK),)] * 4, [(Holder(A, 1, TIER_CPU),)] * 4
    (d,) = estimate(cands(A), disk, 5 * CT, CT, CB, [], 10_000, 5_000, cost())
    (m,) = estimate(cands(A), cpu, 5 * CT, CT, CB, [], 10_000, 5_000, cost())
    assert d.local_tokens == m.local_tokens == 4 * CT and d.expected_ttft_s > m.expected_ttft_s


def test_reported_pending_prefill_is_queue_wait_and_can_outweigh_a_local_hit():
    holders = [(Holder(A, 1, TIER_CPU),)] * 4
    n = 5 * CT
    now, stale = 100_000, 6_000
    busy_a = [LoadRecord("ra", A, 50_000, 20, now - 1000)]  # 50 s of prefill queued on A at 1000 tok/s
    est = estimate(cands(A, B), holders, n, CT, CB, busy_a, now, stale, cost(1000.0))
    assert [e.node_id for e in est] == [B, A]
    assert est[1].load.pending_prefill_tokens == 50_000 and est[1].load.queue_depth == 20
    assert est[1].expected_ttft_s > 50.0
    # the same report, too old: unknown, so no wait is added and A's local prefix wins again
    old = [LoadRecord("ra", A, 50_000, 20, now - stale - 1)]
    est = estimate(cands(A, B), holders, n, CT, CB, old, now, stale, cost(1000.0))
    assert est[0].node_id == A and est[0].load is None


def test_a_replica_candidate_reads_its_own_report_a_node_sums_its_replicas():
    now = 50_000
    loads = [LoadRecord("r1", A, 100, 1, now - 10), LoadRecord("r2", A, 300, 2, now - 30),
             LoadRecord("r3", B, 7, 1, now)]
    by_replica = estimate(parse_candidates([Replica(A, ReplicaId("r2"))]), [], 10, CT, CB, loads, now, 5000, cost())
    assert by_replica[0].load.pending_prefill_tokens == 300 and by_replica[0].load.replicas == 1
    (by_node,) = estimate(cands(A), [], 10, CT, CB, loads, now, 5000, cost())
    assert (by_node.load.pending_prefill_tokens, by_node.load.queue_depth, by_node.load.replicas) == (400, 3, 2)
    assert by_node.load.age_s == pytest.approx(0.03)


def test_a_replica_is_priced_at_the_prefill_rate_it_measured_and_reported():
    now = 100_000
    # A's replica measured 500 tok/s (c=0, a=1/500, b=0) and has 1000 tokens queued; B reported no model
    loads = [LoadRecord("ra", A, 1000, 1, now, (0.0, 1 / 500, 0.0)), LoadRecord("rb", B, 1000, 1, now)]
    reps = parse_candidates([Replica(A, ReplicaId("ra")), Replica(B, ReplicaId("rb"))])
    est = {e.node_id: e for e in estimate(reps, [], 500, CT, CB, loads, now, 5000, cost(1000.0))}
    assert est[A].queue_wait_s == pytest.approx(2.0) and est[A].prefill_s == pytest.approx(1.0)
    assert est[B].queue_wait_s == pytest.approx(1.0) and est[B].prefill_s == pytest.approx(0.5)  # the prior
    assert est[A].expected_ttft_s == pytest.approx(3.0) and est[A].load.prefill == (0.0, 1 / 500, 0.0)
    # a fit that cannot be a prefill model (negative, wrong shape) is ignored: the prior prices it
    bad = [LoadRecord("ra", A, 1000, 1, now, (0.0, -1.0, 0.0))]
    (e,) = estimate(reps[:1], [], 500, CT, CB, bad, now, 5000, cost(1000.0))
    assert e.queue_wait_s == pytest.approx(1.0)


def test_the_callers_own_queued_work_is_queue_wait_when_longer_than_the_report():
    holders = [(Holder(A, 1, TIER_CPU),)] * 4
    n = 5 * CT
    now = 100_000
    reps = parse_candidates([Replica(A, ReplicaId("ra")), Replica(B, ReplicaId("rb"))])
    # nothing reported, but the caller knows it sent A 2 s of prefill: B, pulling the prefix from A, wins
    est = estimate(reps, holders, n, CT, CB, [], now, 5000, cost(1000.0), queued_s={"ra": 2.0})
    assert [e.node_id for e in est] == [B, A] and est[1].queue_wait_s == 2.0 and est[0].why == "peer"
    # a report longer than the caller's own view wins
    loads = [LoadRecord("ra", A, 3000, 2, now)]
    est = estimate(reps, holders, n, CT, CB, loads, now, 5000, cost(1000.0), queued_s={"ra": 2.0})
    assert est[1].queue_wait_s == pytest.approx(3.0)


def test_a_queue_of_many_requests_is_priced_as_their_prefills_not_as_one_of_all_their_tokens():
    """With attention's quadratic term, one prefill of a queue's 40k tokens costs several times ten of 4k: a
    replica with ten queued requests read as far busier than it is."""
    from kvmesh.cost import CostModel
    from kvmesh.routing import ReportedLoad, _queue_s

    cm = CostModel()
    truth = lambda n: 1e-3 + 1e-4 * n + 1e-8 * n * n / 2  # noqa: E731
    for n in (512, 2048, 8192, 32768):
        cm.prefill.observe(n, 0, truth(n))
    ten = _queue_s(cm, ReportedLoad(40_000, 10, 0.0, 1))
    assert ten == pytest.approx(10 * truth(4_000), rel=0.05) and ten < 0.8 * truth(40_000)
    assert _queue_s(cm, ReportedLoad(0, 3, 0.0, 1)) == 0.0
    assert _queue_s(cm, ReportedLoad(5_000, 0, 0.0, 1)) == pytest.approx(truth(5_000), rel=0.05)  # (depth unknown)
