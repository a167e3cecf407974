"""`plan_runs`: a match's chunks as runs by holder, in order, without gaps; peer runs in batches, this node's in
windows where asked."""

from types import SimpleNamespace

import pytest

from kvmesh.dataplane.planner import plan_runs
from kvmesh.directory import Holder


def chunks(*holders_per_chunk):
    return [SimpleNamespace(hash=bytes([i]) * 16, holders=tuple(Holder(n, 7, 1) for n in hs))
            for i, hs in enumerate(holders_per_chunk)]


def covers(runs, n):
    assert [i for r in runs for i in r.indices] == list(range(n))
    for r in runs:
        assert r.keys == tuple(bytes([i]) * 16 for i in r.indices)


def test_this_nodes_chunks_are_one_run_and_peers_come_in_batches():
    cs = chunks(*[["A", "B"]] * 10, *[["B"]] * 5)
    runs = plan_runs(cs, "A", True, per_batch=2)
    covers(runs, 15)
    assert [(r.holder, len(r.keys), r.local) for r in runs] == [("A", 10, True)] + [("B", 2, False)] * 2 + [
        ("B", 1, False)]


def test_windows_cut_this_nodes_run():
    cs = chunks(*[["A"]] * 10)
    runs = plan_runs(cs, "A", True, per_batch=8, local_batch=4)
    covers(runs, 10)
    assert [len(r.keys) for r in runs] == [4, 4, 2] and all(r.local for r in runs)


def test_without_local_reads_this_node_is_a_peer():
    cs = chunks(*[["A"]] * 5)
    runs = plan_runs(cs, "A", False, per_batch=2, local_batch=4)
    covers(runs, 5)
    assert [(len(r.keys), r.local) for r in runs] == [(2, False), (2, False), (1, False)]


def test_a_run_stays_with_the_previous_holder():
    cs = chunks(["B"], ["C", "B"], ["C"])
    runs = plan_runs(cs, "A", True, per_batch=8)
    assert [(r.holder, r.start, len(r.keys)) for r in runs] == [("B", 0, 2), ("C", 2, 1)]


@pytest.mark.parametrize("bad", [{"per_batch": 0}, {"per_batch": 1, "local_batch": 0}])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError):
        plan_runs(chunks(["A"]), "A", True, **bad)


def test_no_run_names_more_chunks_than_one_message_may():
    """A run is one pin or pull message, which names at most wire.MAX_KEYS chunks (the node refuses a longer one
    whole: a 70,000-chunk prompt read back nothing)."""
    from kvmesh.wire import MAX_KEYS, pack_keys, unpack_keys

    n = MAX_KEYS + 5
    cs = [SimpleNamespace(hash=i.to_bytes(16, "little"), holders=(Holder("A", 7, 1),)) for i in range(n)]
    for here, local in (("A", True), ("B", False)):
        runs = plan_runs(cs, here, local, per_batch=10**6)
        assert [i for r in runs for i in r.indices] == list(range(n))
        assert [len(r.keys) for r in runs] == [MAX_KEYS, 5]
        assert unpack_keys(pack_keys(list(runs[0].keys))) == list(runs[0].keys)
