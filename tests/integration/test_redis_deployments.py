"""The directory on the Redis deployments operators run: a real 3-master Redis Cluster, AUTH (requirepass and ACL
users) and TLS (rediss://). Each story runs real KVNodes or the real directory against real redis-servers."""

import numpy as np
import pytest
import redis

from kvmesh import redisconn
from kvmesh.config import KVMeshConfig
from kvmesh.directory import Directory
from kvmesh.local import RedisClusterServers, RedisServer, tls_redis_server_binary
from kvmesh.node import KVNode
from kvmesh.tiers import TIER_CPU, checksum
from kvmesh.wire import NodeInfo, StoreItem
from tests.conftest import DIRECTORY_SERVERS, server_binary, wait_until

SLOT = 4096


def info(node: str) -> NodeInfo:
    return NodeInfo(node, f"kvnode-{node}", f"/dev/shm/{node}", 1024, 64)


def group(i: int) -> bytes:
    return i.to_bytes(16, "little")


def chunk_keys(g: int, n: int) -> list[bytes]:
    return [bytes([g % 256, j % 256]) + bytes(14) for j in range(n)]


def run_node(url: str, tmp_path, name: str = "node-r" * 4) -> KVNode:
    cfg = KVMeshConfig(redis_url=url, key_prefix="rd", cpu_bytes=32 * SLOT, slot_bytes=SLOT, lease_s=2.0,
                       heartbeat_s=0.2, shm_dir=str(tmp_path))
    return KVNode(cfg, name, "kvnode-r")


def store_prompt(node: KVNode, g: int, n: int) -> list[bytes]:
    keys = chunk_keys(g, n)
    keys[0] = group(g)
    datas = [np.full(SLOT, (g + j) % 251, dtype=np.uint8) for j in range(n)]
    node.store([StoreItem(keys[0], key, SLOT, checksum(d)) for key, d in zip(keys, datas)],
               np.concatenate(datas))
    return keys


def holders(d: Directory, keys: list[bytes]) -> int:
    return len(d.longest_prefix(d.lookup_raw(keys[0], keys), d.node_table()))


# -- Redis Cluster ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=DIRECTORY_SERVERS)
def redis_cluster(request):
    with RedisClusterServers(masters=3, binary=server_binary(request.param)) as c:
        yield c


def test_a_lookup_touches_one_cluster_slot_and_prompts_spread_over_masters(redis_cluster):
    d = Directory(redis_cluster.url, prefix="rc1")
    a = d.join(info("A"), 10_000)
    keys = {g: chunk_keys(g, 64) for g in range(24)}
    for g, ks in keys.items():
        d.register(a, TIER_CPU, group(g), ks)
    masters = [redis.Redis(port=s.port) for s in redis_cluster.servers]
    for m in masters:
        m.config_resetstat()
    for g, ks in keys.items():
        assert len(d.longest_prefix(d.lookup_raw(group(g), ks), d.node_table())) == 64
    calls = [m.info("commandstats").get("cmdstat_hmget", {}).get("calls", 0) for m in masters]
    assert sum(calls) == len(keys)  # one HMGET per lookup, whatever the prompt's length
    assert sum(1 for c in calls if c) == 3  # 24 prompts landed on all three masters
    owners = {redis.Redis(port=redis_cluster.servers[0].port).cluster("KEYSLOT", d.group_key(group(g)))
              for g in keys}
    assert len(owners) == len(keys)  # different first chunks, different slots
    # every master's listpack setting is read: one set above Redis's default is named
    assert d.encoding_advice() is None
    try:
        masters[1].config_set("hash-max-ziplist-entries", 4096)
        assert "4096" in (d.encoding_advice() or "")
    finally:
        masters[1].config_set("hash-max-ziplist-entries", 512)
    d.close()


def test_a_long_prompts_summaries_live_on_its_groups_slot(redis_cluster):
    """Summaries and their group share a slot: the group scripts (two keys), the summary write and the lookup's
    pipelined HMGETs run on one master of the cluster, and a lookup from them says what the entries say."""
    from kvmesh.hashing import as_tokens, chunk_hashes

    d = Directory(redis_cluster.url, prefix="rc4")
    a = d.join(info("A"), 10_000)
    table = d.node_table()
    for seed in range(6):  # (prompts on every master)
        hashes = chunk_hashes(b"c" * 16, as_tokens(np.random.default_rng(seed).integers(0, 9999, 4 * 300)), 4)
        d.register(a, TIER_CPU, hashes[0], hashes[:250])
        for _ in range(2):
            assert len(d.longest_prefix(d.lookup_chained(hashes[0], hashes), table)) == 250
            d.flush_summaries()
        d.unregister(a, hashes[0], hashes[100:101])
        assert len(d.longest_prefix(d.lookup_chained(hashes[0], hashes), table)) == 100
    d.flush_summaries()
    assert d.summary_counts["hits"] == 6 and d.summary_counts["written"] == 12
    d.close()


def test_cluster_node_table_fencing_and_resync(redis_cluster):
    d = Directory(redis_cluster.url, prefix="rc2")
    old = d.join(info("A"), 10_000)
    d.register_many(old, TIER_CPU, {group(1): chunk_keys(1, 4), group(2): chunk_keys(2, 4)})
    assert len(d.longest_prefix(d.lookup_raw(group(1), chunk_keys(1, 4)), d.node_table())) == 4
    new = d.join(info("A"), 10_000)  # a restart: the old incarnation is fenced
    assert d.heartbeat(old, 10_000) == "fenced" and d.heartbeat(new, 10_000) == "ok"
    assert d.longest_prefix(d.lookup_raw(group(2), chunk_keys(2, 4)), d.node_table()) == []
    for s in redis_cluster.servers:  # every master loses its data
        redis.Redis(port=s.port).flushall()
    assert d.heartbeat(new, 10_000) == "resync" and d.node_table().live == {}
    d.close()


def test_kvnodes_store_and_serve_through_a_redis_cluster(redis_cluster, tmp_path):
    node = run_node(redis_cluster.url, tmp_path)
    try:
        prompts = [store_prompt(node, g, 3) for g in range(6)]
        wait_until(lambda: all(holders(node.directory, ks) == 3 for ks in prompts), 5)
        d = Directory(redis_cluster.url, prefix="rd")
        assert [holders(d, ks) for ks in prompts] == [3] * 6
        d.close()
    finally:
        node.shutdown()


def migrate_slot(cluster, slot: int, src_port: int, dst_port: int, finish: bool = True) -> None:
    """Move `slot` and its keys from the master at src_port to the one at dst_port, as `redis-cli --cluster
    reshard` does; `finish=False` stops with the keys moved and the slot still migrating (readers get ASK)."""
    src, dst = redis.Redis(port=src_port), redis.Redis(port=dst_port)
    dst.cluster("SETSLOT", slot, "IMPORTING", src.cluster("MYID"))
    src.cluster("SETSLOT", slot, "MIGRATING", dst.cluster("MYID"))
    while keys := src.cluster("GETKEYSINSLOT", slot, 100):
        src.migrate("127.0.0.1", dst_port, keys, 0, 5000)
    if finish:
        for s in cluster.servers:
            redis.Redis(port=s.port).cluster("SETSLOT", slot, "NODE", dst.cluster("MYID"))


def test_a_resharding_moves_a_groups_slot_and_the_directory_follows(redis_cluster):
    # readers and writers keep the slot map they learned: after a resharding moved a group (MOVED), and while it
    # is moving (ASK), they follow the redirect instead of missing (and failing the directory) for good
    d = Directory(redis_cluster.url, prefix="rc3")
    a = d.join(info("A"), 10_000)
    ks, other = chunk_keys(31, 4), chunk_keys(32, 4)
    d.register_many(a, TIER_CPU, {group(31): ks, group(32): other})
    table = d.node_table()
    assert len(d.longest_prefix(d.lookup_raw(group(31), ks), table)) == 4
    any_master = redis.Redis(port=redis_cluster.servers[0].port)
    slot = any_master.cluster("KEYSLOT", d.group_key(group(31)))
    src = next(s.port for s in redis_cluster.servers if int(slot) in _slots_of(s.port))
    dst = next(s.port for s in redis_cluster.servers if s.port != src)
    migrate_slot(redis_cluster, slot, src, dst, finish=False)
    assert len(d.longest_prefix(d.lookup_raw(group(31), ks), table)) == 4  # ASK
    migrate_slot(redis_cluster, slot, src, dst)
    assert len(d.longest_prefix(d.lookup_raw(group(31), ks), table)) == 4  # MOVED, then the new owner
    assert len(d.longest_prefix(d.lookup_raw(group(31), ks), table)) == 4
    assert d.redirects == 2
    holders_, why, _loads = d.lookup_with_loads(group(31), ks, table)
    assert len(holders_) == 4
    # writes: a resync's pipelined registers, and a purge, reach the moved group too
    b = Directory(redis_cluster.url, prefix="rc3")
    b.join(info("B"), 10_000)  # (its slot map is the new one; `d`'s moved on with the redirect)
    migrate_slot(redis_cluster, slot, dst, src)
    assert d.register_many(a, TIER_CPU, {group(31): chunk_keys(33, 4), group(32): other}) == {}
    assert d.purge(a.incarnation) == 12
    assert d.longest_prefix(d.lookup_raw(group(31), ks), d.node_table()) == []
    d.close()
    b.close()


def _slots_of(port: int) -> set[int]:
    me = redis.Redis(port=port).cluster("MYID")
    out: set[int] = set()
    for lo, hi, master, *_ in redis.Redis(port=port).execute_command("CLUSTER SLOTS"):
        if redis.Redis(host=master[0], port=master[1]).cluster("MYID") == me:
            out.update(range(lo, hi + 1))
    return out


# -- AUTH and ACL users ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", DIRECTORY_SERVERS)
@pytest.mark.parametrize("user", [None, "kvmesh"], ids=["requirepass", "acl-user"])
def test_auth_works_with_the_password_and_fails_clearly_without(user, kind, tmp_path):
    with RedisServer(user=user, password="s3cret-pw", binary=server_binary(kind)) as server:
        node = run_node(server.url, tmp_path)
        try:
            keys = store_prompt(node, 7, 2)
            wait_until(lambda: holders(node.directory, keys) == 2, 5)
        finally:
            node.shutdown()
        wrong = server.url.replace("s3cret-pw", "wrong")
        with pytest.raises(redis.AuthenticationError):
            Directory(wrong, prefix="rd").node_table()
        anonymous = f"redis://127.0.0.1:{server.port}/0"
        with pytest.raises((redis.AuthenticationError, redis.ResponseError)):  # NOAUTH is a ResponseError
            Directory(anonymous, prefix="rd").node_table()


# -- TLS -------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    trustme = pytest.importorskip("trustme")
    d = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_pem.write_to_path(str(d / "server.key"))
    cert.cert_chain_pems[0].write_to_path(str(d / "server.crt"))
    ca.cert_pem.write_to_path(str(d / "ca.crt"))
    other = trustme.CA()  # a CA the server's certificate does not chain to
    other.cert_pem.write_to_path(str(d / "other-ca.crt"))
    return str(d / "server.crt"), str(d / "server.key"), str(d / "ca.crt"), str(d / "other-ca.crt")


def test_tls_directory_verifies_the_server_and_serves(tls_files, tmp_path, monkeypatch):
    binary = tls_redis_server_binary()
    if binary is None:
        pytest.fail("no redis-server with TLS on this machine: `make test` installs Debian's redis-server")
    cert, key, ca, other_ca = tls_files
    with RedisServer(tls=(cert, key, ca), password="tls-pw", binary=binary) as server:
        assert server.url.startswith("rediss://")
        node = run_node(server.url, tmp_path)
        try:
            keys = store_prompt(node, 9, 2)
            wait_until(lambda: holders(node.directory, keys) == 2, 5)
        finally:
            node.shutdown()
        with pytest.raises(redis.ConnectionError):  # an untrusted certificate is refused, not used
            Directory(server.url.replace(ca, other_ca), prefix="rd").node_table()
        # a URL that names no CA (one kept whole in a Secret) takes $KVMESH_REDIS_CA_CERTS; a URL's own CA wins
        bare = server.url.split("?")[0]
        monkeypatch.setenv(redisconn.CA_ENV, ca)
        assert Directory(bare, prefix="rd").node_table() is not None
        with pytest.raises(redis.ConnectionError):
            Directory(server.url.replace(ca, other_ca), prefix="rd").node_table()
        monkeypatch.setenv(redisconn.CA_ENV, other_ca)
        with pytest.raises(redis.ConnectionError):
            Directory(bare, prefix="rd").node_table()
        with pytest.raises(redis.ConnectionError):  # plaintext to a TLS port does not talk
            Directory(f"redis://:tls-pw@127.0.0.1:{server.port}/0", prefix="rd", timeout_s=1.0).node_table()
