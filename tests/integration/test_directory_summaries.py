"""Summaries (issue 17): a long prompt's lookup reads one summary per 64-chunk bucket of its chain instead of every
chunk's entry, and gives exactly what the entries say, against a real Redis and Valkey 8."""

import random

import numpy as np
import pytest
import redis

from kvmesh.directory import (
    SUMMARY_BUCKET,
    Directory,
    pack_summary,
    unpack_summary,
)
from kvmesh.hashing import as_tokens, chunk_hashes
from kvmesh.tiers import TIER_CPU, TIER_DISK, TIER_GPU
from kvmesh.wire import NodeInfo

B = SUMMARY_BUCKET


def info(node: str) -> NodeInfo:
    return NodeInfo(node, f"kvnode-{node}", f"/dev/shm/{node}", 1024, 64)


def chain(n: int, seed: int = 0, prefix: np.ndarray | None = None) -> list[bytes]:
    """The chunk hashes of an n-chunk prompt (4 tokens a chunk), which starts with `prefix`'s tokens if given."""
    toks = np.random.default_rng(seed).integers(0, 50_000, n * 4)
    if prefix is not None:
        toks[: len(prefix)] = prefix
    return chunk_hashes(b"n" * 16, as_tokens(toks), 4)


@pytest.fixture(scope="module")
def private_redis(directory_server):
    return directory_server


@pytest.fixture
def d(private_redis):
    redis.Redis.from_url(private_redis.url).flushall()
    d = Directory(private_redis.url, prefix="t")
    yield d
    d.close()


def both(d: Directory, hashes: list[bytes]):
    """(what the summaries' lookup says, what every entry says), as the client judges them: holders and why."""
    table = d.node_table()
    got = d.longest_prefix_why(d.lookup_chained(hashes[0], hashes), table)
    want = d.longest_prefix_why(d.lookup_raw(hashes[0], hashes), table)
    return got, want


def settled(d: Directory, hashes: list[bytes]):
    """Look up twice with the summaries written in between: the second is served from them where it can be."""
    both(d, hashes)
    d.flush_summaries()
    return both(d, hashes)


def test_pack_and_unpack_a_bucket():
    a, b = b"\x02" + bytes(5), b"\x02" + bytes(4) + b"\x01" + b"\x02" + bytes(5)
    for values in ([a] * B, [a] * 10 + [b] * 50 + [None] * 4, [None] * B, [a, b] * (B // 2)):
        assert unpack_summary(pack_summary(values)) == values
    assert unpack_summary(pack_summary([a] * (B - 1))) is None  # not a whole bucket
    assert unpack_summary(b"\x09" + pack_summary([a] * B)[1:]) is None  # another version's
    assert unpack_summary(pack_summary([a] * B)[:-1]) is None  # cut short


def test_a_long_prompt_is_read_from_its_summaries_in_one_round_trip(d, private_redis):
    a = d.join(info("A"), 60_000)
    hashes = chain(512)
    d.register(a, TIER_CPU, hashes[0], hashes)
    got, want = both(d, hashes)  # the first lookup reads every entry; its summaries are written after
    assert got == want and len(got[0]) == 512 and got[1] is None
    d.flush_summaries()
    assert d.summary_counts["written"] == 1
    r = redis.Redis.from_url(private_redis.url)
    r.config_resetstat()
    values = d.lookup_chained(hashes[0], hashes)
    stats = r.info("commandstats")
    # one HMGET of the 8 buckets' summaries (and the version), one of the first chunk's entry: 10 fields, not 512,
    # in one transaction (the summaries and the entries past them as of one moment)
    others = {k for k in stats if not k.startswith(("cmdstat_config", "cmdstat_info"))}  # (Valkey: config|resetstat)
    assert stats["cmdstat_hmget"]["calls"] == 2 and others == {"cmdstat_hmget", "cmdstat_multi", "cmdstat_exec"}
    assert values == d.lookup_raw(hashes[0], hashes)
    assert d.summary_counts["hits"] == 1


@pytest.mark.parametrize("n", [B, B + 1, 2 * B - 1, 300, 513])
def test_prompts_of_any_length_and_partial_prefixes_are_exact(d, n):
    a, b = d.join(info("A"), 60_000), d.join(info("B"), 60_000)
    hashes = chain(n, seed=n)
    d.register(a, TIER_CPU, hashes[0], hashes[: n // 2])
    d.register(b, TIER_GPU, hashes[0], hashes[n // 3 : n - 1])  # overlapping holders, the last chunk missing
    got, want = settled(d, hashes)
    assert got == want and len(got[0]) == n - 1 and got[1] == "not_cached"
    d.register(a, TIER_CPU, hashes[0], hashes[n - 1 :])
    got, want = settled(d, hashes)
    assert got == want and len(got[0]) == n and got[1] is None


def test_every_change_to_the_group_is_seen_at_once(d):
    """Summaries copy entries; any write of an entry clears them, so a lookup right after a change (no waiting for
    summaries) gives the entries' new word: an unregister, another holder, a tier change, a purge."""
    a, b = d.join(info("A"), 60_000), d.join(info("B"), 60_000)
    hashes = chain(400, seed=1)
    g = hashes[0]
    d.register(a, TIER_CPU, g, hashes)
    got, want = settled(d, hashes)
    assert got == want and d.summary_counts["hits"] == 1

    d.unregister(a, g, [hashes[250]])  # evicted
    got, want = both(d, hashes)
    assert got == want and len(got[0]) == 250 and got[1] == "not_cached"

    d.register(b, TIER_GPU, g, hashes[:300])  # another holder
    got, want = settled(d, hashes)
    assert got == want and {h.node_id for h in got[0][5]} == {"A", "B"} and len(got[0]) == 400

    d.register(a, TIER_DISK, g, hashes[100:110])  # demoted: the tier in the entries changes
    got, want = both(d, hashes)
    assert got == want and {(h.node_id, h.tier) for h in got[0][105]} == {("A", TIER_DISK), ("B", TIER_GPU)}

    d.flush_summaries()
    d.purge(b.incarnation)  # (a purge ignores liveness: B is listed live still, its entries go)
    got, want = both(d, hashes)
    assert got == want and {h.node_id for h in got[0][5]} == {"A"}


def test_a_dead_holder_ends_the_prefix_where_the_entries_would(d):
    a, b = d.join(info("A"), 60_000), d.join(info("B"), 60_000)
    hashes = chain(300, seed=2)
    d.register(a, TIER_CPU, hashes[0], hashes[:200])
    d.register(b, TIER_CPU, hashes[0], hashes[150:])
    assert len(settled(d, hashes)[0][0]) == 300
    d.expire("A", a.incarnation)  # no script touches the group: liveness is the reader's
    got, want = both(d, hashes)
    assert got == want and len(got[0]) == 0 and got[1] == "holder_dead"
    d.expire("B", b.incarnation)
    got, want = both(d, hashes)
    assert got == want and got[1] == "holder_dead"


def test_branches_of_one_group_have_their_own_summaries(d):
    """Conversations that share a system prompt share a group; each one's buckets are named by its own chain."""
    a = d.join(info("A"), 60_000)
    base = chain(100, seed=3)
    shared = np.random.default_rng(3).integers(0, 50_000, 100 * 4)  # the tokens of base
    branches = [chain(260, seed=10 + i, prefix=shared[: 90 * 4]) for i in range(3)]
    assert all(br[:90] == base[:90] for br in branches) and len({br[127] for br in branches}) == 3
    for i, br in enumerate(branches):
        d.register(a, TIER_CPU, br[0], br[: 150 + 40 * i])
    for i, br in enumerate(branches):
        got, want = settled(d, br)
        assert got == want and len(got[0]) == 150 + 40 * i


def test_a_summary_read_before_a_change_is_not_written_after_it(d, private_redis):
    a = d.join(info("A"), 60_000)
    hashes = chain(128, seed=4)
    g = hashes[0]
    d.register(a, TIER_CPU, g, hashes)
    r = redis.Redis.from_url(private_redis.url)
    skey = d.summary_key(g)
    version = r.hget(skey, "v")
    values = d.lookup_raw(g, hashes)
    d.unregister(a, g, [hashes[10]])  # between the read and the write
    name = hashes[B - 1][:6]
    assert d.summaries.summarize_script(keys=[skey], args=[version, 4096, name, pack_summary(values[:B])]) == 0
    assert r.hget(skey, name) is None
    got, want = settled(d, hashes)
    assert got == want and len(got[0]) == 10


def test_small_groups_have_no_summaries_and_short_prompts_read_their_entries(d, private_redis):
    a = d.join(info("A"), 60_000)
    r = redis.Redis.from_url(private_redis.url)
    short = chain(B - 1, seed=5)
    d.register(a, TIER_CPU, short[0], short)
    assert not r.exists(d.summary_key(short[0]))  # fewer than SUMMARY_MIN entries: no version, no summaries
    got, want = settled(d, short)
    assert got == want and len(got[0]) == B - 1
    long = chain(200, seed=6)
    d.register(a, TIER_CPU, long[0], long[:B])
    assert r.hget(d.summary_key(long[0]), "v")
    d.unregister(a, long[0], long[:1])  # back below: the version and any summary go
    assert not r.exists(d.summary_key(long[0]))


def test_an_unreadable_summary_is_no_summary(d, private_redis):
    a = d.join(info("A"), 60_000)
    hashes = chain(200, seed=7)
    d.register(a, TIER_CPU, hashes[0], hashes)
    settled(d, hashes)
    r = redis.Redis.from_url(private_redis.url)
    skey = d.summary_key(hashes[0])
    r.hset(skey, hashes[2 * B - 1][:6], b"\x07garbage")  # (a later release's, or damaged)
    got, want = both(d, hashes)
    assert got == want and len(got[0]) == 200


def test_random_stores_evictions_and_deaths_give_what_the_entries_say(d, private_redis):
    """Differential: after every change of many random ones, each prompt's lookup from its summaries equals the
    lookup of every entry (holders, tiers, order and the reason the prefix ends), for the client that wrote the
    summaries and for another that reads them."""
    rng = random.Random(17)
    other = Directory(private_redis.url, prefix="t")
    d.summary_write_s = other.summary_write_s = 0.0  # (a summary write at every chance)
    nodes = {name: d.join(info(name), 60_000) for name in "ABC"}
    shared = np.random.default_rng(8).integers(0, 50_000, 70 * 4)
    prompts = [chain(rng.randrange(B, 5 * B), seed=100 + i, prefix=shared if i % 2 else None) for i in range(5)]
    for step in range(120):
        p = rng.choice(prompts)
        name = rng.choice("ABC")
        lease = nodes[name]
        i = 0 if rng.random() < 0.4 else rng.randrange(len(p))  # (prefixes: a lookup reads past chunk 0)
        j = rng.randrange(i, min(len(p), i + 250)) + 1
        op = rng.random()
        if op < 0.5:
            d.register(lease, rng.choice([TIER_GPU, TIER_CPU, TIER_DISK]), p[0], p[i:j])
        elif op < 0.85:
            d.unregister(lease, p[0], p[i:j])
        elif op < 0.93:
            d.expire(name, lease.incarnation)
            nodes[name] = d.join(info(name), 60_000)  # back as a new incarnation: the old one's entries are stale
        else:
            d.purge(lease.incarnation)
        for q in prompts:
            for reader in (d, other):
                got, want = both(reader, q)
                assert got == want, f"step {step}: prompt of {len(q)} chunks"
            d.flush_summaries()
            other.flush_summaries()
    assert d.summary_counts["hits"] > 100 and other.summary_counts["hits"] > 100, (d.summary_counts, other.summary_counts)
    # (the other client mostly read the summaries this one wrote first)
    assert other.summary_counts["hits"] > 10 * max(1, other.summary_counts["written"])
    other.close()


def test_a_read_of_every_entry_costs_the_group_once(d, private_redis):
    """Where a bucket has no summary the lookup reads every entry: the whole group (HGETALL, one pass) when it is
    at most twice the prompt, so a listpack-encoded group (up to 512 entries) is not searched once per field; the
    prompt's fields (HMGET) from a larger one."""
    r = redis.Redis.from_url(private_redis.url)
    a = d.join(info("A"), 60_000)
    d.summary_write_s = 1e9  # (no summaries: every lookup reads the entries)
    hashes = chain(200, seed=20)
    d.register(a, TIER_CPU, hashes[0], hashes[:150])
    assert r.object("encoding", d.group_key(hashes[0])) in (b"listpack", b"ziplist")
    d.lookup_chained(hashes[0], hashes)  # (writes its summaries once)
    d.flush_summaries()
    r.hdel(d.summary_key(hashes[0]), *[hashes[k * B + B - 1][:6] for k in range(3)])
    r.config_resetstat()
    values = d.lookup_chained(hashes[0], hashes)
    stats = r.info("commandstats")
    assert stats["cmdstat_hgetall"]["calls"] == 1 and stats["cmdstat_hmget"]["calls"] == 3  # + the summaries'

    assert values[:150] == d.lookup_raw(hashes[0], hashes)[:150] and values[150] is None
    for i in range(3):  # other prompts of the group: it grows past twice this prompt
        other = chain(150, seed=30 + i)
        d.register(a, TIER_CPU, hashes[0], other[1:])
    assert r.hlen(d.group_key(hashes[0])) > 2 * len(hashes)
    r.config_resetstat()
    values = d.lookup_chained(hashes[0], hashes)
    stats = r.info("commandstats")
    assert "cmdstat_hgetall" not in stats and stats["cmdstat_hmget"]["calls"] == 4
    assert values[:150] == d.lookup_raw(hashes[0], hashes)[:150] and values[150] is None


def test_the_routers_lookup_reads_summaries_too(d):
    a = d.join(info("A"), 60_000)
    hashes = chain(300, seed=40)
    d.register(a, TIER_GPU, hashes[0], hashes[:280])
    d.report_load("replica-1", "A", 1000, 2, 60_000)
    table = d.node_table()
    for _ in range(2):
        got = d.lookup_with_loads(hashes[0], hashes, table, chained=True)
        d.flush_summaries()
    want = d.lookup_with_loads(hashes[0], hashes, table)
    assert got == want and len(got[0]) == 280 and [x.replica_id for x in got[2]] == ["replica-1"]
    assert d.summary_counts["hits"] == 1


def test_a_client_that_may_only_read_reads_every_entry(d, private_redis):
    """An engine's ACL user without the right to write gets exact lookups, from every entry (one round trip, no
    summaries tried again)."""
    a = d.join(info("A"), 60_000)
    hashes = chain(200, seed=50)
    d.register(a, TIER_CPU, hashes[0], hashes[:170])
    r = redis.Redis.from_url(private_redis.url)
    r.execute_command("ACL", "SETUSER", "reader", "on", ">rpw", "~*", "&*", "+@read")
    port = redis.Redis.from_url(private_redis.url).connection_pool.connection_kwargs["port"]
    reader = Directory(f"redis://reader:rpw@127.0.0.1:{port}/0", prefix="t")
    try:
        for _ in range(3):
            values = reader.lookup_chained(hashes[0], hashes)
            reader.flush_summaries()
            assert values[:171] == d.lookup_raw(hashes[0], hashes)[:171] and values[170] is None
        assert reader.summaries_off and reader.summary_counts["written"] == 0
        assert not r.hget(d.summary_key(hashes[0]), hashes[B - 1][:6])
    finally:
        reader.close()
        r.execute_command("ACL", "DELUSER", "reader")


def test_after_its_own_store_a_client_reads_the_entries_at_once(d, private_redis):
    """A conversation's next turn: the client stored the previous turn's new chunks into the group, whose summaries
    that cleared, so its next lookup asks for the entries at once (one round trip, as before summaries)."""
    r = redis.Redis.from_url(private_redis.url)
    a = d.join(info("A"), 60_000)
    d.summary_write_s = 0.0  # (turns a second apart or more: each may write its prompt's summaries)
    hashes = chain(200, seed=60)
    d.register(a, TIER_CPU, hashes[0], hashes[:130])
    assert len(settled(d, hashes)[0][0]) == 130
    d.touched(hashes[0])  # (what the client's store says)
    d.register(a, TIER_CPU, hashes[0], hashes[130:170])  # the store lands
    r.config_resetstat()
    values = d.lookup_chained(hashes[0], hashes)
    stats = r.info("commandstats")
    assert stats["cmdstat_hmget"]["calls"] == 1 and stats["cmdstat_hgetall"]["calls"] == 1  # version; the group
    assert values[:171] == d.lookup_raw(hashes[0], hashes)[:171] and values[170] is None
    d.flush_summaries()
    got, want = both(d, hashes)  # and the summaries it wrote serve the turn after
    assert got == want and len(got[0]) == 170 and d.summary_counts["hits"] == 2
