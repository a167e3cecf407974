"""Device checksums of CPU-slab chunks: computed on the host bit for bit as the device computes them, recorded in
the slot only while its bytes are the chunk's, carried by pin replies (old replies still parse), and checked by a
device sink over the bytes as they landed (xxh3 where none is known). The device sink runs on the CPU here;
tests/gpu runs it on CUDA."""

import concurrent.futures

import msgpack
import numpy as np
import pytest
import torch

from kvmesh import KVSpec
from kvmesh.dataplane.sinks import DeviceSink, _DeviceCheck
from kvmesh.tiers import checksum
from kvmesh.tiers.cpu import CpuTier
from kvmesh.tiers.devsum import (Coefficients, device_checksum, host_device_checksum, reference_checksum,
                                 verify_rows_by_layer)
from kvmesh.wire import PinnedChunk, WireError, pack_pin_reply, unpack_pin_reply

SPEC = KVSpec("slab-devsum", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=8)
SLOT = SPEC.chunk_bytes


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def rand_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def tier(tmp_path):
    t = CpuTier(str(tmp_path / "slab"), num_slots=4, slot_bytes=SLOT)
    yield t
    t.close()


def put(tier: CpuTier, i: int) -> int:
    ticket = tier.prepare_store(key(i), b"g" * 16, SLOT)
    assert ticket is not None
    data = rand_bytes(SLOT, i)
    tier.buffer(ticket.slot)[:SLOT] = data
    tier.complete_store(ticket, checksum(data))
    return ticket.slot


def record_all(tier: CpuTier) -> int:
    """What the node's device-checksum thread does (here in one go): returns how many it recorded."""
    work = tier.take_devsum_work(100)
    for w in work:
        tier.finish_devsum(w, tier.compute_devsum(w))
    return sum(tier.record(w.slot).devsum is not None for w in work)


def test_the_host_path_is_the_definition_block_by_block():
    for n in (4, 7, 1001, 3 * 4096 + 2):  # whole words, tails; more words than one block
        b = rand_bytes(n, n)
        t = torch.frombuffer(bytearray(b), dtype=torch.uint8)
        assert host_device_checksum(t, block_words=1024) == reference_checksum(b) == int(device_checksum(t))


def test_a_readable_chunk_gets_its_sum_and_loses_it_when_the_slot_changes_hands(tier):
    s1, s2 = put(tier, 1), put(tier, 2)
    assert tier.devsum_queued() == 2 and tier.devsum_pending() == 2
    work = tier.take_devsum_work(100)
    assert [w.slot for w in work] == [s1, s2] and tier.record(s1).pins == 0  # (never kept from eviction)
    for w in work:
        tier.finish_devsum(w, tier.compute_devsum(w))
    assert tier.devsum_pending() == 0 and tier.devsum_queued() == 0
    assert tier.record(s1).devsum == reference_checksum(bytes(tier.chunk_view(s1)))
    tier.check_integrity(verify_checksums=True)  # (which re-checks the recorded sums too)
    # the chunk goes, another takes its slot: the old sum is gone, the new chunk gets its own
    tier.discard(key(1))
    s3 = put(tier, 3)
    assert s3 == s1 and tier.record(s3).devsum is None
    assert record_all(tier) == 1
    assert tier.record(s3).devsum == reference_checksum(rand_bytes(SLOT, 3))


def test_bytes_that_no_longer_match_their_xxh3_get_no_sum(tier):
    s = put(tier, 1)
    tier.buffer(s)[10] ^= 0x01  # corrupted in the slab before the thread came to it
    assert record_all(tier) == 0 and tier.record(s).devsum is None


def test_a_slot_that_changes_hands_while_its_sum_is_computed_records_none(tier):
    s = put(tier, 1)
    (w,) = tier.take_devsum_work(100)
    tier.discard(key(1))  # evicted (or dropped) meanwhile: the thread never holds it back
    tier.finish_devsum(w, tier.compute_devsum(w))
    assert tier.record(s).key is None and tier.record(s).devsum is None
    # the same chunk stored again into the same slot while a sum over the old bytes was under way
    put(tier, 1)
    (w,) = tier.take_devsum_work(100)
    tier.discard(key(1))
    assert put(tier, 1) == s
    tier.finish_devsum(w, 12345)  # computed over bytes of the slot's previous store: void
    assert tier.record(s).devsum is None
    assert record_all(tier) == 1
    tier.check_integrity(verify_checksums=True)


def test_pin_replies_carry_the_sums_and_old_replies_still_parse():
    rows = [PinnedChunk(1, 64, 5, -(2**63)), PinnedChunk(2, 64, 6, None), PinnedChunk(3, 64, 7, 2**63 - 1)]
    _pin, got, path, gpu = unpack_pin_reply(pack_pin_reply(9, rows, "/dev/shm/x"))
    assert got == rows and path == "/dev/shm/x" and gpu == []
    old = msgpack.packb([1, 9, [[1, 64, 5], [2, 64, 6]], "/dev/shm/x", []])  # a node from before the field
    assert [r.devsum for r in unpack_pin_reply(old)[1]] == [None, None]
    for bad in ([1], ["x", None], [None, -1], [None, True]):  # one per slab chunk, u64 or nil
        with pytest.raises(WireError):
            unpack_pin_reply(msgpack.packb([1, 9, [[1, 64, 5], [2, 64, 6]], "/dev/shm/x", [], bad]))


def _chunks(n: int) -> list[bytearray]:
    return [bytearray(rand_bytes(SLOT, 100 + i)) for i in range(n)]


@pytest.mark.parametrize("recorded", [True, False], ids=["devsum", "xxh3"])
def test_a_device_sink_catches_a_flipped_byte_in_an_adopted_slab_chunk(recorded):
    """Chunk 1's slab bytes change after its sums were taken (between the pin and the DMA): the device sink finds
    it by the device checksum of what landed where the node recorded one, else by xxh3 on its threads; either way
    chunk 0 is usable, chunk 1 is reported to the holder once, and the load says 1."""
    srcs = _chunks(3)
    sums = [(checksum(bytes(b)), reference_checksum(bytes(b))) for b in srcs]
    srcs[1][SLOT // 2] ^= 0x40
    bad: list[int] = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sink = DeviceSink(SPEC, torch.device("cpu"), pool)
        sink.prepare([])
        for i, src in enumerate(srcs):
            assert sink.adopt(i, memoryview(src), sums[i][0], lambda i=i: bad.append(i),
                              sums[i][1] if recorded else None)
        load, n = sink.finish(3)
        assert n == 3
        on_device = [i for i, c in zip(load.checked, load.checks) if isinstance(c, _DeviceCheck)]
        assert on_device == ([0, 1, 2] if recorded else [])
        assert load.first_unverified() == 1 and not load.verified()
        load.release()
    assert bad == [1]


def test_sums_by_layer_group_fall_back_to_whole_rows_off_cuda():
    flat = torch.frombuffer(bytearray(rand_bytes(3 * SLOT, 5)), dtype=torch.uint8).view(3, SLOT)
    want = [reference_checksum(flat[i].numpy().tobytes()) for i in range(3)]
    v = verify_rows_by_layer(flat, [0, 2], [want[0], want[2] + 1], [None] * SPEC.num_layers, Coefficients())
    assert v.per_chunk() == [True, False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sums_by_layer_group_on_cuda_add_up_to_the_whole_chunk():
    from kvmesh.movers import to_device

    srcs = [torch.frombuffer(bytearray(rand_bytes(SLOT, 200 + i)), dtype=torch.uint8).pin_memory()
            for i in range(5)]
    load = to_device(srcs, SPEC, "cuda", min_copy_bytes=1)  # a layer group per layer
    flat = load.staging.view(5, -1).view(torch.uint8)
    want = [reference_checksum(s.numpy().tobytes()) for s in srcs]
    want[3] += 1
    v = verify_rows_by_layer(flat, [1, 3, 4], [want[1], want[3], want[4]], load.events)
    assert v.per_chunk() == [True, False, True]
