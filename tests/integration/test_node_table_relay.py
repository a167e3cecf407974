"""The node table reaches a node's clients through its KVNode (nodeview.TableFile): Redis serves one table reader
per node, not one per client; a client whose node stopped relaying, or whose directory is gone, still sees it."""

import os

import pytest
import redis

from kvmesh.connecting import connect_local
from kvmesh.local import RedisServer
from kvmesh.tiers.build import remove_stale_slabs
from kvmesh.spec import KVSpec
from tests.conftest import wait_until

SLOT = 4096
SPEC = KVSpec("relay-test-model", 2, 2, 8, "float16", chunk_tokens=16)
REFRESH_S = 0.25


class Counted:
    """Counts a Directory's node-table reads (the real script on the real server, only counted)."""

    def __init__(self, directory) -> None:
        self.calls = 0
        self._read = directory.members.table_script
        directory.members.table_script = self

    def __call__(self, **kw):
        self.calls += 1
        return self._read(**kw)


@pytest.fixture
def two_nodes(private_redis, make_node):
    redis.Redis.from_url(private_redis.url).flushall()
    # refreshes every 0.25 s: a relay counts as stale after two missed ones (0.5 s), which a loaded 2-core box's
    # scheduler does not reach by accident (at 0.1 s it did, and the clients rightly read Redis themselves)
    cfg = make_node.config(redis_url=private_redis.url, key_prefix="tr", cpu_bytes=8 * SLOT, slot_bytes=SLOT,
                           lease_s=3.0, node_refresh_s=REFRESH_S)
    return (make_node("node-a" * 4, "kvnode-a", config=cfg, wire=True),
            make_node("node-b" * 4, "kvnode-b", config=cfg, wire=True))


def test_clients_read_the_table_their_node_relays_and_redis_when_it_stops(two_nodes):
    a, b = two_nodes
    clients = [connect_local(SPEC, a.node) for _ in range(3)]
    try:
        reads = [Counted(c.directory) for c in clients]
        # a client reads Redis itself when it starts, and again while A's relay is older than that read: until A
        # refreshed once after the clients started, and each client read that relay
        relayed = a.view.refreshes
        wait_until(lambda: a.view.refreshes > relayed + 1, 5)
        since = [c.view.refreshes for c in clients]
        wait_until(lambda: all(c.view.refreshes > n + 1 for c, n in zip(clients, since)), 5)
        for r in reads:
            assert r.calls <= 2
            r.calls = 0
        since = [c.view.refreshes for c in clients]
        wait_until(lambda: all(c.view.refreshes >= n + 6 for c, n in zip(clients, since)), 10)  # six of each's
        for c, r in zip(clients, reads):
            assert set(c.view.table().by_node()) == {a.node_id, b.node_id}
            assert c.view.age_s < 3 * REFRESH_S and c.view.allow()
            assert r.calls == 0  # none of them asked Redis: node A did, for all three
        assert os.path.exists(a.view.publish.path)
        # B leaves: the clients learn it from A's relay
        b.shutdown()
        wait_until(lambda: all(set(c.view.table().by_node()) == {a.node_id} for c in clients), 3)
        assert all(r.calls == 0 for r in reads)
        # A dies without a word (its relay file stays, and goes stale): the clients read Redis themselves
        a.kill()
        wait_until(lambda: all(r.calls > 0 for r in reads), 3)
        assert all(c.view.age_s < 3 * REFRESH_S for c in clients)
    finally:
        for c in clients:
            c.close()


def test_a_relayed_table_does_not_hide_a_dead_directory(make_node):
    server = RedisServer()
    try:
        a = make_node("node-a" * 4, "kvnode-a", wire=True, redis_url=server.url, key_prefix="tr", cpu_bytes=8 * SLOT,
                      slot_bytes=SLOT, node_refresh_s=0.1, lookup_timeout_s=0.3)
        c = connect_local(SPEC, a.node)
        try:
            wait_until(lambda: c.view.age_s < 0.3, 3)
            server.kill()
            # A's refreshes fail, its relay goes stale, the client's own read fails: its breaker opens
            wait_until(lambda: not c.view.allow(), 5)
        finally:
            c.close()
            a.kill()
    finally:
        server.stop()
    assert remove_stale_slabs(make_node.shm_dir) == 0  # (A's process is this one: its files are not stale)


def test_a_node_that_joined_after_the_relayed_table_counts_as_a_holder_at_once(private_redis, make_node):
    # The relay refreshes every 5 s here: it is surely older than node C. An entry naming C's (newer) incarnation
    # makes the client read the table from Redis then, instead of calling the prefix uncached until its refresh.
    import torch

    redis.Redis.from_url(private_redis.url).flushall()
    cfg = make_node.config(redis_url=private_redis.url, key_prefix="tr", cpu_bytes=8 * SLOT, slot_bytes=SLOT,
                           lease_s=20.0, heartbeat_s=1.0, node_refresh_s=5.0)
    a = make_node("node-a" * 4, "kvnode-a", config=cfg, wire=True)
    reader_client = connect_local(SPEC, a.node)
    wait_until(lambda: a.view.refreshes >= 1, 5)  # A relayed its first table
    reader_client.view.refresh()  # from A's relay, which predates C
    c = make_node("node-c" * 4, "kvnode-c", config=cfg, wire=True)
    writer = connect_local(SPEC, c.node)
    try:
        assert c.node_id not in reader_client.view.table().by_node()
        toks = list(range(100, 148))
        kv = torch.randn(SPEC.kv_shape(len(toks))).to(torch.float16)
        assert writer.store(toks, kv) == 3
        wait_until(lambda: writer.lookup(toks).num_chunks == 3, 5)
        match = reader_client.lookup(toks)
        assert match.num_chunks == 3
        got = reader_client.fetch(match)
        assert torch.equal(got, kv[:, :, :48])
    finally:
        for cl in (reader_client, writer):
            cl.close()
        for n in (a, c):
            n.shutdown()


def test_a_dead_nodes_relay_temp_file_is_removed_with_its_slab(tmp_path):
    """A KVNode killed while it replaced its relay (`<slab>.nodes.<pid>.<thread>`, then os.replace) left the temp
    file in /dev/shm for good: one more per such crash (one was on this machine, found by the restart hunt)."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # a process that is gone, as a KVNode killed with SIGKILL
    base = f"kvmesh-3ae66db838b03856-{p.pid}-f50fd687"
    for name in (base, base + ".nodes", f"{base}.nodes.{p.pid}.140457468212928", "other-file"):
        (tmp_path / name).write_bytes(b"x")
    assert remove_stale_slabs(str(tmp_path)) == 3
    assert sorted(os.listdir(tmp_path)) == ["other-file"]
