"""Stores that go device to device into a KVNode's GPU tier (reserve_gpu -> gpu_ipc.write_chunks -> commit_gpu),
against a plain KVNode and a real redis-server. Without CUDA the GPU tier lives on the CPU stand-in device, and the
writer's "mapped pools" are the tier's own buffers: the same reservations, sums, commits, cascade and fallbacks.
tests/gpu/test_d2d_store.py runs the CUDA path itself."""

from collections import Counter

import numpy as np
import pytest
import redis
import torch

from kvmesh import KVSpec
from kvmesh.actor import KVNodeActor
from kvmesh.handle import LocalHandle
from kvmesh.node import KVNode
from kvmesh.storequeue import StoreQueue
from kvmesh.tiers import TIER_CPU, TIER_GPU
from kvmesh.tiers.devsum import reference_checksum
from kvmesh.tiers.gpu_ipc import write_chunks
from kvmesh.wire import (GpuReserved, StoreItem, WireError, pack_gpu_commit, pack_gpu_reserve, pack_keys,
                         unpack_chunk_header, unpack_gpu_commit, unpack_gpu_reserve, unpack_gpu_reserved)
from tests.conftest import wait_until

SPEC = KVSpec("d2d-store", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)
CB = SPEC.chunk_bytes
G = b"g" * 16


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def d2d_node(make_node, private_redis, name: str, gpu_slots: int = 2, **kw) -> KVNode:
    redis.Redis.from_url(private_redis.url).flushall()
    return make_node(name * 4, "kvnode-" + name, redis_url=private_redis.url, key_prefix="d2d", cpu_bytes=4 * CB,
                     slot_bytes=CB, gpu_bytes=gpu_slots * CB, gpu_device="cpu", heartbeat_s=0.1, **kw)


@pytest.fixture
def node(private_redis, make_node):
    return d2d_node(make_node, private_redis, "node-r")


def chunk(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(SPEC.chunk_shape, generator=g).to(torch.bfloat16)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def items(*ids: int) -> list[StoreItem]:
    return [StoreItem(G, k(i), CB, 0) for i in ids]


def tiers(node, ids) -> list:
    d = node.directory
    return [r[0].tier for r in d.longest_prefix(d.lookup_raw(G, [k(i) for i in ids]), d.node_table())]


def pulled(node, ids) -> list[bytes]:
    p = node.pull([k(i) for i in ids])  # what a peer reads: verified by the node on the way out
    offs = np.cumsum([0] + [n for n, _ in p.rows])
    return [p.data[offs[j]:offs[j + 1]].tobytes() for j in range(len(p.rows))]


class Pools:
    """A writer's view of the node's GPU pools (dataplane.gpureads.GpuReads), here the CPU stand-in's buffers."""

    def __init__(self, node: KVNode, incarnation: str | None = None) -> None:
        self.tier = node.cascade.gpu
        self.devices = {torch.device("cpu")}
        self.incarnation = node.info.slab_path if incarnation is None else incarnation

    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        return self.tier.buffer(slot)[:nbytes]


def test_reserve_write_commit_reads_back_bit_exact_and_evicts_down_bit_exact(node):
    gpu = node.cascade.gpu
    # the writer asks for two slots, writes its chunks into them, and commits with the sums of what landed
    r = node.reserve_gpu(items(1, 2))
    assert None not in r.slots and r.slab_path == node.info.slab_path
    assert node.pin([k(1)]).chunks == []  # reserved, not readable yet
    w = write_chunks([chunk(i).view(-1).view(torch.uint8) for i in (1, 2)], [gpu.buffer(s)[:CB] for s in r.slots])
    assert w.sums() == [reference_checksum(raw(chunk(i))) for i in (1, 2)]  # the definition, bit for bit
    assert node.commit_gpu(r.reservation_id, w.sums()) == 2
    assert tiers(node, [1, 2]) == [TIER_GPU, TIER_GPU]  # registered like any stored chunk
    assert [gpu.device_sum(s) for s in r.slots] == w.sums()  # what the tier verifies on later reads
    assert all(gpu.verify(s) for s in r.slots)
    assert [gpu.chunk_view(s).numpy().tobytes() for s in r.slots] == [raw(chunk(1)), raw(chunk(2))]
    st = node.stats()
    assert st["stored_chunks_d2d"] == 2 and st["gpu_reserved_chunks"] == 2
    # two more (the tier holds two): 1 and 2 are demoted to the CPU tier, bit-exact
    r2 = node.reserve_gpu(items(3, 4))
    w2 = write_chunks([chunk(i).view(-1).view(torch.uint8) for i in (3, 4)], [gpu.buffer(s)[:CB] for s in r2.slots])
    assert node.commit_gpu(r2.reservation_id, w2.sums()) == 2
    assert tiers(node, [1, 2, 3, 4]) == [TIER_CPU, TIER_CPU, TIER_GPU, TIER_GPU]
    assert node.stats()["demotions"] == 2  # (device sums checked on the way down, xxh3 computed on the host)
    assert pulled(node, [1, 2, 3, 4]) == [raw(chunk(i)) for i in (1, 2, 3, 4)]  # peers read both tiers
    node.check_integrity(directory=True)


def test_a_commit_whose_sum_does_not_match_the_slot_registers_nothing(node):
    gpu = node.cascade.gpu
    r = node.reserve_gpu(items(1, 2))
    w = write_chunks([chunk(i).view(-1).view(torch.uint8) for i in (1, 2)], [gpu.buffer(s)[:CB] for s in r.slots])
    sums = w.sums()
    # chunk 2's write "landed elsewhere" (a stale mapping): the slot does not hold what the writer summed
    assert node.commit_gpu(r.reservation_id, [sums[0], sums[1] ^ 1]) == 1
    assert tiers(node, [1, 2]) == [TIER_GPU]
    assert node.stats()["store_d2d_mismatch"] == 1 and len(gpu._free) == 1  # the slot is free again
    assert node.commit_gpu(r.reservation_id, sums) == 0  # a reservation commits once
    node.check_integrity(directory=True)


def test_a_reservation_never_committed_is_released_after_the_pin_ttl(private_redis, make_node):
    n = d2d_node(make_node, private_redis, "node-t", pin_ttl_s=0.3)
    try:
        gpu = n.cascade.gpu
        r = n.reserve_gpu(items(1, 2))  # the writer dies here
        assert None not in r.slots and not gpu._free
        assert n.reserve_gpu(items(3)).slots == [None]  # both slots reserved: no room, nothing evicted
        wait_until(lambda: n.stats().get("gpu_reservations_expired") == 1, 5)
        assert len(gpu._free) == 2 and not gpu._by_key  # released, never registered
        assert n.commit_gpu(r.reservation_id, [1, 2]) == 0  # a late commit finds nothing
        assert n.stats()["gpu_commit_unknown"] == 1
        assert n.reserve_gpu(items(3)).slots != [None]  # the room is back
        n.check_integrity(directory=True)
    finally:
        n.shutdown()


def test_a_store_without_room_takes_the_host_path_and_the_next_one_goes_device_to_device(node):
    q = StoreQueue(SPEC, LocalHandle(node, node.node_id), Counter())
    held = node.reserve_gpu(items(8, 9))  # another writer holds both GPU slots (pinned until it commits)
    chunks = [chunk(i) for i in (1, 2)]
    q._store_d2d(G, [k(1), k(2)], chunks, None, Pools(node))
    # today's host path, with today's outcome: a top tier whose every slot is pinned refuses the store (counted)
    assert q.flush() == 0 and node.stats()["store_refused_full"] == 2
    assert q.counts["store_d2d_fallback"] == 2 and q.counts["stored_chunks_d2d"] == 0 and not q.counts[
        "store_failures"]
    node.commit_gpu(held.reservation_id, [None, None])  # the other writer gives its slots back
    q._store_d2d(G, [k(1), k(2)], chunks, None, Pools(node))
    assert q.flush() == 2 and q.counts["stored_chunks_d2d"] == 2
    assert tiers(node, [1, 2]) == [TIER_GPU, TIER_GPU]
    assert pulled(node, [1, 2]) == [raw(c) for c in chunks]
    node.check_integrity(directory=True)


def test_a_store_with_room_for_some_writes_those_device_to_device_and_the_rest_through_the_host(node):
    q = StoreQueue(SPEC, LocalHandle(node, node.node_id), Counter())
    held = node.reserve_gpu(items(9))  # one of the two GPU slots is taken
    chunks = [chunk(i) for i in (1, 2, 3)]
    q._store_d2d(G, [k(1), k(2), k(3)], chunks, None, Pools(node))
    assert q.flush() == 3
    assert q.counts["stored_chunks_d2d"] == 1 and q.counts["store_d2d_fallback"] == 2
    assert node.stats()["stored_chunks_d2d"] == 1 and len(tiers(node, [1, 2, 3])) == 3
    assert pulled(node, [1, 2, 3]) == [raw(c) for c in chunks]
    node.commit_gpu(held.reservation_id, [None])
    node.check_integrity(directory=True)


def test_a_store_queue_writes_strided_chunks_device_to_device(node):
    q = StoreQueue(SPEC, LocalHandle(node, node.node_id), Counter())
    kv = torch.randn(SPEC.kv_shape(64)).to(torch.bfloat16)
    chunks = [kv[:, :, i * 32:(i + 1) * 32] for i in range(2)]  # as client.store slices them: not contiguous
    assert not chunks[0].is_contiguous()
    q._store_d2d(G, [k(1), k(2)], chunks, None, Pools(node))
    assert q.flush() == 2 and q.counts["stored_chunks_d2d"] == 2
    assert tiers(node, [1, 2]) == [TIER_GPU, TIER_GPU]
    assert pulled(node, [1, 2]) == [raw(c) for c in chunks]
    node.check_integrity(directory=True)


def test_slots_of_another_incarnation_are_not_written_and_go_back(node):
    q = StoreQueue(SPEC, LocalHandle(node, node.node_id), Counter())
    q._store_d2d(G, [k(1)], [chunk(1)], None, Pools(node, incarnation="/dev/shm/an-older-slab"))
    assert q.flush() == 1 and q.counts["store_d2d_stale"] == 1
    # released by the commit, then filled by the host store
    assert tiers(node, [1]) == [TIER_GPU] and node.stats()["store_d2d_not_written"] == 1
    assert q.counts["stored_chunks_d2d"] == 0 and node.stats().get("stored_chunks_d2d", 0) == 0
    node.check_integrity(directory=True)


def test_a_node_without_a_gpu_tier_reserves_nothing_and_the_store_takes_the_host_path(private_redis, make_node):
    n = d2d_node(make_node, private_redis, "node-n", gpu_slots=0)
    try:
        assert n.cascade.gpu is None
        assert n.reserve_gpu(items(1, 2)).slots == [None, None]
        q = StoreQueue(SPEC, LocalHandle(n, n.node_id), Counter())
        q._store_d2d(G, [k(1)], [chunk(1)], None, Pools.__new__(Pools))  # (nothing of the pools is used)
        assert q.flush() == 1 and tiers(n, [1]) == [TIER_CPU]
        assert pulled(n, [1]) == [raw(chunk(1))]
    finally:
        n.shutdown()


def test_a_node_that_cannot_reserve_is_the_host_path_not_an_error(node):
    class OldNode(LocalHandle):  # a node of an older version: no reserve_gpu (a NodeCallError from the actor)
        def reserve_gpu(self, items):
            from kvmesh.handle import Done, NodeCallError

            return Done(error=NodeCallError("no such method"))

    q = StoreQueue(SPEC, OldNode(node, node.node_id), Counter())
    q._store_d2d(G, [k(1)], [chunk(1)], None, Pools(node))
    assert q.flush() == 1 and q.counts["store_d2d_unavailable"] == 1 and tiers(node, [1]) == [TIER_GPU]
    assert pulled(node, [1]) == [raw(chunk(1))] and not node.stats().get("stored_chunks_d2d")


def test_the_wire_edge_reserves_and_commits_and_refuses_malformed_messages(node):
    edge = KVNodeActor.around(node)
    gpu = node.cascade.gpu
    r = unpack_gpu_reserved(edge.reserve_gpu(pack_gpu_reserve(items(1, 2), "reader")))
    assert None not in r.slots
    w = write_chunks([chunk(i).view(-1).view(torch.uint8) for i in (1, 2)], [gpu.buffer(s)[:CB] for s in r.slots])
    assert edge.commit_gpu(pack_gpu_commit(r.reservation_id, w.sums())) == 2  # negative int64 sums survive u64
    header, data = edge.pull(pack_keys([k(1), k(2)]))
    assert len(unpack_chunk_header(header)) == 2 and data.tobytes() == raw(chunk(1)) + raw(chunk(2))
    for bad in (b"junk", pack_keys([k(1)])[:3], pack_gpu_commit(1, [1])):
        with pytest.raises(WireError):
            edge.reserve_gpu(bad)
    with pytest.raises(WireError):
        edge.commit_gpu(pack_gpu_reserve(items(1)))
    # round trips, and fields appended by a later version are ignored
    assert unpack_gpu_reserve(pack_gpu_reserve(items(3), "x")) == (items(3), "x")
    assert unpack_gpu_commit(pack_gpu_commit(7, [-5, None])) == (7, [-5, None])
    assert unpack_gpu_reserved(pack_gpu_reserved_with_extra()) == GpuReserved(3, [4, None], "p")
    node.check_integrity(directory=True)


def pack_gpu_reserved_with_extra() -> bytes:
    import msgpack

    return msgpack.packb([1, 3, [4, None], "p", "a field of a later version"])
