"""The cost model learns from what fetches really took, per link: a peer that hangs until the fetch's deadline is
planned as slow from the next request on (not loaded from, waited out and recomputed for every request) while
other peers are still loaded from, and a fast run of this node's own slab behind a slow peer's run is charged its
own time, not the peer's. Three plain KVNodes against a real redis-server; the slow peer is its real data server
made to wait before it answers."""

import time

import pytest
import torch

from kvmesh import KVSpec
from kvmesh.connecting import connect_local
from kvmesh.handle import LocalHandle
from kvmesh.local import RedisServer
from tests.conftest import NodeFactory, wait_until

SPEC = KVSpec("cost-learning", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", chunk_tokens=16)
CH = SPEC.chunk_tokens


@pytest.fixture
def nodes(tmp_path):
    with RedisServer() as server, NodeFactory(tmp_path, server.url) as make:
        cfg = make.config(key_prefix="cl", cpu_bytes=64 * SPEC.chunk_bytes, slot_bytes=SPEC.chunk_bytes, lease_s=4.0,
                          heartbeat_s=0.3, node_refresh_s=0.2, fetch_timeout_s=1.0)
        made = [make(ch * 32, f"kvnode-{ch}", config=cfg) for ch in "abc"]
        for n in made:
            n.peers = lambda node, me=n: next((LocalHandle(p, me.node_id) for p in made if p.node_id == node), None)
        yield made


def prompt(seed: int, chunks: int):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 30000, (chunks * CH + 3,), generator=g).tolist()
    return toks, torch.randn(SPEC.kv_shape(len(toks)), generator=g).to(torch.float16)


def slow(node, seconds: float) -> None:
    real = node.data_server._pin
    node.data_server._pin = lambda keys, requester="": (time.sleep(seconds), real(keys, requester))[1]


def learn_prefill(client, tokens_per_s: float = 2000.0) -> None:
    for n in (16, 64, 256, 1024):  # a slow model: loading 8 chunks from a healthy peer wins
        client.cost.prefill.observe(n, 0, 0.002 + n / tokens_per_s)


def test_a_peer_that_hangs_until_the_deadline_is_planned_as_slow_from_the_next_request_on(nodes):
    a, b, c = nodes
    ca = connect_local(SPEC, a, peers=[b, c])
    cb = connect_local(SPEC, b, peers=[a, c])
    cc = connect_local(SPEC, c, peers=[a, b])
    try:
        learn_prefill(ca)
        toks, kv = prompt(1, 8)
        cb.store(toks, kv)
        cb.flush()
        other, kv2 = prompt(3, 8)
        cc.store(other, kv2)
        cc.flush()
        wait_until(lambda: ca.lookup(toks, cost_model=False).num_chunks == 8, 5)
        wait_until(lambda: ca.lookup(other, cost_model=False).num_chunks == 8, 5)
        first = ca.lookup(toks, max_chunks=8)
        assert first.plan.end == 8  # a healthy peer: loading wins
        slow(b, 30.0)  # its data server hangs; its lease stays alive
        t0 = time.monotonic()
        got = ca.fetch(first)
        assert got.shape[2] == 0 and time.monotonic() - t0 < 3.0  # (waited out its 1 s deadline)
        assert ca.last_fetch.error == "deadline"
        again = ca.lookup(toks, max_chunks=8)
        assert again.plan.reason == "recompute", again.plan  # not another deadline to wait out
        healthy = ca.lookup(other, max_chunks=8)  # another peer's link is its own: still loaded from
        assert healthy.plan.end == 8, healthy.plan
        got = ca.fetch(healthy)
        assert torch.equal(got.view(torch.int16), kv2[:, :, : 8 * CH].view(torch.int16))
    finally:
        ca.close()
        cb.close()
        cc.close()


def test_a_slab_run_behind_a_slow_peers_run_is_charged_its_own_time(nodes):
    a, b, _ = nodes
    ca = connect_local(SPEC, a, peers=[b])
    cb = connect_local(SPEC, b, peers=[a])
    try:
        toks, kv = prompt(2, 8)
        cb.store(toks[: 2 * CH + 1], kv[:, :, : 2 * CH + 1])  # chunks 0 and 1 on b
        cb.flush()
        ca.store(toks, kv)  # 2..7 on a
        ca.flush()
        match = wait_until(lambda: (m := ca.lookup(toks, cost_model=False)).num_chunks == 8 and m, 5)
        assert [c.holders[0].node_id == b.node_id for c in match.chunks] == [True] * 2 + [False] * 6
        before = ca.cost.link("local").seconds(6 * SPEC.chunk_bytes)
        slow(b, 0.6)
        got = ca.fetch(match)
        assert got.shape[2] == 8 * CH and torch.equal(got.view(torch.int16), kv[:, :, : 8 * CH].view(torch.int16))
        runs = {r.link: r for r in ca.last_fetch.runs}
        assert runs[f"peer:{b.node_id}"].seconds >= 0.5
        assert runs["local"].seconds < 0.3, ca.last_fetch.runs  # not the 0.6 s it waited behind the peer
        assert ca.cost.link("local").seconds(6 * SPEC.chunk_bytes) < max(0.1, 10 * before)
    finally:
        ca.close()
        cb.close()
