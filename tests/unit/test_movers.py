"""Movers on CPU tensors: gathers and scatters between paged/contiguous layouts and chunks are exact inverses."""

import torch

from kvmesh import KVSpec
from bench.movers_paged import gather_contiguous, gather_paged, scatter_paged, to_host
from kvmesh.movers import layer_groups, scatter_contiguous, to_device

SPEC = KVSpec("m", num_layers=3, num_kv_heads=2, head_dim=4, dtype="float32", chunk_tokens=8)


def paged_layers(num_blocks=10, block=4):
    g = torch.Generator().manual_seed(0)
    return [torch.randn((2, num_blocks, block, 2, 4), generator=g) for _ in range(3)]


def test_gather_paged_puts_each_chunks_pages_in_token_order():
    layers = paged_layers()
    table = torch.tensor([[7, 2], [0, 9]])  # chunk 0 = blocks 7 then 2; chunk 1 = blocks 0 then 9
    chunks = gather_paged(layers, table)
    assert chunks.shape == (2, 3, 2, 8, 2, 4)
    for layer in range(3):
        for kv in range(2):
            assert torch.equal(chunks[0, layer, kv, :4], layers[layer][kv, 7])
            assert torch.equal(chunks[0, layer, kv, 4:], layers[layer][kv, 2])
            assert torch.equal(chunks[1, layer, kv, 4:], layers[layer][kv, 9])


def test_scatter_paged_is_the_inverse_of_gather():
    src = paged_layers()
    table = torch.tensor([[7, 2], [0, 9]])
    chunks = gather_paged(src, table)
    dst = [torch.zeros_like(t) for t in src]
    other = torch.tensor([[1, 3], [5, 6]])  # another engine's blocks for the same tokens
    scatter_paged(chunks, dst, other)
    assert torch.equal(gather_paged(dst, other), chunks)
    assert all(float(t[:, [0, 2, 4, 7, 8, 9]].abs().sum()) == 0 for t in dst)  # nothing else written


def test_contiguous_round_trip():
    g = torch.Generator().manual_seed(1)
    keys = [torch.randn((1, 2, 24, 4), generator=g) for _ in range(3)]
    values = [torch.randn((1, 2, 24, 4), generator=g) for _ in range(3)]
    chunks = gather_contiguous(keys, values, start=8, num_chunks=2, chunk_tokens=8)
    assert torch.equal(chunks[1, 2, 0, 3], keys[2][0, :, 8 + 8 + 3])  # chunk 1, layer 2, K, token 3: [H, D]
    k2 = [torch.zeros_like(k) for k in keys]
    v2 = [torch.zeros_like(v) for v in values]
    scatter_contiguous(chunks, k2, v2, start=8)
    assert all(torch.equal(a[:, :, 8:], b[:, :, 8:]) for a, b in zip(k2, keys))
    assert all(float(a[:, :, :8].abs().sum()) == 0 for a in k2)


def test_host_device_copies_on_cpu_are_exact_and_complete():
    chunks = torch.randn((2, *SPEC.chunk_shape))
    hosts = [bytearray(SPEC.chunk_bytes) for _ in range(2)]
    assert to_host(chunks, hosts) is None
    load = to_device(hosts, SPEC, "cpu")
    load.wait(0)
    assert torch.equal(load.staging, chunks)
    seen = []
    load.then(lambda layer, piece: seen.append((layer, piece.shape)))
    assert seen == [(i, (2, 2, 8, 2, 4)) for i in range(3)]


def test_layer_groups_cover_every_layer_once_in_big_enough_pieces():
    layer_bytes = SPEC.chunk_bytes // 3
    assert layer_groups(SPEC, 1) == [range(0, 1), range(1, 2), range(2, 3)]
    assert layer_groups(SPEC, 2 * layer_bytes) == [range(0, 2), range(2, 3)]
    assert layer_groups(SPEC, 10 * layer_bytes) == [range(0, 3)]


def test_pipelined_paged_store_and_load_round_trip():
    from bench.movers_paged import load_paged, store_paged

    spec = KVSpec("m", num_layers=3, num_kv_heads=2, head_dim=4, dtype="float32", chunk_tokens=8)
    src = paged_layers(num_blocks=12)
    table = torch.tensor([[7, 2], [0, 9], [11, 4]])
    hosts = [bytearray(spec.chunk_bytes) for _ in range(3)]
    assert store_paged(src, table, hosts, batch_chunks=2) is None
    dst = [torch.zeros_like(t) for t in src]
    load_paged(hosts, spec, dst, table, batch_chunks=2)
    assert torch.equal(gather_paged(dst, table), gather_paged(src, table))


def test_a_load_and_a_store_together_round_trip():
    from bench.movers_paged import load_and_store_paged, store_paged

    spec = KVSpec("m", num_layers=3, num_kv_heads=2, head_dim=4, dtype="float32", chunk_tokens=8)
    src = paged_layers(num_blocks=12)
    table = torch.tensor([[7, 2], [0, 9], [11, 4]])
    stored = [bytearray(spec.chunk_bytes) for _ in range(3)]
    store_paged(src, table, stored)
    # one step: load what was stored into fresh pages while storing other pages of the source
    dst = [torch.zeros_like(t) for t in src]
    other = torch.tensor([[1, 3], [5, 6]])
    out = [bytearray(spec.chunk_bytes) for _ in range(2)]
    assert load_and_store_paged((stored, spec, dst, table), (src, other, out), batch_chunks=1) == (None, None)
    assert torch.equal(gather_paged(dst, table), gather_paged(src, table))
    assert [bytes(b) for b in out] == [gather_paged(src, other)[i].numpy().tobytes() for i in range(2)]


def test_runs_group_evenly_spaced_sources_for_one_strided_copy_each():
    from kvmesh.movers import _runs

    slab = torch.zeros(12 * 64, dtype=torch.uint8)
    srcs = [slab[i * 64:(i + 1) * 64] for i in (0, 1, 2, 3, 5, 7, 9, 8, 4)]
    assert _runs(srcs, 64) == [(0, 4, 64), (4, 3, 128), (7, 1, 64), (8, 1, 64)]
    assert _runs([], 64) == [] and _runs(srcs[:1], 64) == [(0, 1, 64)]


def test_a_run_of_device_sources_moves_as_one_strided_copy():
    from kvmesh.movers import copy_run

    pool = torch.arange(16 * 64, dtype=torch.int64).view(torch.uint8)  # 16 slots of 512 bytes
    slot = 512
    flat = torch.zeros(3, slot, dtype=torch.uint8)
    for a, b, start in ((0, 512, 0), (64, 200, 8), (3, 101, 16)):  # word-aligned and not
        flat.zero_()
        src0 = pool[start * 8:start * 8 + slot]
        copy_run(flat, 0, 3, src0, 2 * slot, a, b)
        for r in range(3):
            off = start * 8 + r * 2 * slot
            assert torch.equal(flat[r, a:b], pool[off + a:off + b])
            assert not bool(flat[r, :a].any()) and not bool(flat[r, b:].any())
