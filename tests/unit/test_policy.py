"""LRU policy: evict(n) evicts exactly n or changes nothing."""

from kvmesh.policy import LRUPolicy


def test_lru_story():
    p = LRUPolicy()
    for k in "abcd":
        p.insert(k)  # order, least recent first: a b c d
    p.touch("a")  # b c d a
    assert p.evict(2) == ["b", "c"]  # d a
    assert len(p) == 2 and "b" not in p


def test_evict_skips_keys_that_cannot_go_and_is_all_or_nothing():
    p = LRUPolicy()
    for k in "abc":
        p.insert(k)
    pinned = {"a", "b"}
    assert p.evict(2, lambda k: k not in pinned) is None  # only "c" could go: nothing changes
    assert len(p) == 3
    assert p.evict(1, lambda k: k not in pinned) == ["c"]
    assert p.evict(0) == [] and len(p) == 2


def test_remove_and_touch_of_unknown_keys_are_noops():
    p = LRUPolicy()
    p.touch("x")
    p.remove("x")
    p.insert("y")
    p.remove("y")
    assert len(p) == 0 and p.evict(1) is None
