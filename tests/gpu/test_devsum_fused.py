"""The fused device checksum (kvmesh.tiers.devsum_triton) on a real GPU: the sums of the definition
(`reference_checksum`) for every size and alignment, rows at a start offset and with a row stride as the layer-group
verification reads them, equal to the torch ops, every single changed word caught; and the switch back to the
torch ops. Skips without CUDA or without Triton (a CPU build of torch has neither)."""

import numpy as np
import pytest
import torch

from kvmesh.tiers import devsum
from kvmesh.tiers.devsum import Coefficients, device_checksum, device_checksums, fused_ok, reference_checksum

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
triton = pytest.importorskip("triton")
BLOCK = pytest.importorskip("kvmesh.tiers.devsum_triton").BLOCK
DEV = torch.device("cuda", 0)


def rand(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def test_the_fused_kernel_is_used_on_this_gpu():
    assert fused_ok(DEV)  # Triton is here: a False would mean the kernel failed its check against the torch ops


@pytest.mark.parametrize("nbytes", [1, 3, 4, 7, 4 * BLOCK - 4, 4 * BLOCK, 4 * BLOCK + 9, 3 * 4 * BLOCK + 4, 1 << 22])
def test_sums_are_the_definition_for_every_size(nbytes):
    b = rand(nbytes, nbytes)
    assert int(device_checksum(b.to(DEV))) == reference_checksum(b.numpy().tobytes())


def test_sums_of_unaligned_views_and_of_other_dtypes_are_the_definition():
    big = rand(4 * BLOCK + 64, 1)
    g = big.to(DEV)
    for a, b in ((1, 4 * BLOCK + 1), (2, 4 * BLOCK + 63), (4, 4 * BLOCK + 4)):
        assert int(device_checksum(g[a:b])) == reference_checksum(big[a:b].numpy().tobytes())
    x = torch.randn(3, 5, 7, dtype=torch.bfloat16, device=DEV)
    assert int(device_checksum(x)) == reference_checksum(x.cpu().view(torch.uint8).numpy().tobytes())
    nc = torch.randn(64, 96, device=DEV).t()  # not contiguous: summed over the bytes in row-major order
    assert int(device_checksum(nc)) == reference_checksum(nc.contiguous().cpu().view(torch.uint8).numpy().tobytes())


def test_rows_at_a_start_offset_with_a_row_stride_equal_the_torch_ops():
    flat = rand(5 * 4 * (2 * BLOCK + 40), 2).to(DEV).view(5, -1)
    words = flat.view(torch.int32)
    n = words.shape[1]
    c = devsum._constants(n, DEV)
    for a, b in ((0, n), (3, 3 + BLOCK), (BLOCK + 1, n), (n - 1, n)):
        got = Coefficients().row_sums(words[:, a:b], a)
        want = torch.mul(words[:, a:b], c[a:b]).sum(dim=1, dtype=torch.int64)
        assert torch.equal(got, want)
    parts = [Coefficients().row_sums(words[:, a:b], a) for a, b in ((0, 77), (77, BLOCK + 5), (BLOCK + 5, n))]
    whole = [reference_checksum(flat[i].cpu().numpy().tobytes()) for i in range(5)]
    assert (parts[0] + parts[1] + parts[2]).tolist() == whole  # layer groups add up to the chunk's S


def test_every_single_changed_word_changes_the_sum():
    b = rand(4 * (BLOCK + 3), 3).to(DEV)
    base = int(device_checksum(b))
    gen = np.random.default_rng(4)
    for pos in [0, 3, 4 * BLOCK - 1, 4 * BLOCK, 4 * (BLOCK + 3) - 1, *gen.integers(0, b.numel(), 20).tolist()]:
        for delta in (1, 128, 255):
            c = b.clone()
            c[pos] = (int(c[pos]) + delta) % 256
            assert int(device_checksum(c)) != base


def test_many_buffers_at_once_and_on_a_side_stream():
    bufs = [rand(4 * BLOCK + 4 * i + 1, 10 + i) for i in range(6)]
    want = [reference_checksum(x.numpy().tobytes()) for x in bufs]
    s = torch.cuda.Stream(DEV)
    with torch.cuda.stream(s):
        got = device_checksums([x.to(DEV, non_blocking=False) for x in bufs])
    s.synchronize()
    assert got.tolist() == want


def test_the_torch_ops_are_used_when_asked_and_give_the_same_sums(monkeypatch):
    b = rand(4 * BLOCK + 12, 5).to(DEV)
    fused = int(device_checksum(b))
    monkeypatch.setenv("KVMESH_DEVICE_CHECKSUM", "torch")
    assert not fused_ok(DEV)
    co = Coefficients()
    assert int(device_checksum(b, co)) == fused == reference_checksum(b.cpu().numpy().tobytes())
    assert co._by_device  # the torch ops built their constants


def test_a_kernel_that_fails_later_leaves_the_torch_ops_with_the_same_sums(monkeypatch):
    from kvmesh.tiers import devsum_triton

    b = rand(4 * BLOCK + 12, 6).to(DEV)
    want = reference_checksum(b.cpu().numpy().tobytes())
    assert fused_ok(DEV)

    def broken(words, start=0):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(devsum_triton, "row_sums", broken)
    monkeypatch.setattr(devsum, "_fused_by_device", {})  # (the module's own is restored after this test)
    monkeypatch.setattr(devsum, "_check_fused", lambda device: True)
    assert int(device_checksum(b)) == want
    assert not fused_ok(DEV)  # turned off for this device once it failed


def test_evenly_spaced_buffers_are_summed_at_once_and_others_one_by_one():
    pool = rand(6 * 4 * (BLOCK + 8), 7).to(DEV)
    slot = 4 * (BLOCK + 8)
    slots = [pool[i * slot:(i + 1) * slot] for i in (0, 1, 2, 3, 4, 5)]
    assert devsum._as_rows([devsum._words(b) for b in slots]) is not None
    want = [reference_checksum(b.cpu().numpy().tobytes()) for b in slots]
    assert device_checksums(slots).tolist() == want
    part = [pool[i * slot:i * slot + slot // 2] for i in (0, 1, 2)]  # spaced a slot apart, half a slot each
    assert device_checksums(part).tolist() == [reference_checksum(b.cpu().numpy().tobytes()) for b in part]
    uneven = [slots[0], slots[2], slots[3]]
    assert devsum._as_rows([devsum._words(b) for b in uneven]) is None
    assert device_checksums(uneven).tolist() == [want[0], want[2], want[3]]


def test_buffers_anywhere_are_summed_in_one_launch_per_length(monkeypatch):
    """A hit's chunks landed in separate allocations (an engine's own pages): their addresses go to the kernel in one
    device array, one launch per length of buffer; unaligned and odd-sized ones included."""
    from kvmesh.tiers import devsum_triton

    sizes = [4 * (BLOCK + 8)] * 5 + [4 * 3 * BLOCK + 12] * 3 + [6, 4 * BLOCK]
    bufs = [rand(n, 20 + k).to(DEV) for k, n in enumerate(sizes)]
    bufs[1] = torch.cat([torch.zeros(4, dtype=torch.uint8, device=DEV), bufs[1]])[4:]  # 4 bytes off 16
    want = [reference_checksum(b.cpu().numpy().tobytes()) for b in bufs]
    launches = []
    real = devsum_triton.buffer_sums
    monkeypatch.setattr(devsum_triton, "buffer_sums", lambda bs: launches.append(len(bs)) or real(bs))
    assert device_checksums(bufs).tolist() == want
    assert sorted(launches) == [1, 1, 3, 5]  # one per length
    with torch.cuda.stream(torch.cuda.Stream(DEV)):
        got = device_checksums(bufs)
        torch.cuda.current_stream(DEV).synchronize()
    assert got.tolist() == want
