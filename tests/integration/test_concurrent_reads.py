"""Reads that overlap: readers of the same chunks on a node's disk, more windowed fetches at once than a slab holds,
and a fetch that outlasts the pins it reads through. Each must come back whole (or cut short by a real fault) and
bit-exact, never short because another reader was busy, never with another chunk's bytes. Plain KVNodes against a
real redis-server (found by a data-plane hunt)."""

import os
import threading
import time

import pytest
import torch

from kvmesh import KVSpec
from kvmesh.connecting import connect_local
from kvmesh.config import KVMeshConfig
from kvmesh.handle import LocalHandle
from kvmesh.hashing import as_tokens, chunk_hashes
from kvmesh.local import RedisServer
from kvmesh.node import KVNode
from tests.conftest import wait_until

SPEC = KVSpec("overlap", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)
SLOT = 64 * 1024
CT = SPEC.chunk_tokens


class Mesh:
    def __init__(self, tmp, **configs) -> None:
        self.server = RedisServer()
        base = KVMeshConfig(redis_url=self.server.url, key_prefix="ov", cpu_bytes=64 * SLOT, slot_bytes=SLOT,
                            lease_s=4.0, heartbeat_s=0.5, node_refresh_s=0.2, fetch_timeout_s=10.0,
                            shm_dir=str(tmp / "shm"))
        os.makedirs(base.shm_dir)
        self.nodes: dict[str, KVNode] = {}
        for role, kw in configs.items():
            if "disk_bytes" in kw:
                kw = {**kw, "disk_dir": str(tmp / f"disk-{role}")}
            n = self.nodes[role] = KVNode(base.replace(**kw), f"node-{role}" * 6, f"kvnode-{role}")
            n.peers = lambda node, me=n: next(
                (LocalHandle(p, me.node_id) for p in self.nodes.values() if p.node_id == node), None)

    def client(self, role, **opts):
        return connect_local(SPEC, self.nodes[role], peers=[n for r, n in self.nodes.items() if r != role], **opts)

    def close(self) -> None:
        for n in self.nodes.values():
            n.shutdown()
        self.server.stop()


@pytest.fixture
def mesh(tmp_path):
    made = []

    def make(**configs):
        made.append(Mesh(tmp_path, **configs))
        return made[-1]

    yield make
    for m in made:
        m.close()


def data(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 50_000, (n * CT,), generator=g).tolist()
    return toks, torch.randn(SPEC.kv_shape(len(toks)), generator=g).to(SPEC.torch_dtype)


def keys(toks):
    return chunk_hashes(SPEC.namespace, as_tokens(toks), CT)


def exact(got, kv, n) -> bool:
    return got.shape[2] == n * CT and torch.equal(got.view(torch.uint8), kv[:, :, : n * CT].contiguous().view(
        torch.uint8))


def on_disk(m, role, prompts):
    """Store each prompt on `role`, then push them all out of its slab: every chunk on its disk only."""
    c = m.client(role)
    try:
        for toks, kv in prompts:
            assert c.store(toks, kv) == len(keys(toks)) and c.flush()
        filler = data(99, m.nodes[role].tier.num_slots)
        c.store(*filler)
        c.flush()
        wanted = [k for toks, _ in prompts for k in keys(toks)]
        wait_until(lambda: all([w[0] for w in where] == ["disk"] for where in m.nodes[role].locate(wanted)), 10)
    finally:
        c.close()


def read_together(m, role, prompts, **opts):
    """Each prompt fetched by its own client at once; returns the tensors."""
    clients = [m.client(role, **opts) for _ in prompts]
    matches = [c.lookup(toks, cost_model=False) for c, (toks, _) in zip(clients, prompts)]
    assert all(mt.num_chunks == len(keys(toks)) for mt, (toks, _) in zip(matches, prompts))
    got: list = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def read(i):
        start.wait()
        got[i] = clients[i].fetch(matches[i])

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    return got


def test_readers_of_the_same_chunks_on_disk_both_get_them_whole(mesh):
    # both readers' pins bring the chunks from disk into the slab; the second found the first's read in flight
    # (the slot reserved, not readable yet) and stopped there: a miss for the rest, with nothing wrong
    m = mesh(D=dict(cpu_bytes=16 * SLOT, disk_bytes=128 * SLOT))
    prompt = data(1, 12)
    on_disk(m, "D", [prompt])
    for got in read_together(m, "D", [prompt, prompt, prompt]):
        assert exact(got, prompt[1], 12)
    wait_until(lambda: m.nodes["D"].stats()["pinned"] == 0, 5)


def test_more_windowed_fetches_than_the_slab_holds_at_once_all_finish(mesh):
    # three readers, each allowed half of an 8-slot slab, of three prompts on disk: the pins of the later ones
    # found every slot pinned and came back short; they wait for room now
    m = mesh(D=dict(cpu_bytes=8 * SLOT, disk_bytes=128 * SLOT))
    prompts = [data(10 + i, 12) for i in range(3)]
    on_disk(m, "D", prompts)
    for got, (_, kv) in zip(read_together(m, "D", prompts), prompts):
        assert exact(got, kv, 12)
    wait_until(lambda: m.nodes["D"].stats()["pinned"] == 0, 5)


def test_a_fetch_that_may_outlast_its_pins_does_not_read_a_reused_slot(mesh):
    # a device fetch adopts its node's slab slots and copies them at its end; a slow peer kept it past the pin TTL,
    # the node released the pins, a store reused the slots, and the copy read the new chunk's bytes, after the
    # old ones had been checked: a load that said it was verified held another chunk's KV. A reader's pins are
    # held until its deadline (then the TTL): the slots stay its own, and are still read in place
    ttl = 1.0
    m = mesh(D=dict(cpu_bytes=8 * SLOT, pin_ttl_s=ttl), B={})
    d, b = m.nodes["D"], m.nodes["B"]
    d.tier.take_devsum_work = lambda limit: []  # (no device checksums recorded yet: checked by xxh3)
    toks, kv = data(11, 8)
    ks = keys(toks)
    cd, cb = m.client("D"), m.client("B")
    cd.store_keys(ks[0], ks[:4], [kv[:, :, i * CT:(i + 1) * CT] for i in range(4)])
    cb.store_keys(ks[0], ks[4:], [kv[:, :, i * CT:(i + 1) * CT] for i in range(4, 8)])
    assert cd.flush() == 4 and cb.flush() == 4
    match = cd.lookup(toks, cost_model=False)
    assert match.num_chunks == 8
    pin = b.data_server._pin
    b.data_server._pin = lambda keys, requester: (time.sleep(ttl + 2.0), pin(keys, requester))[1]  # a slow peer

    def churn():
        time.sleep(ttl + 1.0)  # D's maintenance has released the reader's pins by now
        w = m.client("D")
        for j in range(3):
            w.store(*data(900 + j, 4))
            w.flush()
        w.close()

    th = threading.Thread(target=churn)
    th.start()
    load, n = cd.fetch_to_device(match, "cpu", deadline_s=ttl + 20)
    th.join()
    try:
        k = min(n, load.first_unverified())
        got = load.staging[:k].permute(1, 2, 0, 3, 4, 5).reshape(SPEC.kv_shape(k * CT))
        assert k == 8 and exact(got, kv, k)
        assert cd.last_fetch.adopted_chunks == 4  # D's own chunks, read in place
    finally:
        load.release()
        cd.close()
        cb.close()


def test_a_holder_back_with_a_smaller_slab_gets_windows_sized_to_it(mesh):
    # a client learns a holder's slab size once per incarnation: keyed by node id alone, a holder that came back
    # with a smaller slab (a config change, a fuller /dev/shm) kept its old size in every long-lived client, which
    # then asked it for more at once than its slab holds, and got that much only
    m = mesh(B=dict(disk_bytes=128 * SLOT), R={})
    c = m.client("R")
    try:
        warm = data(1, 2)
        on_disk(m, "B", [warm])
        assert exact(c.fetch(c.lookup(warm[0], cost_model=False)), warm[1], 2)  # (B's 64 slots, learned)
        old = m.nodes["B"]
        old.shutdown()
        b = m.nodes["B"] = KVNode(old.config.replace(cpu_bytes=4 * SLOT), old.node_id, "kvnode-B2")
        b.peers = old.peers
        toks, kv = data(2, 20)
        on_disk(m, "B", [(toks, kv)])
        wait_until(lambda: c.lookup(toks, cost_model=False).num_chunks == 20, 10)
        assert exact(c.fetch(c.lookup(toks, cost_model=False)), kv, 20)
    finally:
        c.close()


@pytest.mark.parametrize("reader", ["A", "C"], ids=["slab", "tcp"])
def test_every_damaged_chunk_of_a_run_is_dropped_at_once(mesh, reader):
    # a fetch stops at the first chunk that fails its checksum; it reported that one only, so the damaged chunks
    # after it stayed listed, and a writer that skips listed chunks (SGLang's write-back) repaired one per request
    m = mesh(A={}, C={})
    toks, kv = data(5, 6)
    c = m.client("A")
    assert c.store(toks, kv) == 6 and c.flush() == 6
    c.close()
    ks = keys(toks)
    for i in (2, 3, 4):
        (_tier, path, offset), = m.nodes["A"].locate([ks[i]])[0]
        with open(path, "r+b") as f:
            f.seek(offset + 1000)
            b = f.read(1)
            f.seek(offset + 1000)
            f.write(bytes([b[0] ^ 0x20]))
    r = m.client(reader)
    try:
        assert exact(r.fetch(r.lookup(toks, cost_model=False)), kv, 2)
        wait_until(lambda: r.lookup(toks, cost_model=False).num_chunks == 2, 5)
        assert m.nodes["A"].stats()["corrupt_dropped"] == 3
        assert r.lookup_keys(ks[0], ks[5:]).num_chunks == 1  # (the good one after them stays)
    finally:
        r.close()


def test_chunks_already_in_the_slab_are_read_in_one_run_however_many(mesh):
    # windows are for what a node must bring into its slab: twelve chunks that already lie in a 16-slot slab are
    # pinned where they lie in one run (and a device sink reads them in place), not copied window by window
    m = mesh(A=dict(cpu_bytes=16 * SLOT))
    toks, kv = data(7, 12)
    c = m.client("A")
    try:
        assert c.store(toks, kv) == 12 and c.flush() == 12
        load, n = c.fetch_to_device(c.lookup(toks, cost_model=False), "cpu")
        try:
            got = load.staging[:n].permute(1, 2, 0, 3, 4, 5).reshape(SPEC.kv_shape(n * CT))
            assert n == 12 and exact(got, kv, 12)
        finally:
            load.release()
        assert [(r.source, r.asked) for r in c.last_fetch.runs] == [("slab", 12)]
    finally:
        c.close()
