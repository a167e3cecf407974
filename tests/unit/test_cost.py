"""Cost model stories: fits from observations, and plans that never lose to recompute by their own estimate."""

import pytest

from kvmesh.cost import CostModel, LinkModel, PrefillModel


def test_link_model_fits_latency_and_bandwidth():
    link = LinkModel(bandwidth_bps=1e8, latency_s=0.1)  # a bad prior
    for n in (1 << 20, 8 << 20, 64 << 20, 256 << 20):
        link.observe(n, 0.002 + n / 5e9)  # truth: 2 ms + 5 GB/s
    assert link.bandwidth_bps == pytest.approx(5e9, rel=0.05)
    assert link.latency_s == pytest.approx(0.002, abs=5e-4)
    link.observe(0, 1.0)  # nonsense is ignored
    assert link.seconds(0) == 0.0


def test_prefill_model_learns_the_quadratic_part():
    pm = PrefillModel()
    assert pm.seconds(100) is None and not pm.ready
    truth = lambda n, p: 0.01 + 1e-4 * n + 1e-8 * n * (p + n / 2)  # noqa: E731
    for n, p in [(512, 0), (2048, 0), (8192, 0), (64, 8192), (32768, 0), (64, 32768)]:
        pm.observe(n, p, truth(n, p))
    for n, p in [(4096, 0), (128, 16384), (16000, 16000)]:
        assert pm.seconds(n, p) == pytest.approx(truth(n, p), rel=0.05)


def cost_model(load_bps: float, latency: float) -> CostModel:
    cm = CostModel({"local": LinkModel(load_bps, latency)})
    for n in (256, 1024, 4096, 16384):  # prefill: 1 ms + 10 µs/token + attention
        cm.prefill.observe(n, 0, 1e-3 + 1e-5 * n + 1e-10 * n * n / 2)
    return cm


def test_fast_link_loads_everything():
    plan = cost_model(50e9, 1e-4).plan(16384, 256, 1 << 20, ["local"] * 64)
    assert plan.reason == "load" and (plan.front, plan.end) == (0, 64)
    assert plan.est_reuse_s < plan.est_recompute_s


def test_slow_link_recomputes():
    plan = cost_model(1e6, 0.5).plan(16384, 256, 1 << 20, ["local"] * 64)
    assert plan.reason == "recompute" and plan.end == 0


def test_comparable_costs_split_the_prefix():
    # loading a chunk costs about what computing it does: compute the front while the back loads
    cm = cost_model((1 << 20) / 2.56e-3, 1e-4)
    plan = cm.plan(16384, 256, 1 << 20, ["local"] * 64)
    assert plan.reason == "split" and 0 < plan.front < plan.end
    plain = cm.plan(16384, 256, 1 << 20, ["local"] * 64, allow_split=False)
    assert plan.est_reuse_s < min(t for t in (plain.est_reuse_s, plain.est_recompute_s) if t is not None)


def test_a_close_call_recomputes():
    # loading is estimated 5 % faster than recomputing: inside the margin, so recompute
    cm = CostModel({"local": LinkModel(1e12, 0.0)}, margin=0.9)
    for n in (256, 1024, 4096):
        cm.prefill.observe(n, 0, 1e-3 * n)
    cm.links["local"] = LinkModel(1e12, 0.95 * cm.prefill.seconds(4096) - cm.prefill.seconds(96, 4000))
    assert cm.plan(4096, 256, 1 << 20, ["local"] * 15, allow_split=False).reason == "recompute"


def test_without_observations_the_plan_loads_all_and_says_why():
    plan = CostModel().plan(1000, 256, 1 << 20, ["peer"] * 3)
    assert (plan.front, plan.end, plan.reason) == (0, 3, "no estimate")
    assert CostModel().plan(1000, 256, 1, []).reason == "no match"


def test_sources_load_in_parallel_so_a_mix_costs_its_slowest_source():
    # the fetcher begins every run at once: 4 chunks from this node's slab and 2 from a peer take as long as the
    # slower of the two transfers, not their sum, so "4 local + 2 peer" never prices above "6 from the peer"
    cm = CostModel({"local": LinkModel(10e9, 1e-3), "peer": LinkModel(1e9, 5e-3)}, margin=1.0)
    for n in (256, 1024, 4096):
        cm.prefill.observe(n, 0, 1e-3 * n)  # 1 ms a token: loading always wins
    cb, c = 1 << 20, 256
    mixed = cm.plan(7 * c, c, cb, ["local"] * 4 + ["peer"] * 2, allow_split=False)
    peer = cm.plan(7 * c, c, cb, ["peer"] * 6, allow_split=False)
    rest = cm.prefill.seconds(c, 6 * c)
    assert mixed.reason == peer.reason == "load" and mixed.end == peer.end == 6
    t_local, t_peer = cm.links["local"].seconds(4 * cb), cm.links["peer"].seconds(2 * cb)
    assert mixed.est_reuse_s == pytest.approx(max(t_local, t_peer) + rest)
    assert peer.est_reuse_s == pytest.approx(cm.links["peer"].seconds(6 * cb) + rest)
    assert mixed.est_reuse_s < peer.est_reuse_s


def test_a_link_that_becomes_slow_is_planned_as_slow_after_a_few_transfers_not_a_window():
    """A fit of relative error follows the fast history (a 2 ms transfer weighs 500 times a 1 s one): without
    starting anew, a peer that became slow kept being loaded from for a whole window (64) of requests."""
    from kvmesh.cost import SHIFT_N

    cm = cost_model(50e9, 1e-4)
    peer = cm.link("peer")
    for _ in range(20):
        peer.observe(1 << 20, 0.002)
    assert cm.plan(16384, 256, 1 << 20, ["peer"] * 64).reason != "recompute"
    for _ in range(SHIFT_N):
        peer.observe(1 << 20, 1.0)
    assert peer.seconds(1 << 20) > 0.5
    assert cm.plan(16384, 256, 1 << 20, ["peer"] * 64).reason == "recompute"
    for _ in range(SHIFT_N):  # and fast again
        peer.observe(1 << 20, 0.002)
    assert peer.seconds(1 << 20) < 0.01


def test_a_link_not_observed_for_a_while_is_its_prior_again_so_one_slow_transfer_does_not_stop_loading_for_good():
    """The plan never loads over a link it thinks slow, so it never sees that link fast again: after FORGET_S
    without an observation the link is its prior again, and the next load re-measures it."""
    import time

    from kvmesh.cost import FORGET_S

    cm = cost_model(50e9, 1e-4)
    peer = cm.link("peer")
    peer.observe(8 << 20, 2.0)  # one fetch that hung until its deadline
    assert cm.plan(8 * 256 + 1, 256, 1 << 20, ["peer"] * 8).reason == "recompute"
    peer.observe(8 << 20, 2.0, now=time.monotonic() - FORGET_S - 1)  # (as if it were that long ago)
    assert peer.latency_s == pytest.approx(1e-3) and peer.bandwidth_bps == pytest.approx(1e9)  # the prior
    assert cm.plan(8 * 256 + 1, 256, 1 << 20, ["peer"] * 8).end > 0  # (loads; maybe computing a front part)
    peer.observe(8 << 20, 0.01)  # a new observation after the gap: the old ones are gone
    assert peer.seconds(8 << 20) < 0.05


def test_a_runs_deadline_counts_as_a_slow_transfer_and_a_run_that_never_went_out_counts_as_nothing():
    from kvmesh.match import RunStats, link_observations

    runs = [RunStats("slab", "local", 6, 6, 0.003), RunStats("tcp", "peer", 4, 0, 2.0, "deadline"),
            RunStats("tcp", "peer", 2, 0, 0.0, "deadline"), RunStats("tcp", "peer-disk", 3, 0, 0.01, "not_held")]
    assert sorted(link_observations(runs, 100)) == [("local", 600, 0.003), ("peer", 400, 2.0)]


def test_a_peers_batches_that_ran_at_once_count_as_the_span_they_took_not_their_sum():
    """8 batches received at once on 8 threads, 0.3 s each: the link took 0.3 s for them all (summed, a healthy
    peer read 8 times slower than it is, and the plan recomputed what it should load)."""
    from kvmesh.match import RunStats, link_observations

    runs = [RunStats("tcp", "peer:b", 4, 4, 0.3, "", 0.001 * i) for i in range(8)]
    ((link, nbytes, seconds),) = link_observations(runs, 100)
    assert (link, nbytes) == ("peer:b", 3200) and seconds == pytest.approx(0.307)


def test_links_added_and_pruned_from_many_threads_at_once_never_raise():
    """A client's lookups, plans and fetches meet new peers from several threads; past MAX_LINKS each new one
    prunes. Unlocked, a prune raised "dictionary changed size during iteration" (or a KeyError where two threads
    pruned one link) out of lookup (found by the thread-safety hunt)."""
    import sys
    import threading

    from kvmesh.cost import MAX_LINKS, CostModel

    cost = CostModel()
    errors: list[str] = []
    start = threading.Barrier(4)

    def add(t: int) -> None:
        start.wait()
        for i in range(4000):
            try:
                cost.link(f"peer:{t}-{i}")
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
                return

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (threads switch often: the unlocked window is hit at once)
    try:
        threads = [threading.Thread(target=add, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:3]
    assert len(cost.links) <= 4 * 4000  # (all observed lately: none is old enough to prune)
    assert MAX_LINKS < 4 * 4000
