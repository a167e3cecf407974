"""A client beside a KVNode that names the node's own directory, spelled in
another legitimate way, must not be refused. Real redis-server (and a real Redis Cluster), real KVNode objects
(connect_local), no mocks."""

import os
import signal
import tempfile

import pytest
import redis
import torch

from kvmesh import KVSpec
from kvmesh.connecting import connect_local
from kvmesh.config import KVMeshConfig
from kvmesh.local import RedisClusterServers, RedisServer
from kvmesh.node import KVNode
from tests.conftest import wait_until

MiB = 1 << 20
SPEC = KVSpec("review-dircheck", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)


def _node(url: str, tmp_path, prefix: str = "rv") -> KVNode:
    cfg = KVMeshConfig(redis_url=url, key_prefix=prefix, cpu_bytes=4 * MiB, slot_bytes=256 * 1024, lease_s=2.0,
                       heartbeat_s=0.5, node_refresh_s=0.2, shm_dir=str(tmp_path))
    return KVNode(cfg, "ab" * 16, "kvnode-rv")


def _store_then_find(node: KVNode, client_url: str) -> int:
    """Connect beside `node` naming `client_url`; store 2 chunks; how many tokens a lookup finds."""
    c = connect_local(SPEC, node, redis_url=client_url)
    try:
        g = torch.Generator().manual_seed(7)
        toks = torch.randint(0, 50_000, (2 * SPEC.chunk_tokens,), generator=g).tolist()
        c.store(toks, torch.randn(SPEC.kv_shape(len(toks)), generator=g).to(SPEC.torch_dtype))
        c.flush()
        return c.lookup(toks, cost_model=False).num_tokens
    finally:
        c.close()


def test_the_nodes_directory_named_by_hostname_is_not_refused(tmp_path):
    """The node was started with the server's IP, the engine's config names it by host name (or the other way):
    one database. connect_local/connect raise ValueError "is not the one its KVNode registers in"."""
    with RedisServer() as rs:
        node = _node(rs.url, tmp_path)  # redis://127.0.0.1:PORT/0
        try:
            assert _store_then_find(node, rs.url.replace("127.0.0.1", "localhost")) == 2 * SPEC.chunk_tokens
        finally:
            node.shutdown()


def test_the_nodes_directory_under_another_acl_user_is_not_refused(tmp_path):
    """Nodes and engines often log in as different ACL users of one Redis (e.g. `default` with no user in the URL
    vs `default` spelled out, or a per-role user): one database, one directory."""
    with RedisServer(password="pw") as rs:
        r = redis.Redis(port=rs.port, password="pw")
        r.execute_command("ACL", "SETUSER", "engine", "on", ">pw2", "~*", "&*", "+@all")
        r.close()
        node = _node(rs.url, tmp_path)  # redis://:pw@127.0.0.1:PORT/0 (the default user)
        try:
            spelled = f"redis://default:pw@127.0.0.1:{rs.port}/0"
            assert _store_then_find(node, spelled) == 2 * SPEC.chunk_tokens
            other_user = f"redis://engine:pw2@127.0.0.1:{rs.port}/0"
            assert _store_then_find(node, other_user) == 2 * SPEC.chunk_tokens
        finally:
            node.shutdown()


def test_a_unix_socket_directory_works_at_all(tmp_path):
    """(pre-existing, redisconn.connect) README and KVMeshConfig accept unix:// URLs, but connect() rebuilds the URL
    with urlunsplit, which turns unix:///path into unix:/path: redis-py refuses it, so no node or client can use a
    unix-socket directory."""
    sock = os.path.join(tempfile.mkdtemp(prefix="kvmesh-rv-"), "redis.sock")
    with RedisServer(extra_args=("--unixsocket", sock, "--unixsocketperm", "700")):
        url = f"unix://{sock}"
        assert redis.Redis.from_url(url).ping()  # redis-py itself reads the URL
        node = _node(url, tmp_path)
        try:
            assert _store_then_find(node, url) == 2 * SPEC.chunk_tokens
        finally:
            node.shutdown()


def test_same_directory_reads_a_unix_socket_url_without_db_as_database_0():
    """same_directory takes a unix URL's socket path for its database number when ?db= is left out, so
    unix:///s and unix:///s?db=0 (one database) read as two directories, and a client is refused."""
    from kvmesh.redisconn import same_directory

    assert same_directory("unix:///run/redis/redis.sock", "unix:///run/redis/redis.sock?db=0")


def test_the_nodes_redis_cluster_named_by_another_master_is_not_refused(tmp_path):
    """`?cluster=1` takes any master's address (the others are discovered: README, redisconn.connect). A node
    started with master A's and an engine configured with master B's, or `?cluster=true`, use one directory."""
    with RedisClusterServers(masters=3) as rc:
        node = _node(rc.url, tmp_path)  # redis://127.0.0.1:<master 0>/0?cluster=1
        try:
            other_master = f"redis://127.0.0.1:{rc.servers[1].port}/0?cluster=1"
            assert _store_then_find(node, other_master) == 2 * SPEC.chunk_tokens
            assert _store_then_find(node, rc.url.replace("cluster=1", "cluster=true")) == 2 * SPEC.chunk_tokens
        finally:
            node.shutdown()



def test_a_client_of_another_database_is_still_refused(tmp_path):
    """(control: the refusal the commit wants stays) another server is another directory."""
    with RedisServer() as rs, RedisServer() as other:
        node = _node(rs.url, tmp_path)
        try:
            with pytest.raises(ValueError, match="not the one its KVNode registers in"):
                connect_local(SPEC, node, redis_url=other.url)
        finally:
            node.shutdown()


def _node_with(url: str, tmp_path, prefix: str = "rv", **kw) -> KVNode:
    opts = dict(redis_url=url, key_prefix=prefix, cpu_bytes=4 * MiB, slot_bytes=256 * 1024, lease_s=5.0,
                heartbeat_s=0.5, node_refresh_s=0.2, shm_dir=str(tmp_path))
    opts.update(kw)
    return KVNode(KVMeshConfig(**opts), "ab" * 16, "kvnode-rv")


def test_same_server_on_a_single_master_redis_cluster():
    """RedisCluster.info(target_nodes=PRIMARIES) returns the info dict itself
    (not {node: info}) when the cluster has one master (redis-py folds a single reply), so `i["run_id"]` over its
    values raises TypeError, which same_server does not catch: _check_directory (connect, connect_local) and
    mesh._check_same_directory (kvmesh.start) raise TypeError instead of answering."""
    from kvmesh.redisconn import same_server

    with RedisClusterServers(masters=1) as rc:
        assert same_server(rc.url, rc.url.replace("127.0.0.1", "localhost")) is True


def test_a_node_starts_on_a_single_master_redis_cluster(tmp_path):
    """(Membership.server_major and server_identity: the same folding) a KVNode cannot start on a one-master
    Redis Cluster: AttributeError 'str' object has no attribute 'get'."""
    with RedisClusterServers(masters=1) as rc:
        _node_with(rc.url, tmp_path).shutdown()


def test_shared_exporter_does_not_inflate_directory_errors_total(tmp_path):
    """share_counts shares the Counter and the exporter; every client's _flush_telemetry writes
    counts["directory_errors_total"] = its own view.errors. An adapter client made after an outage (0 errors)
    and the base client (N errors) flip the shared key N -> 0 -> N; the one exporter exports +N at every flip
    (negative deltas are dropped), so the directory's totals grow without bound."""
    with RedisServer() as rs:
        node = _node_with(rs.url, tmp_path, lookup_timeout_s=0.2)
        a = b = None
        try:
            a = connect_local(SPEC, node)
            os.kill(rs.proc.pid, signal.SIGSTOP)  # a directory outage while only the base client exists
            try:
                for _ in range(3):
                    a.view.refresh(direct=True)
            finally:
                os.kill(rs.proc.pid, signal.SIGCONT)
            errors = a.view.errors
            assert errors >= 3
            b = connect_local(SPEC, node)  # e.g. a LoRA adapter's client, made later
            b.share_counts(a)
            # both refreshers flush telemetry after each refresh: five of each, interleaved (each flip exported +N)
            since = (a.view.refreshes, b.view.refreshes)
            wait_until(lambda: a.view.refreshes > since[0] + 5 and b.view.refreshes > since[1] + 5, 10)
            r = rs.connect()
            total = int(r.hget("rv:{n}:totals", "directory_errors_total") or 0)
            assert total <= errors, f"{errors} directory errors exported as {total}"
        finally:
            for c in (b, a):
                if c is not None:
                    c.close()
            node.shutdown()
