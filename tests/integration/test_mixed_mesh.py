"""One mesh whose parts differ: a node of another transport, a node record of a later release, a client that names
another directory than its node's, a node whose heartbeat is shorter than its own start. Real redis-server, the
tests' real Ray cluster and mesh (a node added for the transport story)."""

import threading
import time

import msgpack
import pytest
import torch

import kvmesh
from kvmesh import KVSpec
from kvmesh.config import KVMeshConfig
from kvmesh.directory import Directory
from kvmesh.local import RedisServer
from tests.conftest import wait_until
from tests.integration.conftest import on_node

MiB = 1 << 20
SPEC = KVSpec("mixed-mesh", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)
OPTS = dict(cpu_bytes=16 * MiB, slot_bytes=256 * 1024, lease_s=2.0, heartbeat_s=0.5, node_refresh_s=0.2,
            fetch_timeout_s=5.0)


def prompt(seed: int, chunks: int = 3):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 50_000, (chunks * SPEC.chunk_tokens,), generator=g).tolist()
    return toks, torch.randn(SPEC.kv_shape(len(toks)), generator=g).to(SPEC.torch_dtype)


def w_store(toks, kv, **options):
    c = kvmesh.connect(SPEC, **options)
    try:
        assert c.store(toks, kv) == len(toks) // SPEC.chunk_tokens
        return c.flush(), c.config.peer_transport
    finally:
        c.close()


def w_fetch(toks):
    c = kvmesh.connect(SPEC)
    try:
        m = c.lookup(toks, cost_model=False)
        kv = c.fetch(m)
        return m.num_tokens, kv, c.last_fetch.error, c.config.peer_transport
    finally:
        c.close()


def test_chunks_of_a_node_that_serves_through_ray_only_are_read_by_tcp_nodes(mesh, ray_cluster):
    """A second `kvmesh.start` (the keeper, after a config change) places a node that joined later with
    `peer_transport="ray"`: its record has no data-server address. Readers on the mesh's tcp nodes found its chunks
    and then got none of them, every fetch ending `holder_unknown`, for good. They read it through Ray."""
    import ray

    from kvmesh.mesh import node_actors

    first = ray_cluster.node_ids()[0]
    node = ray_cluster.add_node(num_cpus=1)
    try:
        kvmesh.start(config=mesh.config.replace(peer_transport="ray"))  # (a KVNode on the new node only)
        assert node.node_id in node_actors()
        toks, kv = prompt(1)
        assert on_node(node.node_id, w_store, toks, kv) == (3, "ray")
        n, got, error, transport = on_node(first, w_fetch, toks)
        assert transport == "tcp" and n == 3 * SPEC.chunk_tokens
        assert got.shape[2] == n, f"fetched {got.shape[2]} of {n} tokens: {error}"
        assert torch.equal(got.view(torch.int16), kv.view(torch.int16))
        # and the other way: the ray node reads the tcp node's chunks
        toks2, kv2 = prompt(2)
        assert on_node(first, w_store, toks2, kv2) == (3, "tcp")
        n, got, error, _ = on_node(node.node_id, w_fetch, toks2)
        assert n == 3 * SPEC.chunk_tokens and torch.equal(got.view(torch.int16), kv2.view(torch.int16)), error
    finally:
        actor = node_actors().get(node.node_id)
        if actor is not None:
            ray.kill(actor, no_restart=True)  # its detached actor's name would outlive the node
        ray_cluster.remove_node(node, graceful=True)


class _NewerNodeInfo:
    """The record a KVNode of a later release (NodeInfo wire version 2, one more field) writes when it joins."""

    node_id = "f" * 56

    def pack(self) -> bytes:
        return msgpack.packb([2, self.node_id, "kvnode-f", "/dev/shm/kvmesh-x", 16 * MiB, 256 * 1024,
                              "127.0.0.1:1", "a field of version 2"], use_bin_type=True)


def w_lookup_fetch(toks):
    c = kvmesh.connect(SPEC)
    try:
        m = c.lookup(toks, cost_model=False)
        kv = c.fetch(m)
        return m.num_tokens, kv.shape[2], c.last_fetch.error
    finally:
        c.close()


def _rounds(actor) -> tuple[int, int]:
    return actor.node.janitor.rounds, actor.node.view.refreshes


def rounds(mesh) -> dict[str, tuple[int, int]]:
    """node id -> (janitor rounds, table refreshes) of each of the mesh's KVNodes."""
    import ray

    from kvmesh.mesh import node_actors

    actors = node_actors()
    return {n: ray.get(actors[n].__ray_call__.remote(_rounds), timeout=30) for n in mesh.node_ids}


def test_one_node_record_of_a_later_release_does_not_take_the_mesh_down(mesh, ray_cluster, redis_server):
    """A rolling upgrade puts a record this release cannot read into the node table. Before, every
    `kvmesh.connect` raised WireError, the KVNodes' table-relay and maintenance threads died, and clients' tables
    froze. A record a reader cannot read is no node to it (as an entry it cannot read is no holder), never a dead
    one (its janitor must not purge a live node of the next release)."""
    a, b = ray_cluster.node_ids()[:2]
    toks, kv = prompt(3)
    assert on_node(a, w_store, toks, kv)[0] == 3
    d = Directory(redis_server.url, mesh.config.key_prefix)
    newer = d.join(_NewerNodeInfo(), 60_000)
    try:
        since = rounds(mesh)  # a few of the nodes' table refreshes and janitor rounds, each of which met the record
        wait_until(lambda: all(j > since[n][0] + 2 and v > since[n][1] + 2 for n, (j, v) in rounds(mesh).items()), 30)
        assert on_node(b, w_lookup_fetch, toks) == (3 * SPEC.chunk_tokens, 3 * SPEC.chunk_tokens, "")
        table = d.node_table()
        assert table.unreadable == {_NewerNodeInfo.node_id: newer.incarnation}
        assert newer.incarnation not in table.live and _NewerNodeInfo.node_id not in table.dead
        assert table.newest() >= newer.incarnation  # a lookup naming it does not make readers re-read the table
        d.check_integrity()  # (what integrity checks run: a record of another release is not this one's to check)
        import os

        import ray

        from kvmesh.handle import NodeHello

        for h in kvmesh.mesh.node_actors().values():  # each node still relays its table (every 0.2 s)
            slab = NodeHello.unpack(ray.get(h.hello.remote(), timeout=10)).info.slab_path
            assert time.time() - os.stat(slab + ".nodes").st_mtime < 1.0
        assert d.redis.zscore(d.keys.deadline, _NewerNodeInfo.node_id) is not None  # not purged
    finally:
        d.leave(newer)
        d.close()


def test_a_client_that_names_another_directory_than_its_nodes_is_refused(mesh, ray_cluster, redis_server):
    """The node registers what its clients store; a client looking up under another key prefix (or Redis) never
    found any of it: every lookup a plain `not_cached` miss. Refused at connect, naming the option."""
    a = ray_cluster.node_ids()[0]
    toks, kv = prompt(4)
    with pytest.raises(ValueError, match="key_prefix 'elsewhere'"):
        on_node(a, w_store, toks, kv, key_prefix="elsewhere")
    with RedisServer() as other:
        with pytest.raises(ValueError, match="not the one its KVNode registers in"):
            on_node(a, w_store, toks, kv, redis_url=other.url)
    # the node's own directory, spelled another way, is the same directory
    url = redis_server.url
    same = url[:-2] if url.endswith("/0") else url.rstrip("/") + "/0"  # (database 0 said or left out)
    assert on_node(a, w_store, toks, kv, redis_url=same)[0] == 3


def test_the_maintenance_thread_survives_a_heartbeat_shorter_than_the_nodes_start(tmp_path):
    """The maintenance thread started before a field its first `stats()` reads was set: with a heartbeat shorter
    than the rest of the constructor it died of AttributeError for good (pins never expired, no janitor, no
    telemetry), about 3 starts in 10."""
    from kvmesh.node import KVNode

    died = []
    old = threading.excepthook
    threading.excepthook = lambda a: died.append(a) if a.thread.name == "kvmesh-node-maintenance" else old(a)
    try:
        with RedisServer() as rs:
            for i in range(10):
                cfg = KVMeshConfig(redis_url=rs.url, key_prefix=f"hb{i}", cpu_bytes=4 * MiB, slot_bytes=256 * 1024,
                                   lease_s=1.0, heartbeat_s=1e-6, shm_dir=str(tmp_path))
                node = KVNode(cfg, "a" * 32, "kvnode-a")
                time.sleep(0.2)
                alive = node._thread.is_alive()
                node.shutdown()
                assert alive, f"start {i}: {[(a.exc_type.__name__, str(a.exc_value)) for a in died]}"
    finally:
        threading.excepthook = old
