"""The in-flight table that makes concurrent readers of one node share a chunk's transfer."""

import threading

from kvmesh.inflight import InflightPulls


def test_one_claimer_per_chunk_the_others_wait_on_its_event():
    pulls = InflightPulls()
    held = {b"h"}.__contains__  # chunk "h" is already in the node's tier
    mine, theirs = pulls.claim([b"h", b"a", b"b"], held)  # reader 1: pulls a and b
    assert mine == [b"a", b"b"] and theirs == {}
    mine2, theirs2 = pulls.claim([b"a", b"b", b"c"], held)  # reader 2, meanwhile: waits for a, b; pulls c
    assert mine2 == [b"c"] and set(theirs2) == {b"a", b"b"}
    assert not theirs2[b"a"].is_set()
    for ev in pulls.release(mine):  # reader 1's pull ended: reader 2 wakes
        ev.set()
    assert theirs2[b"a"].is_set() and theirs2[b"b"].is_set()
    assert len(pulls) == 1  # c is still reader 2's
    assert pulls.release(mine2) and len(pulls) == 0
    assert pulls.release([b"zz"]) == []  # releasing what nobody claimed is a no-op


def test_a_key_named_twice_is_claimed_once():
    pulls = InflightPulls()
    mine, theirs = pulls.claim([b"a", b"a"], lambda k: False)
    assert mine == [b"a"] and theirs == {}


def test_concurrent_claims_give_each_chunk_exactly_one_owner():
    pulls = InflightPulls()
    lock = threading.Lock()  # the owner's lock
    owners: list[bytes] = []
    keys = [bytes([i]) for i in range(50)]

    def reader():
        with lock:
            mine, _ = pulls.claim(keys, lambda k: False)
        owners.extend(mine)

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(owners) == keys
