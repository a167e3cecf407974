"""kvmesh.integrations.serve on the real 3-node cluster: a Ray Serve deployment of 3 replicas (one per node) whose
requests the kvmesh router sends to the holder of their prefix, within the bounded-load guard."""

import asyncio
import math
import time
from collections import Counter

import pytest
import ray
import torch

import kvmesh
from kvmesh import KVSpec
from kvmesh.mesh import node_actors
from tests.conftest import dead_directory, says_directory_unreachable
from tests.integration.conftest import on_node

serve = pytest.importorskip("ray.serve", reason="needs kvmesh[serve]")

C = 32
EPS = 0.25


def spec() -> KVSpec:
    return KVSpec("serve-router", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=C)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n,), generator=g).tolist()


def w_store(s, toks):
    c = kvmesh.connect(s)
    c.store(toks, torch.randn(s.kv_shape(len(toks))).to(s.torch_dtype))
    n = c.flush()
    c.close()
    return n


@serve.deployment(num_replicas=3, max_replicas_per_node=1, max_ongoing_requests=64,
                  ray_actor_options={"num_cpus": 0.1})
class NodeEcho:
    """A kvmesh worker that answers with its node after `delay_s`, reporting its load as a model replica would."""

    def __init__(self, spec_hex: str, delay_s: float) -> None:
        from kvmesh.integrations.serve import LoadReporter

        self.client = kvmesh.connect(KVSpec.from_canonical_bytes(bytes.fromhex(spec_hex)))
        self.reporter = LoadReporter(self.client)
        self.node = ray.get_runtime_context().get_node_id()
        self.delay_s = delay_s
        self.active = self.peak = 0

    async def __call__(self, tokens: list[int]) -> str:
        with self.reporter.request(len(tokens)) as r:
            r.prefilled()  # (no model: the prompt is "prefilled" at once, then the request decodes for delay_s)
            self.active += 1
            self.peak = max(self.peak, self.active)
            try:
                await asyncio.sleep(self.delay_s)
            finally:
                self.active -= 1
        return self.node

    def stats(self, reset: bool = False) -> tuple[str, int]:
        out = (self.node, self.peak)
        if reset:
            self.peak = 0
        return out


@pytest.fixture(scope="module")
def app(mesh):
    from kvmesh.integrations.serve import router_config

    serve.start(http_options={"location": "NoServer"})
    s = spec()
    handle = serve.run(NodeEcho.options(request_router_config=router_config(s, eps=EPS))
                       .bind(s.canonical_bytes().hex(), 0.4), name="kvmesh-router", route_prefix=None)
    yield handle
    serve.delete("kvmesh-router")
    serve.shutdown()


def replica_nodes(handle) -> set[str]:
    seen = set()
    deadline = time.monotonic() + 30
    while len(seen) < 3 and time.monotonic() < deadline:
        seen.update(handle.stats.remote().result()[0] for _ in range(6))
    return seen


def test_requests_with_a_cached_prefix_go_to_the_holders_replica(app, mesh):
    nodes = replica_nodes(app)
    assert len(nodes) == 3 and nodes <= set(node_actors())  # one replica per node, each beside a KVNode
    holder = sorted(nodes)[1]
    s = spec()
    prefix = tokens(4 * C, seed=1)
    assert on_node(holder, w_store, s, prefix) == 4
    served = []
    for i in range(6):
        served.append(app.remote(prefix + tokens(9, seed=100 + i)).result())
        time.sleep(0.2)  # Serve tells the router a request completed a moment after its caller has the result
    assert served == [holder] * 6
    # a prompt nobody holds goes wherever the load is least: not necessarily the holder
    other = tokens(4 * C, seed=2)
    assert app.remote(other).result() in nodes


def test_the_bounded_load_guard_spreads_a_flood_of_one_prefix(app, mesh):
    nodes = replica_nodes(app)
    holder = sorted(nodes)[2]
    s = spec()
    # (16 chunks: recomputing them elsewhere costs far more than the holder's queue of short suffixes, so the holder
    # ranks first up to its cap; with 4 it lost that rank to idle replicas now and then, and took less than a third)
    prefix = tokens(16 * C, seed=3)
    assert on_node(holder, w_store, s, prefix) == 16
    for _ in range(6):
        app.stats.remote(reset=True).result()  # (the peaks of earlier tests)
    n = 24
    responses = [app.remote(tokens=prefix + tokens(5, seed=200 + i)) for i in range(n)]
    served = Counter(r.result() for r in responses)
    peaks: dict[str, int] = {}
    deadline = time.monotonic() + 30
    while len(peaks) < 3 and time.monotonic() < deadline:
        peaks.update(app.stats.remote().result() for _ in range(6))
    assert set(served) == set(peaks) == nodes  # every replica took part
    assert served[holder] >= n // 3  # the holder still took at least its share (it is first while under the cap)
    # at most ceil((1 + eps) * n / 3) in flight on any replica, give or take the few routing decisions Serve makes
    # concurrently before their sends are counted
    cap = math.ceil((1 + EPS) * n / 3)
    assert max(served.values()) <= cap + 6
    assert all(p <= cap + 6 for p in peaks.values()), peaks


def test_a_router_that_cannot_reach_its_directory_routes_by_load_and_says_why_in_one_line(app, mesh, caplog):
    # Serve builds the router for the first request, in the caller's process: with a directory where nothing
    # listens, connecting fails. Requests must still be served (by load alone), not held by a router that raised,
    # and the log must say why in one line: the URL with its password redacted, and the cause
    import logging

    from kvmesh.integrations.serve import router_config

    s = spec()
    caplog.set_level(logging.ERROR, logger="kvmesh.serve")
    with dead_directory() as url:
        try:
            handle = serve.run(NodeEcho.options(name="DeadDirectory",
                                                request_router_config=router_config(s, redis_url=url))
                               .bind(s.canonical_bytes().hex(), 0.0), name="kvmesh-dead-directory", route_prefix=None)
            t0 = time.monotonic()
            answers = [handle.remote(tokens(3 * C, seed=77 + i)).result(timeout_s=60) for i in range(4)]
            took = time.monotonic() - t0
        finally:
            serve.delete("kvmesh-dead-directory")
    assert set(answers) <= set(mesh.node_ids) and took < 30, (answers, took)
    said = [r.getMessage() for r in caplog.records if r.name == "kvmesh.serve"]
    assert len(said) == 1, said  # once, not once per request
    says_directory_unreachable(said[0], url)
    assert "\n" not in said[0]


ROUTER_SPEC = KVSpec("router-directory", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)


def w_router(spec_hex: str, redis_url, options):
    """What Serve does in a routing process: initialize_state with router_config's kwargs."""
    from kvmesh.integrations.serve import KVMeshRouter

    r = KVMeshRouter.__new__(KVMeshRouter)  # (Serve's own constructor needs a deployment; initialize_state is ours)
    try:
        r.initialize_state(spec=spec_hex, redis_url=redis_url, options=options)
    except Exception as e:  # noqa: BLE001
        return "raised", f"{type(e).__name__}: {e}"
    connected = r.client is not None
    if connected:
        r.client.close()
    return "connected" if connected else "degraded", r.connect_error


def test_a_router_beside_a_kvnode_with_the_nodes_redis_by_hostname_connects(mesh, ray_cluster, redis_server):
    """router_config(spec, redis_url=...) spelled with the host name of the nodes' Redis: one directory. The
    router's construction raises ValueError instead (Serve cannot build the router)."""
    a = ray_cluster.node_ids()[0]
    url = redis_server.url.replace("127.0.0.1", "localhost")
    got = on_node(a, w_router, ROUTER_SPEC.canonical_bytes().hex(), url, {})
    assert got[0] == "connected", got


def test_a_router_whose_directory_is_refused_routes_by_load_instead_of_raising(mesh, ray_cluster):
    """A router's failed connect is documented to say why once and route by load alone, retrying every
    RECONNECT_S (`_try_connect`). It catches ConnectionError, TimeoutError and RuntimeError, not the new
    ValueError: the refusal escapes initialize_state (and, on a later retry, choose_replicas of a request)."""
    a = ray_cluster.node_ids()[0]
    got = on_node(a, w_router, ROUTER_SPEC.canonical_bytes().hex(), None, {"key_prefix": "elsewhere"})
    assert got[0] == "degraded" and "key_prefix" in (got[1] or ""), got
