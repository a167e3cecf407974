"""The GPU tier through CUDA IPC, for real: the tier lives in a second process (bench.gpu_node, a stand-in KVNode
holding a real GpuTier), this process maps its pool and reads and writes slots device to device. Skipped without
a GPU; run on the H200 machine."""

import os

import pytest
import torch

from kvmesh import KVSpec
from kvmesh.tiers.devsum import device_checksum, reference_checksum
from bench.gpu_ipc_layerwise import read_to_device
from kvmesh.tiers.gpu_ipc import GpuIpcError, PoolMapper, export_for, read_chunks, write_chunks

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SPEC = KVSpec("ipc", num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", chunk_tokens=64)
CB = SPEC.chunk_bytes


@pytest.fixture(scope="module")
def node():
    from bench.gpu_node import GpuNodeProcess

    n = GpuNodeProcess(16, CB)
    yield n
    n.close()


def views(mapper, exports, slots):
    return [mapper.open(export_for(exports, s)).slot(s, CB) for s in slots]


def test_a_second_process_maps_the_pool_once_and_reads_slots_bit_exact(node):
    placed = node.store_random(4, seed=1)
    slots, sums = [s for s, _ in placed], [v for _, v in placed]
    exports = node.exports()
    assert len(exports) == 1 and exports[0].pid != os.getpid()
    mapper = PoolMapper()
    src = views(mapper, exports, slots)
    assert mapper.open(exports[0]) is mapper.open(exports[0])  # mapped once per process
    dst = [torch.empty(CB, dtype=torch.uint8, device="cuda") for _ in slots]
    r = read_chunks(src, dst, sums)
    assert r.path == "d2d" and r.verified() and r.good_prefix() == 4
    r.wait()
    for s, d in zip(slots, dst):
        host = node.chunk(s)
        assert d.cpu().numpy().tobytes() == host
        assert int(device_checksum(d)) == reference_checksum(host)  # the GPU and the definition agree
    # layer by layer into a LayerwiseLoad, as a prefill would consume it (one strided copy per layer group)
    load = read_to_device(src, SPEC, "cuda", sums, min_copy_bytes=1)
    assert len({id(e) for e in load.events}) == 4
    for layer in range(4):
        load.wait(layer)
    assert load.verified()
    assert torch.equal(load.staging.view(4, -1).view(torch.uint8), torch.stack(dst))
    # the host path (what a GPU without peer access to the pool's GPU takes), forced on one GPU
    again = [torch.zeros_like(d) for d in dst]
    h = read_chunks(src, again, sums, peer=False)
    assert h.path == "host" and h.verified() and all(torch.equal(a, b) for a, b in zip(again, dst))
    mapper.close()


def test_a_corrupt_slot_fails_verification_and_the_fetch_truncates_there(node):
    placed = node.store_random(3, seed=2)
    slots, sums = [s for s, _ in placed], [v for _, v in placed]
    node.corrupt(slots[1], offset=12345)
    assert node.verify(slots) == [True, False, True]
    mapper = PoolMapper()
    dst = [torch.empty(CB, dtype=torch.uint8, device="cuda") for _ in slots]
    r = read_chunks(views(mapper, node.exports(), slots), dst, sums)
    assert not r.verified() and r.good_prefix() == 1
    node.corrupt(slots[1], offset=12345)  # the same flip again: the slot is whole again for the tests after
    assert node.verify(slots) == [True, True, True]
    mapper.close()


def test_a_device_to_device_store_lands_verified_and_carries_its_device_sums(node):
    mapper = PoolMapper()
    slots = node.reserve(3)
    src = [torch.randint(0, 256, (CB,), dtype=torch.uint8, device="cuda") for _ in slots]
    torch.cuda._sleep(int(2e8))  # the engine's compute stream is still busy: the store must wait for it
    w = write_chunks(src, views(mapper, node.exports(), slots))
    sums = w.sums()
    assert w.path == "d2d" and sums == [int(device_checksum(s)) for s in src]
    assert node.complete_device(slots, sums) == [True, True, True]
    for s, x in zip(slots, src):
        assert node.chunk(s) == x.cpu().numpy().tobytes()
    node.check_integrity()
    mapper.close()


def test_an_export_of_this_process_is_read_without_ipc():
    from kvmesh.tiers import checksum
    from kvmesh.tiers.gpu import GpuTier

    tier = GpuTier(2, CB, "cuda")
    t = tier.prepare_store(b"k" * 16, b"g" * 16, CB)
    tier.buffer(t.slot).copy_(torch.randint(0, 256, (CB,), dtype=torch.uint8, device="cuda"))
    tier.complete_store(t, checksum(tier.buffer(t.slot).cpu().numpy()))
    mapper = PoolMapper()
    v = views(mapper, tier.exports("me", "inc"), [t.slot])[0]
    assert v.data_ptr() == tier.buffer(t.slot).data_ptr()
    assert tier.verify(t.slot) and int(device_checksum(v)) == tier.device_sum(t.slot)
    mapper.close()
    export = tier.exports("me", "inc")[0]
    tier.close()
    del v
    with pytest.raises(GpuIpcError) as e:
        PoolMapper().open(export)  # a pool this process closed is not read again
    assert e.value.reason == "closed"


def test_a_gpu_this_process_cannot_see_is_a_typed_error(node):
    from dataclasses import replace

    e0 = node.exports()[0]
    with pytest.raises(GpuIpcError) as e:
        PoolMapper().open(replace(e0, device_uuid="GPU-00000000-0000-0000-0000-000000000000"))
    assert e.value.reason == "device_not_visible"
    # a handle the driver does not know: refused with a reason, and torch keeps working afterwards
    with pytest.raises(GpuIpcError) as e:
        PoolMapper().open(replace(e0, handle=bytes(64), pool_id=b"x" * 8))
    assert e.value.reason == "ipc_unsupported"
    assert float(torch.ones(4, device="cuda").sum()) == 4.0


def test_strided_layerwise_loads_equal_chunk_by_chunk_copies():
    from kvmesh.movers import to_device

    host = torch.randint(0, 256, (10, CB), dtype=torch.uint8).pin_memory()
    order = [0, 1, 2, 3, 5, 7, 9, 8, 4]  # runs of consecutive slots, an evenly spaced run, a step back
    srcs = [host[i] for i in order]
    a = to_device(srcs, SPEC, "cuda", min_copy_bytes=1, strided=True)
    b = to_device(srcs, SPEC, "cuda", min_copy_bytes=1, strided=False)
    a.synchronize()
    b.synchronize()
    as_bytes = [x.staging.view(len(order), -1).view(torch.uint8) for x in (a, b)]  # (random bf16 holds NaNs)
    assert torch.equal(as_bytes[0], as_bytes[1])
    assert torch.equal(as_bytes[0].cpu(), host[order])
    # device sources (a GPU-tier pool): the runs move as strided copy kernels
    dev = host.cuda()
    c = to_device([dev[i] for i in order], SPEC, "cuda", min_copy_bytes=1)
    c.synchronize()
    assert torch.equal(c.staging.view(len(order), -1).view(torch.uint8).cpu(), host[order])


def test_a_restarted_node_is_never_read_through_an_old_mapping(node):
    mapper = PoolMapper()
    old = node.exports()
    placed = node.store_random(1, seed=3)
    before = views(mapper, old, [placed[0][0]])[0].clone()
    node.restart("inc-2")
    new = node.exports()
    assert new[0].pool_id != old[0].pool_id and new[0].incarnation == "inc-2"
    mapper.seen(node.node_id, "inc-2")  # a reply of the new incarnation: the old mappings are dropped
    with pytest.raises(GpuIpcError) as e:
        mapper.open(old[0])
    assert e.value.reason == "stale"
    placed2 = node.store_random(1, seed=4)
    fresh = views(mapper, new, [placed2[0][0]])[0]
    assert fresh.cpu().numpy().tobytes() == node.chunk(placed2[0][0])
    assert not torch.equal(fresh, before)
    mapper.close()
