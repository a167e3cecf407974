"""What a node's tiers evict keeps cached prefixes usable: the tail of a prefix goes before its head, on the disk
tier too, also for a prompt just read back from the disk: a full disk never keeps a tail whose head it dropped (a
tail no lookup can reach). One plain KVNode with a 4-slot slab and an 8-slot disk against a real redis-server."""

import time

import torch

from kvmesh import KVSpec
from kvmesh.connecting import connect_local
from kvmesh.local import RedisServer

SPEC = KVSpec("eviction-order", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", chunk_tokens=16)
CH = SPEC.chunk_tokens


def prompt(seed: int, chunks: int):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 30000, (chunks * CH + 3,), generator=g).tolist()
    return toks, torch.randn(SPEC.kv_shape(len(toks)), generator=g).to(torch.float16)


def settle(node) -> None:
    """Disk writes done and the directory told (a lookup reads what the registrar has sent)."""
    end = time.monotonic() + 10
    while (node.stats().get("disk_pending_io", 0) or node.cascade._pending) and time.monotonic() < end:
        time.sleep(0.02)
    assert node.registrar.flush(10.0)


def test_a_prefix_read_back_from_disk_loses_its_tail_first_when_the_disk_fills(make_node):
    with RedisServer() as server:
        node = make_node("e" * 32, "kvnode-e", redis_url=server.url, key_prefix="eo", cpu_bytes=4 * SPEC.chunk_bytes,
                         slot_bytes=SPEC.chunk_bytes, disk_bytes=8 * SPEC.chunk_bytes, disk_direct_io=False,
                         lease_s=5.0, heartbeat_s=1.0,
                         lookup_timeout_s=5.0)  # (a loaded CI box: a lookup past 0.5 s is a miss)
        c = connect_local(SPEC, node)
        try:
            def put(seed: int, chunks: int):
                toks, kv = prompt(seed, chunks)
                c.store(toks, kv)
                c.flush()
                settle(node)
                return toks, kv

            p, kv = put(0, 4)
            put(1, 4)  # p goes down to the disk
            for _ in range(2):  # p read back (from the disk, then from the slab: its disk copy stays)
                assert c.fetch(c.lookup(p, cost_model=False)).shape[2] == 4 * CH
                settle(node)
            put(2, 4)
            put(3, 4)  # 2 goes to the disk, which evicts its least recent four
            put(4, 1)  # one more chunk to the disk: one chunk of p goes
            m = c.lookup(p, cost_model=False)
            assert m.num_chunks == 3  # its tail went, not its head (which left nothing usable)
            got = c.fetch(m)  # (reading it back makes room in the 4-slot slab, and the full disk may lose its tail
            n = got.shape[2]  # to that: a shorter fetch, never another chunk's bytes)
            assert n >= CH and torch.equal(got.view(torch.int16), kv[:, :, :n].view(torch.int16))
        finally:
            c.close()
            node.shutdown()
