"""The GPU tier's device checksum and IPC primitives where no GPU is needed: the checksum's definition and its
single-error property (on CPU tensors, the same torch ops as on the GPU), the typed fallbacks without CUDA, the
export's wire form, and a tier split over several (stand-in) devices."""

import os

import numpy as np
import pytest
import torch

from kvmesh import KVSpec
from kvmesh.tiers import checksum
from kvmesh.tiers.devsum import (Coefficients, Verify, device_checksum, device_checksums, reference_checksum,
                                 verify_on_side_stream)
from kvmesh.tiers.gpu import GpuTier
from bench.gpu_ipc_layerwise import read_to_device
from kvmesh.tiers.gpu_ipc import GpuIpcError, PoolExport, PoolMapper, read_chunks, write_chunks

NO_CUDA = not torch.cuda.is_available()


def rand_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def test_the_device_checksum_is_its_definition():
    for n in (4, 7, 64, 1001, 4096 + 3):  # whole words and 1-3 tail bytes
        b = rand_bytes(n, n)
        assert int(device_checksum(b)) == reference_checksum(b.numpy().tobytes())
    # any dtype's bytes; views at a word-aligned offset use the words in place
    x = torch.randn(8, 33).to(torch.bfloat16)
    assert int(device_checksum(x)) == reference_checksum(x.view(torch.uint8).numpy().tobytes())
    big = rand_bytes(1 << 16, 1)
    assert int(device_checksum(big[4:1028])) == reference_checksum(big[4:1028].numpy().tobytes())
    assert int(device_checksum(big[1:1025])) == reference_checksum(big[1:1025].numpy().tobytes())  # unaligned


def test_every_single_changed_byte_changes_the_checksum():
    # exhaustive over positions and over every one of the 255 other values of each byte, on a small buffer;
    # the proof (kvmesh.tiers.devsum) says it holds for any size
    base = rand_bytes(48, 7)
    s0 = int(device_checksum(base))
    for pos in range(base.numel()):
        variants = base.repeat(255, 1)
        variants[:, pos] = torch.tensor([v for v in range(256) if v != int(base[pos])], dtype=torch.uint8)
        sums = device_checksums(list(variants))
        assert bool((sums != s0).all()), f"a change at byte {pos} went unseen"
    # and on a chunk-sized buffer, at random places (every byte lane, extreme values included)
    big = rand_bytes(1 << 18, 8)
    coef = Coefficients()
    s_big = int(device_checksum(big, coef))
    rng = np.random.default_rng(9)
    for pos in [0, 1, 2, 3, big.numel() - 1, *rng.integers(0, big.numel(), 60).tolist()]:
        old = int(big[pos])
        for new in {old ^ 0x80, old ^ 0x01, 255 - old, (old + 1) % 256}:
            big[pos] = new
            assert int(device_checksum(big, coef)) != s_big
        big[pos] = old
    assert int(device_checksum(big, coef)) == s_big


def test_the_checksum_depends_on_position():
    a = torch.tensor([1, 0, 0, 0, 2, 0, 0, 0], dtype=torch.uint8)
    b = torch.tensor([2, 0, 0, 0, 1, 0, 0, 0], dtype=torch.uint8)  # two words swapped
    assert int(device_checksum(a)) != int(device_checksum(b))


def test_verify_reports_the_good_prefix():
    bufs = [rand_bytes(256, i) for i in range(4)]
    expected = [int(device_checksum(b)) for b in bufs]
    assert Verify(device_checksums(bufs), expected).result()
    bufs[2][17] ^= 1
    v = verify_on_side_stream(bufs, expected)
    assert not v.result() and v.good_prefix() == 2 and v.per_chunk() == [True, True, False, True]


@pytest.mark.skipif(not NO_CUDA, reason="the no-CUDA fallbacks")
def test_without_cuda_ipc_fails_with_a_typed_reason():
    tier = GpuTier(4, 64, device="cpu")
    with pytest.raises(GpuIpcError) as e:
        tier.exports("node", "inc-1")
    assert e.value.reason == "no_cuda"
    export = PoolExport("node", "inc-1", b"p" * 8, "GPU-x", os.getpid() + 1, b"h" * 64, 256, 64, 0, 4)
    with pytest.raises(GpuIpcError) as e:
        PoolMapper().open(export)
    assert e.value.reason == "no_cuda"
    from kvmesh.tiers.gpu_ipc import DevicePool

    with pytest.raises(GpuIpcError):
        DevicePool(1 << 20, "cpu")


def test_the_export_round_trips_and_bad_bytes_are_a_value_error():
    e = PoolExport("node", "inc-1", b"p" * 8, "GPU-1234", 42, bytes(range(64)), 4096, 1024, 8, 4)
    assert PoolExport.unpack(e.pack()) == e
    assert e.slot_offset(9) == 1024
    with pytest.raises(ValueError):
        e.slot_offset(12)
    import msgpack

    for bad in (b"\x00garbage", msgpack.packb([2, "x"]), msgpack.packb([1, "n", "i", b"p", "u", 1, b"short", 4096,
                                                                        1024, 0, 4]),
                msgpack.packb([1, "n", "i", b"p", "u", 1, b"h" * 64, 1024, 1024, 0, 4])):  # 4 slots in 1 KiB
        with pytest.raises(ValueError):
            PoolExport.unpack(bad)


def test_a_tier_over_several_devices_splits_its_slots_and_keeps_device_sums():
    tier = GpuTier(5, 64, device=["cpu", "cpu"])  # two pools (stand-ins for two GPUs): slots 0-2 and 3-4
    assert tier.per_pool == 3 and [p.numel() for p in tier.pools] == [3 * 64, 2 * 64]
    assert tier.locate(4) == (1, 64) and tier.buffer(4).data_ptr() == tier.pools[1].data_ptr() + 64
    data = rand_bytes(64, 3)
    t = tier.prepare_store(b"k" * 16, b"g" * 16, 64)
    tier.buffer(t.slot)[:] = data
    tier.complete_store(t, checksum(data.numpy()))
    assert tier.device_sum(t.slot) == reference_checksum(data.numpy().tobytes())
    assert tier.verify(t.slot) and tier.host_checksum(t.slot, data.numpy()) == checksum(data.numpy())
    # a chunk written by an engine's GPU: the writer's device sums come with it, its xxh3 is made on the way out
    t2 = tier.prepare_store(b"j" * 16, b"g" * 16, 64)
    w = write_chunks([data], [tier.buffer(t2.slot)])
    tier.complete_device_store(t2, w.sums()[0])
    assert tier.record(t2.slot).checksum == 0 and tier.verify(t2.slot)
    assert tier.host_checksum(t2.slot, data.numpy()) == checksum(data.numpy())
    tier.buffer(t2.slot)[5] ^= 0xFF  # corrupt on the device: no host copy may carry it
    assert not tier.verify(t2.slot) and tier.host_checksum(t2.slot, data.numpy()) is None
    tier.check_integrity()
    tier.close()


def test_a_corrupt_chunk_from_a_gpu_is_not_demoted(tmp_path):
    from kvmesh.cascade import Cascade
    from kvmesh.tiers.cpu import CpuTier

    cpu = CpuTier(str(tmp_path / "slab"), 3, 64)
    c = Cascade(cpu, GpuTier(1, 64, device="cpu"))
    t = c.prepare(b"a" * 16, b"g" * 16, 64)
    data = rand_bytes(64, 4)
    w = write_chunks([data], [c.gpu.buffer(t.slot)])
    c.gpu.complete_device_store(t, w.sums()[0])
    c.gpu.buffer(t.slot)[0] ^= 1
    t2 = c.prepare(b"b" * 16, b"g" * 16, 64)  # evicts a: its device bytes fail, so it is dropped, not demoted
    c.complete(t2, 0)
    assert cpu.slot_of(b"a" * 16) is None and c._corrupt == [b"a" * 16]
    c.check_integrity()
    cpu.close()


def test_reads_through_the_primitives_verify_on_the_cpu_too():
    spec = KVSpec("m", 2, 1, 8, "float32", chunk_tokens=4)
    srcs = [rand_bytes(spec.chunk_bytes, i) for i in range(3)]
    sums = [int(device_checksum(s)) for s in srcs]
    dsts = [torch.empty_like(s) for s in srcs]
    r = read_chunks(srcs, dsts, sums)
    assert r.verified() and all(torch.equal(a, b) for a, b in zip(srcs, dsts))
    load = read_to_device(srcs, spec, "cpu", sums)
    assert load.verified() and torch.equal(load.staging.view(3, -1).view(torch.uint8), torch.stack(srcs))
    bad = list(sums)
    bad[1] += 1
    assert not read_to_device(srcs, spec, "cpu", bad).verified()
    with pytest.raises(ValueError):
        read_chunks(srcs, dsts[:2], sums)


def test_reads_of_back_to_back_chunks_coalesce_into_one_copy_per_run():
    from kvmesh.tiers.gpu_ipc import _adjacent_runs

    pool, staging = torch.zeros(8 * 16, dtype=torch.uint8), torch.zeros(5 * 16, dtype=torch.uint8)
    srcs = [pool[s * 16:(s + 1) * 16] for s in (2, 3, 4, 6, 7)]
    dsts = [staging[i * 16:(i + 1) * 16] for i in range(5)]
    assert _adjacent_runs(srcs, dsts) == [(0, 3), (3, 2)]
    other = torch.zeros(16, dtype=torch.uint8)
    assert _adjacent_runs(srcs[:2], [dsts[0], other]) == [(0, 1), (1, 1)]  # another destination storage
