"""client.route on the real 3-node cluster and a real redis-server: where a prompt's first token comes soonest."""

import time
from dataclasses import dataclass

import numpy as np
import pytest
import ray
import torch

import kvmesh
from kvmesh import KVSpec
from kvmesh.mesh import node_actors
from tests.conftest import wait_until
from tests.integration.conftest import on_node

C = 32  # chunk tokens


def spec(model: str) -> KVSpec:
    return KVSpec(f"route-{model}", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=C)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n,), generator=g).tolist()


def kv_for(s: KVSpec, n: int) -> torch.Tensor:
    return torch.randn(s.kv_shape(n)).to(s.torch_dtype)


@dataclass
class ReplicaId:
    unique_id: str


@dataclass
class Replica:  # the shape Serve hands a router: a node and a replica id
    node_id: str
    replica_id: ReplicaId


# -- worker bodies (Ray tasks on a chosen node) ----------------------------------------------------------------------
def w_store(s, toks, kv):
    c = kvmesh.connect(s)
    c.store(toks, kv)
    n = c.flush()
    c.close()
    return n


def w_report(s, pending, depth, replica_id):
    c = kvmesh.connect(s)
    ok = c.report_load(pending, depth, replica_id)
    c.close()
    return ok


@pytest.fixture(scope="module")
def client(mesh):
    c = kvmesh.connect(spec("driver"))  # the driver's node; route asks the directory, wherever it runs
    yield c
    c.close()


# -- tests -----------------------------------------------------------------------------------------------------------
def test_the_holder_ranks_first_and_a_longer_prefix_partly_elsewhere_counts_as_peer_tokens(mesh):
    a, b, c = mesh.node_ids
    s = spec("rank")
    prefix = tokens(4 * C, seed=1)
    longer = prefix + tokens(2 * C, seed=2)
    assert on_node(a, w_store, s, prefix, kv_for(s, len(prefix))) == 4
    assert on_node(b, w_store, s, longer, kv_for(s, len(longer))) == 2  # B stores only chunks 4-5: 0-3 are cached
    with kvmesh.connect(s) as cl:
        est = cl.route(prefix + [7] * 10, [c, b, a])
        assert [e.node_id for e in est][0] == a
        top = est[0]
        assert (top.local_tokens, top.peer_tokens, top.recompute_tokens, top.why) == (4 * C, 0, 10, "local")
        assert top.known and top.expected_ttft_s is not None and top.expected_ttft_s > 0
        others = {e.node_id: e for e in est[1:]}
        assert all((e.local_tokens, e.peer_tokens, e.why) == (0, 4 * C, "peer") for e in others.values())

        est = {e.node_id: e for e in cl.route(longer + [7], [a, b, c])}
        assert (est[a].local_tokens, est[a].peer_tokens) == (4 * C, 2 * C)
        assert (est[b].local_tokens, est[b].peer_tokens) == (0, 6 * C)  # B's chunks 4-5 do not start the prompt
        assert (est[c].local_tokens, est[c].peer_tokens) == (0, 6 * C)
        assert est[a].expected_ttft_s < est[b].expected_ttft_s  # A reads more of it from its own node
        # a replica is priced by its node; the estimate hands back the candidate as given
        rep = Replica(a, ReplicaId("rank-ra"))
        (e,) = cl.route(prefix + [7], [rep])
        assert e.candidate is rep and e.node_id == a and e.local_tokens == 4 * C


def test_reported_load_changes_the_ranking(mesh):
    a, b, _ = mesh.node_ids
    s = spec("load")
    prefix = tokens(4 * C, seed=3)
    on_node(a, w_store, s, prefix, kv_for(s, len(prefix)))
    ra, rb = Replica(a, ReplicaId("load-ra")), Replica(b, ReplicaId("load-rb"))
    prompt = prefix + [5] * 10
    with kvmesh.connect(s) as cl:
        first = cl.route(prompt, [rb, ra])
        assert first[0].candidate is ra and first[0].load is None  # nothing reported yet
        # A's replica is swamped: 100k prompt tokens queued (20 s at the default prefill prior)
        assert on_node(a, w_report, s, 100_000, 12, "load-ra")
        assert on_node(b, w_report, s, 0, 0, "load-rb")
        est = cl.route(prompt, [rb, ra])
        assert est[0].candidate is rb
        assert est[1].load.pending_prefill_tokens == 100_000 and est[1].load.queue_depth == 12
        assert est[1].expected_ttft_s > 10.0 and est[1].local_tokens == 4 * C  # it still holds the prefix
        # a bare node id sums the reports of every replica on its node
        assert cl.route(prompt, [a])[0].load.pending_prefill_tokens >= 100_000
        # A drains: it ranks first again
        assert on_node(a, w_report, s, 0, 0, "load-ra")
        assert cl.route(prompt, [rb, ra])[0].candidate is ra


def test_a_dead_nodes_copies_are_not_counted(mesh, ray_cluster):
    node = ray_cluster.add_node(num_cpus=1)
    kvmesh.start(mesh.config.redis_url, key_prefix="it")  # idempotent: a KVNode on the new node only
    d, a = node.node_id, mesh.node_ids[0]
    s = spec("dead")
    prefix = tokens(3 * C, seed=4)
    assert on_node(d, w_store, s, prefix, kv_for(s, len(prefix))) == 3
    with kvmesh.connect(s) as cl:
        est = {e.node_id: e for e in cl.route(prefix + [1], [a, d])}
        assert est[d].local_tokens == 3 * C and est[a].peer_tokens == 3 * C
        pid = ray.get(node_actors()[d].stats.remote())["pid"]
        ray_cluster.remove_node(node)
        wait_until(lambda: not _alive(pid), 30)
        # once its lease lapses (or Ray reports it dead), nothing it held is priced: not as local, not as peer
        wait_until(lambda: all(e.local_tokens == e.peer_tokens == 0 for e in cl.route(prefix + [1], [a, d])),
                   2 * mesh.config.lease_s + 3)
        est = {e.node_id: e for e in cl.route(prefix + [1], [a, d])}
        assert est[a].why == est[d].why == "recompute" and est[a].known
    # the later modules must not see the removed node: Ray marks it dead once its heartbeats are missed (a Serve
    # deployment placed a replica on it while the GCS still listed it alive), and its KVNode's name goes
    wait_until(lambda: not any(n["NodeID"] == d and n["Alive"] for n in ray.nodes()), 60)
    try:
        ray.kill(node_actors()[d], no_restart=True)
    except (KeyError, ValueError):
        pass
    wait_until(lambda: d not in node_actors(), 30)


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class _Router:
    """A routing client of its own directory (a Redis the test can stop), on a Ray node without a KVNode (a client
    beside a KVNode must use the node's directory)."""

    def __init__(self, s: KVSpec, url: str) -> None:
        self.cl = kvmesh.connect(s, redis_url=url)

    def route(self, toks, candidates):
        t0 = time.monotonic()
        est = self.cl.route(toks, candidates)
        return [(e.node_id, e.known, e.expected_ttft_s, e.why) for e in est], time.monotonic() - t0

    def report_load(self) -> bool:
        return self.cl.report_load(1, 1, "down-r")

    def lookup_timeout_s(self) -> float:
        return self.cl.config.lookup_timeout_s

    def close(self) -> None:
        self.cl.close()


def test_a_stopped_directory_gives_unknown_estimates_in_bounded_time(mesh, ray_cluster, private_redis):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    a, b, _ = mesh.node_ids
    s = spec("down")
    node = ray_cluster.add_node(num_cpus=1)
    where = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
    cl = ray.remote(num_cpus=0)(_Router).options(scheduling_strategy=where).remote(s, private_redis.url)
    try:
        est, _ = ray.get(cl.route.remote(tokens(3 * C, 5), [a, b]), timeout=60)
        assert all(known for _, known, _, _ in est)
        private_redis.stop()
        est, took = ray.get(cl.route.remote(tokens(3 * C, 5), [a, b]), timeout=60)
        assert [n for n, _, _, _ in est] == [a, b]  # the given order: nothing to rank by
        assert all(e[1:] == (False, None, "directory_error") for e in est)
        assert took < 2 * ray.get(cl.lookup_timeout_s.remote()) + 0.5
        est, took = ray.get(cl.route.remote(tokens(3 * C, 5), [a]), timeout=60)
        assert not any(known for _, known, _, _ in est) and took < 0.1  # the breaker: no second timeout
        assert ray.get(cl.report_load.remote()) is False
    finally:
        ray.get(cl.close.remote(), timeout=60)
        ray.kill(cl)
        ray_cluster.remove_node(node, graceful=True)


def test_bad_input_raises_typed_errors_naming_the_argument(client, mesh):
    a = mesh.node_ids[0]
    with pytest.raises(ValueError, match="candidates"):
        client.route([1, 2, 3], [])
    with pytest.raises(TypeError, match="candidates"):
        client.route([1, 2, 3], [a, 3.5])
    with pytest.raises(TypeError, match="candidates"):
        client.route([1, 2, 3], a)
    with pytest.raises(ValueError, match="candidates"):
        client.route([1, 2, 3], ["node-on-the-moon"])
    with pytest.raises(ValueError, match="tokens"):
        client.route(np.zeros((2, 4), dtype=np.int64), [a])  # not 1-D
    with pytest.raises(TypeError, match="tokens"):
        client.route([[1, 2], [3, 4]], [a])
    with pytest.raises(TypeError, match="tokens"):
        client.route("a prompt", [a])
    with pytest.raises(TypeError, match="tokens"):
        client.route([1.5, 2.0], [a])
    with pytest.raises(ValueError, match="tokens"):
        client.route([], [a])
    with pytest.raises(ValueError, match="queue_depth"):
        client.report_load(0, -1, "r")
    with pytest.raises(ValueError, match="replica_id"):
        client.report_load(0, 0, "")
    for rate in (0, -1.0, float("inf"), float("nan"), True):  # (inf once failed an internal assert, untyped)
        with pytest.raises(ValueError, match="prefill_tokens_per_s"):
            client.route([1, 2, 3], [a], prefill_tokens_per_s=rate)
