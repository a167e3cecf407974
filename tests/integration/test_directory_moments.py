"""The directory across Redis restarts from snapshots, an emptied Redis, node restarts and clean shutdowns: nothing
held is lost from it, nothing gone stays in it, and no node is confused with another or with its old self. Real
redis-servers of the tests' own (restarted with their data: SAVE, then `RedisServer.restart`, which reloads the
snapshot), KVNode objects in this process."""

import time

import numpy as np
import pytest

from kvmesh.directory import Directory
from kvmesh.local import RedisServer
from kvmesh.node import KVNode
from kvmesh.tiers import checksum
from kvmesh.wire import StoreItem
from tests.conftest import wait_until

SLOT = 4096


@pytest.fixture
def server():
    s = RedisServer()
    yield s
    s.stop()


@pytest.fixture
def nodes(server, make_node):
    def make(name: str, lease_s: float = 2.0, heartbeat_s: float = 0.2) -> KVNode:
        return make_node(name * 4, f"kvnode-{name}-{len(make_node.made)}", redis_url=server.url, key_prefix="dm",
                         cpu_bytes=32 * SLOT, slot_bytes=SLOT, lease_s=lease_s, heartbeat_s=heartbeat_s)

    return make


def store(node: KVNode, g: int, n: int = 4) -> list[bytes]:
    keys = [bytes([g % 256, j]) + bytes(14) for j in range(n)]
    keys[0] = g.to_bytes(16, "little")
    data = [np.full(SLOT, (g + j) % 251, dtype=np.uint8) for j in range(n)]
    node.store([StoreItem(keys[0], k, SLOT, checksum(d)) for k, d in zip(keys, data)], np.concatenate(data))
    return keys


def found(d: Directory, keys: list[bytes]) -> int:
    import redis

    for attempt in range(2):  # a per-thread connection to a restarted Redis fails once (a miss), then reconnects
        try:
            return len(d.longest_prefix(d.lookup_raw(keys[0], keys), d.node_table()))
        except redis.ConnectionError:
            if attempt:
                raise
    return 0


def test_a_node_is_not_fenced_by_its_own_older_incarnation_in_a_restored_snapshot(server, nodes):
    # the snapshot names incarnation 1; the node re-joined as 2 after a first restart, and Redis crashed again
    # before its next snapshot: incarnation 1 is back in the table. Before, the heartbeat said "fenced" (another
    # incarnation = a newer one) and the live node stopped registering for good
    node = nodes("node-a")
    first = node.lease.incarnation
    store(node, 1)
    r = server.connect()
    r.save()
    r.close()
    server.restart()
    wait_until(lambda: node.lease.incarnation != first, 10)
    server.restart()
    time.sleep(2.5)  # over a lease: every heartbeat since met incarnation 1
    assert not node.fenced
    keys = store(node, 2)
    d = Directory(server.url, "dm")
    wait_until(lambda: found(d, keys) == 4, 10)
    node.check_integrity(directory=True)
    d.close()


def test_readers_see_the_new_incarnations_after_a_restore_brings_the_membership_version_back(server, nodes):
    # the snapshot has version v with rows a1, b1; a join and a leave after it, then the restore and the re-joins,
    # brought a counted version back to a value readers had cached with other rows: they kept a1 and b1 for good
    a, b = nodes("node-a"), nodes("node-b")
    ka, kb = store(a, 1), store(b, 2)
    r = server.connect()
    r.save()
    r.close()
    nodes("node-c").shutdown()  # a join and a leave after the snapshot
    reader = Directory(server.url, "dm")  # a long-lived reader, as a client's
    assert found(reader, ka) == 4 and found(reader, kb) == 4
    old = (a.lease.incarnation, b.lease.incarnation)
    time.sleep(0.5)
    server.restart()
    wait_until(lambda: a.lease.incarnation != old[0] and b.lease.incarnation != old[1], 10)
    assert a.registrar.flush(5) and b.registrar.flush(5)
    wait_until(lambda: found(reader, ka) == 4 and found(reader, kb) == 4, 5)
    wait_until(lambda: set(a.view.table().live) >= {a.lease.incarnation, b.lease.incarnation}, 5)  # (its relay)
    reader.close()


def test_an_emptied_redis_that_hands_a_node_anothers_old_incarnation_loses_none_of_its_entries(server, nodes):
    # after FLUSHALL, A re-joins first and may get B's old number; B's re-join then purged its "old" incarnation,
    # which was A's current one: A's entries vanished for good
    a = nodes("node-a")
    b = nodes("node-b", lease_s=4.0, heartbeat_s=1.0)
    prompts = [store(a, g) for g in range(3)]
    old_b = b.lease.incarnation
    r = server.connect()
    r.flushall()
    a.registrar.heartbeat_now()
    wait_until(lambda: b.lease.incarnation != old_b and not a.registrar.pending and not b.registrar.pending, 10)
    # whether or not the numbers collided this time, the purge of B's old incarnation must not touch A's entries
    r.close()
    rounds = (a.janitor.rounds, b.janitor.rounds)  # B's re-join named its old incarnation for its janitor's purge
    wait_until(lambda: a.janitor.rounds > rounds[0] + 1 and b.janitor.rounds > rounds[1] + 1, 10)  # a whole round since
    d = Directory(server.url, "dm")
    assert [found(d, k) for k in prompts] == [4, 4, 4]
    a.check_integrity(directory=True)
    d.close()


def test_a_purge_skips_an_incarnation_that_is_now_another_nodes(server, nodes):
    # the same story, made to collide: node A's own earlier incarnation number is node B's current one
    a, b = nodes("node-a"), nodes("node-b")
    kb = store(b, 7)
    a.janitor.purge_later([b.lease.incarnation])
    a.janitor.round()
    d = Directory(server.url, "dm")
    assert found(d, kb) == 4 and a.stats()["purge_skipped_reissued"] == 1
    b.check_integrity(directory=True)
    d.close()


def test_a_node_that_shuts_down_leaves_no_purge_index_behind(server, nodes):
    r = server.connect()
    for round_ in range(3):
        node = nodes("node-a")
        for g in range(5):
            store(node, 100 * round_ + g)
        node.check_integrity(directory=True)
        node.shutdown()
    assert not list(r.scan_iter("dm:g:*")) and not list(r.scan_iter("dm:o:*"))
    r.close()


def test_what_a_superseded_process_registered_after_its_purge_is_taken_out_when_it_learns_it(server, nodes):
    # two processes of one node id: the new one purged the old incarnation at once; the old one stored more before
    # its next heartbeat told it it was fenced, and those entries named a superseded incarnation for good
    r = server.connect()
    old = nodes("node-a", lease_s=10.0, heartbeat_s=3.0)
    store(old, 1)
    new = nodes("node-a")
    superseded = old.lease.incarnation
    wait_until(lambda: new.janitor.rounds >= 1, 10)  # its first round purged the old incarnation (named at start)
    for g in range(2, 6):
        store(old, g)
    wait_until(lambda: old.fenced, 10)
    store(new, 50)
    new.check_integrity(directory=True)

    def naming_superseded() -> int:
        return sum(any(i == superseded for i, _ in new.directory.decode_holders(v))
                   for k in r.scan_iter("dm:g:*") for v in r.hvals(k))

    wait_until(lambda: naming_superseded() == 0, 5)
    r.close()


def test_a_join_of_its_own_whose_reply_was_lost_does_not_fence_the_node(server, nodes):
    """A re-join (after Redis lost the node) runs in Redis, but its reply never reaches the node (a timeout: Redis
    is slow just then). The node kept its old incarnation, its next heartbeat found a newer one and it fenced
    itself for good: it stopped registering and purged its own entries, though it is its node's only process.
    The newer incarnation's record is its own: it re-joins instead (found by the restart hunt)."""
    node = nodes("node-j")
    keys = store(node, 1)
    d = Directory(server.url, "dm")
    try:
        wait_until(lambda: found(d, keys) == 4, 5)
        before = node.lease.incarnation
        lost = d.join(node.info, 10_000, before)  # what the lost join did in Redis: the node never learnt it
        assert lost.incarnation > before
        wait_until(lambda: node.lease.incarnation > lost.incarnation, 5)  # it re-joined (not fenced)
        assert not node.fenced
        more = store(node, 2)
        wait_until(lambda: found(d, keys) == 4 and found(d, more) == 4, 5)  # what it holds is listed again
        node.check_integrity(directory=True)
    finally:
        d.close()


def test_another_process_of_the_node_still_fences_it(server, nodes):
    old = nodes("node-k", lease_s=10.0, heartbeat_s=0.3)
    store(old, 1)
    new = nodes("node-k")
    wait_until(lambda: old.fenced, 10)
    assert not new.fenced


def test_an_entry_full_of_holders_never_drops_a_live_one_and_lists_a_refused_one_once_there_is_room(server, nodes):
    # MAX_HOLDERS per chunk. Before, a ninth holder pushed out the oldest, live or not, which never learned it:
    # once the others died and were purged, the live holder's chunk was never found again
    from kvmesh.directory import MAX_HOLDERS
    from kvmesh.wire import NodeInfo

    first = nodes("node-f")
    d = Directory(server.url, "dm")
    keys = store(first, 7)
    others = []
    for i in range(MAX_HOLDERS):  # short-lived holders of the same prompt (0.5-s leases), which then die
        lease = d.join(NodeInfo(f"tmp{i}", f"kvnode-tmp{i}", f"/dev/shm/tmp{i}", 1024, 64), 500)
        others.append(lease)
        d.register(lease, 1, keys[0], keys)
    assert len(d.decode_holders(d.lookup_raw(keys[0], keys)[0])) == MAX_HOLDERS  # the live one is kept
    late = nodes("node-l")  # a live holder that comes when the entry is full: refused, tried again later
    assert store(late, 7) == keys and late.registrar.flush(5)
    assert late.registrar.unlisted() == {(keys[0], k) for k in keys}
    late.check_integrity(directory=True)  # (its unlisted chunks are known as such)
    # the short-lived ones lapse, a janitor purges them, and late is listed at a heartbeat once there is room
    wait_until(lambda: not late.registrar.unlisted(), 10)
    holders = {h.node_id for h in d.longest_prefix(d.lookup_raw(keys[0], keys), d.node_table())[0]}
    assert holders == {first.node_id, late.node_id} and found(d, keys) == 4
    for n in (first, late):
        n.check_integrity(directory=True)
    d.close()


def test_a_chunk_dropped_while_a_reregistration_fails_part_way_is_not_left_listed(server, nodes):
    # a re-registration (after a resync) that reached one Redis server of a cluster and failed on another leaves
    # the first server's entries written; a chunk dropped meanwhile was queued as an unregister. Before, the next
    # round's re-registration emptied the queue with its snapshot (which no longer names the chunk) and the entry
    # stayed listed for good: a phantom
    import redis

    node = nodes("node-p")
    a, b = store(node, 1), store(node, 2)
    real = node.directory.register_many
    failed = []

    def part_way(lease, tier, groups):
        if failed:
            return real(lease, tier, groups)
        failed.append(True)
        real(lease, tier, {g: ks for g, ks in groups.items() if g == a[0]})  # (one server answered)
        node.serving.drop_corrupt([a[2]])  # (a chunk of it goes meanwhile: its unregister is queued)
        raise redis.ConnectionError("the other server did not answer")

    node.directory.register_many = part_way
    r = server.connect()
    r.delete(*r.keys("dm:{n}:*"))  # the node keys lost: the next heartbeat re-joins and registers all again
    r.close()
    wait_until(lambda: failed and not node.registrar.pending, 10)
    del node.directory.register_many
    node.check_integrity(directory=True)  # listed is exactly what is held
    d = Directory(server.url, "dm")
    assert found(d, a) == 2 and found(d, b) == 4
    d.close()


def test_a_step_back_of_redis_clock_does_not_keep_a_dead_node_live(server):
    # Lease deadlines are times on Redis's clock. The state just after that clock stepped back an hour: the last
    # reading the lease scripts saw, and the deadline of a node B that died moments before, are an hour ahead of
    # it. Before, B was listed live (its chunks served as held) for the hour; now the next heartbeat of any live
    # node moves every deadline back by the step, and B lapses within its lease
    from kvmesh.wire import NodeInfo

    d = Directory(server.url, "ck")
    a = d.join(NodeInfo("A" * 8, "kvnode-a", "/dev/shm/a", 1024, 64), 2000)
    b = d.join(NodeInfo("B" * 8, "kvnode-b", "/dev/shm/b", 1024, 64), 2000)
    r = server.connect()
    hour = 3_600_000
    sec, us = r.time()
    r.set("ck:{n}:clock", sec * 1000 + us // 1000 + hour)
    r.zadd("ck:{n}:lease", {"B" * 8: r.zscore("ck:{n}:lease", "B" * 8) + hour})
    assert b.incarnation in d.node_table().live
    deadline = time.monotonic() + 6
    while b.incarnation in d.node_table().live:
        assert time.monotonic() < deadline, "B still live"
        assert d.heartbeat(a, 2000) == "ok"
        time.sleep(0.2)
    assert a.incarnation in d.node_table().live
    r.close()
    d.close()
