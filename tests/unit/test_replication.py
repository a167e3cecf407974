"""`Replicas`' bookkeeping as tiny stories (its Redis count is tested with the cluster, test_replication.py)."""

import redis

from kvmesh.replication import Replicas

G = b"g" * 16
N = 100  # bytes a chunk


def k(i: int) -> bytes:
    return bytes([i]) * 16


def replicas(min_readers=2, max_bytes=0) -> Replicas:
    return Replicas(redis.Redis(port=1), "t", "node-a", min_readers, 60.0, max_bytes)  # (never connects here)


def test_below_the_threshold_nothing_is_kept_and_nothing_registered():
    r = replicas()
    assert r.admit(1, N, 3) == 0  # one reader of the group: a cold pull
    r.mark_transient([k(1), k(2), k(3)], G, N)
    changes = {(G, k(1)): 1, (G, k(2)): 1}  # what the cascade made of the two that landed
    assert r.filter_changes(changes) == {}  # transient chunks are never registered
    r.settle([k(1), k(2), k(3)], N, 0, 2, lambda key: key != k(3))
    assert r.is_transient(k(1)) and not r.is_transient(k(3))  # the one that never landed is forgotten
    assert r.replicated_bytes == 0 and r.transient_chunks == 2


def test_at_the_threshold_a_pull_is_kept_and_its_bytes_counted_until_they_leave():
    r = replicas()
    assert r.admit(2, N, 3) == 3
    changes = {(G, k(1)): 1}
    assert r.filter_changes(dict(changes)) == changes  # registered as any chunk
    r.settle([k(1), k(2), k(3)], N, 3, 2, lambda key: key != k(3))  # two landed
    assert r.replicated_chunks == 2 and r.replicated_bytes == 2 * N
    r.filter_changes({(G, k(1)): None})  # evicted: off the bound
    assert r.replicated_bytes == N and not r.is_replica(k(1)) and r.is_replica(k(2))


def test_the_byte_bound_keeps_a_leading_part_and_counts_pulls_under_way():
    r = replicas(max_bytes=5 * N)
    assert r.admit(3, N, 3) == 3  # 3 of 5 reserved while the pull runs
    assert r.admit(3, N, 3) == 2  # a concurrent pull gets what is left
    assert r.admit(3, N, 3) == 0
    r.settle([k(1), k(2), k(3)], N, 3, 1, lambda key: key == k(1))  # the first pull landed only one
    assert r.admit(3, N, 4) == 2  # the two that did not land are free again
    assert r.replicated_bytes == N


def test_one_reader_keeps_every_pull_without_asking_redis():
    r = replicas(min_readers=1)
    assert r.readers(G) == 1 and r.admit(r.readers(G), N, 2) == 2
