"""One node shared by several models (specs of other chunk sizes) and tenants at once: plain KVNodes against a real
redis-server. Every slot holds one chunk whatever its size, so a node full of a small model's chunks holds few bytes
and has no free slot; a small model's long prompt is thousands of chunks; replicas of other models report their
loads from the same node; and every read is its own model's and tenant's bytes."""

import threading
import time
from collections import Counter

import pytest
import torch

from kvmesh import KVSpec
from kvmesh.connecting import connect_local
from kvmesh.handle import LocalHandle
from kvmesh.local import RedisServer
from kvmesh.telemetry import Records
from tests.conftest import NodeFactory, wait_until

SLOT = 64 * 1024
BIG = KVSpec("shared-big", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", chunk_tokens=32)  # one slot
SMALL = KVSpec("shared-small", num_layers=1, num_kv_heads=1, head_dim=32, dtype="float16", chunk_tokens=16)
assert BIG.chunk_bytes == SLOT and SMALL.chunk_bytes * 8 <= SLOT


def prompt(spec: KVSpec, seed: int, chunks: int = 1):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 30000, (chunks * spec.chunk_tokens,), generator=g).tolist()
    return toks, torch.randn(spec.kv_shape(len(toks)), generator=g).to(spec.torch_dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


@pytest.fixture
def nodes(tmp_path):
    with RedisServer() as server, NodeFactory(tmp_path, server.url) as make:
        cfg = make.config(key_prefix="sn", cpu_bytes=4 * SLOT, slot_bytes=SLOT, lease_s=4.0, node_refresh_s=0.2,
                          recompute_bytes_per_s=1 << 20)
        made = [make(ch * 32, f"kvnode-{ch}", config=cfg) for ch in "abc"]
        for n in made:
            n.peers = lambda node, me=n: next((LocalHandle(p, me.node_id) for p in made if p.node_id == node), None)
        yield made


def store(client, spec: KVSpec, *seeds: int) -> None:
    for seed in seeds:
        client.store(*prompt(spec, seed))
    client.flush()


def published(node, other) -> dict:
    stats, _totals, _events = Records(node.directory.redis, node.config.key_prefix).read()
    return stats.get(other.node_id, {})


def test_a_last_copy_is_handed_to_the_peer_with_free_slots_not_to_one_full_of_small_chunks(nodes):
    """B's four slots hold a small model's chunks (a 32nd of a slot each: few bytes, no free slot), C holds two
    chunks of a slot each and has two slots free. A last copy that A evicts goes to C; handed to B (which looked
    emptier by bytes) it cost B one of its chunks."""
    a, b, c = nodes
    cb, cc = connect_local(SMALL, b), connect_local(BIG, c)
    reader, ca = connect_local(BIG, b, peers=[a]), connect_local(BIG, a)
    try:
        store(cb, SMALL, 1, 2, 3, 4)
        store(cc, BIG, 10, 11)
        toks, kv = prompt(BIG, 20)
        store(ca, BIG, 20)
        got = reader.fetch(reader.lookup(toks, cost_model=False))  # read by another node: worth a handoff
        assert same_bytes(got, kv)
        wait_until(lambda: published(a, b).get("chunks") == 4 and published(a, c).get("chunks") == 2, 10)
        store(ca, BIG, 21, 22, 23, 24)  # A's slab evicts prompt 20's only copy
        wait_until(lambda: a.stats().get("handoff_ok", 0) + a.stats().get("handoff_refused", 0) >= 1, 10)
        key = reader.hashes(toks)[0]
        assert [n.cascade.holds(key) for n in (b, c)] == [False, True]
        assert (b.stats()["evictions"], len(b.tier)) == (0, 4)  # B lost none of its own
        got = cc.fetch(cc.lookup(toks, cost_model=False))  # served by C, bit-exact
        assert same_bytes(got, kv)
    finally:
        for cl in (cb, cc, reader, ca):
            cl.close()


def test_a_bare_node_candidate_is_priced_by_the_replicas_of_the_prompt_s_own_model(nodes):
    """Two models serve on one node. The other model's replica (slow: 100 tokens/s, 100k tokens queued) is neither
    this model's queue nor its prefill rate: a route to the bare node id reads only this model's replicas there
    (a replica named as the candidate still reads its own report)."""
    a = nodes[0]
    ca, cb = connect_local(SMALL, a), connect_local(BIG, a)
    try:
        prompt = list(range(1, 1001))
        (alone,) = ca.route(prompt, [a.node_id])
        for n in (16, 64, 256, 1024):
            cb.cost.prefill.observe(n, 0, 0.002 + n / 100.0)
        assert cb.report_load(100_000, 50, "replica-big")
        (e,) = ca.route(prompt, [a.node_id])
        assert e.load is None and e.expected_ttft_s == pytest.approx(alone.expected_ttft_s)
        assert ca.report_load(1_000, 1, "replica-small")
        (e,) = ca.route(prompt, [a.node_id])
        assert (e.load.pending_prefill_tokens, e.load.replicas, e.load.prefill) == (1_000, 1, None)
        (e,) = cb.route(list(range(1, 1001)), [a.node_id])  # and the other way round
        assert (e.load.pending_prefill_tokens, e.load.replicas) == (100_000, 1) and e.expected_ttft_s > 100
    finally:
        ca.close()
        cb.close()


def test_a_prompt_of_thousands_of_small_chunks_does_not_hold_up_the_other_models_on_the_node(make_node):
    """A model with small chunks and a long prompt (256k tokens in 16-token chunks: 16384 chunks) is read while
    another model reads its own chunk on the same node over and over. Bringing the run into the slab took time
    quadratic in its chunks under the node's lock (a protected set made anew per chunk: some 10 s at 16384), and every
    other reader and writer of the node waited that long."""
    long_spec = KVSpec("shared-long", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", chunk_tokens=16)
    other = KVSpec("shared-other", num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16", chunk_tokens=16)
    n = 16384
    with RedisServer() as server:
        node = make_node("d" * 32, "kvnode-d", redis_url=server.url, key_prefix="sl", cpu_bytes=(n + 16) * 4096,
                         slot_bytes=4096, lease_s=5.0, heartbeat_s=1.0)
        cl, co = connect_local(long_spec, node), connect_local(other, node)
        try:
            toks, kv = prompt(long_spec, 30, n)
            otoks, okv = prompt(other, 31)
            cl.store(toks, kv)
            co.store(otoks, okv)
            assert cl.flush(60) == n and co.flush() == 1
            m = cl.lookup(toks, cost_model=False)
            assert m.num_chunks == n
            waits, done = [], threading.Event()

            def read_other():
                while not done.is_set():
                    t0 = time.monotonic()
                    got = co.fetch(co.lookup(otoks, cost_model=False))
                    waits.append(time.monotonic() - t0)
                    assert same_bytes(got, okv)

            t = threading.Thread(target=read_other)
            t.start()
            try:
                time.sleep(0.05)
                got = cl.fetch(m)
            finally:
                done.set()
                t.join()
            assert same_bytes(got, kv)
            assert waits and max(waits) < 2.0, f"the other model's reads waited up to {max(waits):.2f} s"
        finally:
            cl.close()
            co.close()
            node.shutdown()


def test_models_and_tenants_with_the_same_tokens_share_a_slab_and_disk_bit_exact(make_node):
    """Three models of three chunk sizes (none a multiple of the disk's 4 KiB blocks, one exactly a slot), each for
    two tenants, store and read prompts of the same token ids at once through one node whose slab holds six chunks
    and whose disk 120, fewer than they store: chunks go down to the disk, back up and out. Each read is its own
    model's and tenant's bytes, bit for bit, or shorter; the tiers and the directory agree at the end."""
    slot = 23040
    specs = [
        KVSpec("shared-mid", num_layers=3, num_kv_heads=1, head_dim=40, dtype="bfloat16", chunk_tokens=48),  # a slot
        KVSpec("shared-odd", num_layers=1, num_kv_heads=3, head_dim=7, dtype="float32", chunk_tokens=9),
        KVSpec("shared-tiny", num_layers=1, num_kv_heads=1, head_dim=24, dtype="float16", chunk_tokens=16),
    ]
    assert specs[0].chunk_bytes == slot

    def data(spec, seed, salt):
        g = torch.Generator().manual_seed(seed)
        toks = torch.randint(0, 30000, (144,), generator=g).tolist()  # the same ids for every model and tenant
        g.manual_seed(seed * 100 + specs.index(spec) * 10 + len(salt))
        return toks, torch.randn(spec.kv_shape(144 // spec.chunk_tokens * spec.chunk_tokens), generator=g).to(
            spec.torch_dtype
        )

    with RedisServer() as server:
        node = make_node("b" * 32, "kvnode-b", redis_url=server.url, key_prefix="sb", cpu_bytes=6 * slot,
                         slot_bytes=slot, disk_bytes=120 * slot, lease_s=5.0, heartbeat_s=1.0)
        wrong, hits, failed = [], Counter(), []

        def work(spec, salt):
            c = connect_local(spec, node, cache_salt=salt)
            try:
                for i in range(12):
                    toks, kv = data(spec, (i // 2 + len(salt)) % 3, salt)  # each prompt twice in a row
                    got = c.fetch(c.lookup(toks, cost_model=False))
                    n = got.shape[2]
                    hits[spec.model_id] += n > 0
                    if not same_bytes(got, kv[:, :, :n]):
                        wrong.append((spec.model_id, salt, i, n))
                    c.store(toks, kv)
                    c.flush()
            except Exception as e:  # noqa: BLE001 - reported below
                failed.append(repr(e))
            finally:
                c.close()

        try:
            threads = [threading.Thread(target=work, args=(s, salt)) for s in specs for salt in ("t1", "t22")]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not failed and not wrong
            assert sum(hits.values()) > 0  # (which ones hit depends on how fast the disk takes the evictions)
            st = node.stats()
            assert st["disk_reads"] + st["writeback_hits"] > 0 and st["corrupt_dropped"] == 0
            wait_until(lambda: not node.stats().get("disk_pending_io") and not node.cascade._pending, 10)
            node.check_integrity(directory=True)
        finally:
            node.shutdown()


def test_a_tier_full_of_small_chunks_is_shown_full(nodes):
    """The node's tier figures (live page, `kvmesh status`, Grafana's tier occupancy) say how many of a tier's
    slots are taken: four small chunks fill a four-slot slab though they take an eighth of its bytes. Before, the
    figures were bytes only, and a full tier showed as 12 % used."""
    from kvmesh.operate import status

    a = nodes[0]
    c = connect_local(SMALL, a)
    try:
        store(c, SMALL, 1, 2, 3, 4)
        (cpu,) = [t for t in a.stats()["tiers"] if t["tier"] == "cpu"]
        assert (cpu["chunks"], cpu["slots"]) == (4, 4) and cpu["used_bytes"] * 8 <= cpu["capacity_bytes"]

        def shown() -> str:
            lines: list[str] = []
            status(a.config.redis_url, "sn", out=lines.append)
            return "\n".join(lines)

        wait_until(lambda: "cpu 0/0 MiB (4/4)" in shown(), 10)  # (as the node publishes its stats)
    finally:
        c.close()


def test_a_lora_adapter_s_route_to_a_bare_node_reads_the_base_model_s_replicas_there(nodes):
    """A replica serves the base model and its adapters (one queue, one prefill rate) and reports its load through
    one client; a router for an adapter (its own spec: the adapter's chunks hash apart) pricing a bare node id
    still reads that replica's queue, as it did before reports carried a namespace. Likewise another TP rank's."""
    from dataclasses import replace

    a = nodes[0]
    base = connect_local(SMALL, a)
    adapter = connect_local(replace(SMALL, lora_id="tenant-7"), a)
    try:
        assert base.report_load(50_000, 20, "replica-small")
        (e,) = adapter.route(list(range(1, 1001)), [a.node_id])
        assert e.load is not None and (e.load.pending_prefill_tokens, e.load.replicas) == (50_000, 1)
    finally:
        adapter.close()
        base.close()
