"""kvmesh.paged: block layouts <-> chunks, on small fake caches (no engine needed)."""

import pytest
import torch

from kvmesh.paged import HeadMajorCodec, gather_chunks, learn_codec, scatter_layer

BS, H, D = 4, 2, 3  # tiny blocks: 4 tokens, 2 KV heads of 3


def token_kv(num_tokens: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [T, H, D] whose every element is distinct and says where it belongs."""
    t = torch.arange(num_tokens).view(-1, 1, 1)
    h = torch.arange(H).view(1, -1, 1)
    d = torch.arange(D).view(1, 1, -1)
    k = (1000 * layer + 100 * t + 10 * h + d).float()
    return k, -k - 1


def vec_write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """What vLLM's AVX-512 CPU kernel does (checked on vLLM 0.32): per block and head, K transposed
    [D, block_size], then V [block_size, D], in a cache of logical shape [blocks, H, block_size, 2*D]."""
    nb = cache.shape[0]
    flat = cache.view(nb, H, 2 * BS * D)
    for i, slot in enumerate(slots.tolist()):
        b, t = divmod(slot, BS)
        for h in range(H):
            flat[b, h, :BS * D].view(D, BS)[:, t] = key[i, h]
            flat[b, h, BS * D:].view(BS, D)[t] = value[i, h]


def chunk_of(layers_kv, tokens: slice) -> torch.Tensor:
    """The expected chunk [L, 2, C, H, D] of a token range."""
    return torch.stack([torch.stack([k[tokens], v[tokens]]) for k, v in layers_kv])


def test_a_learned_codec_finds_the_cpu_kernels_packing_and_moves_chunks_both_ways():
    probe = lambda k, v, cache: vec_write(k, v, cache, torch.arange(BS, 2 * BS))  # noqa: E731
    codec = learn_codec(probe, (H, BS, 2 * D), BS, H, D, torch.bfloat16)
    # two layers of 6 blocks; a 2-chunk prompt (chunk = 2 blocks) lives in blocks 5, 1 | 4, 2
    blocks = torch.tensor([5, 1, 4, 2])
    slots = (blocks.view(-1, 1) * BS + torch.arange(BS)).reshape(-1)
    kvs = [token_kv(4 * BS, layer) for layer in range(2)]
    layers = [torch.zeros(6, H, BS, 2 * D) for _ in range(2)]
    for layer, (k, v) in zip(layers, kvs):
        vec_write(k, v, layer, slots)
    out = gather_chunks(layers, codec, blocks, torch.empty(2, 2, 2, 2 * BS, H, D))
    assert torch.equal(out[0], chunk_of(kvs, slice(0, 2 * BS)))
    assert torch.equal(out[1], chunk_of(kvs, slice(2 * BS, 4 * BS)))
    # back into other blocks of empty caches, skipping the first block (as if vLLM already held it)
    fresh = [torch.zeros_like(t) for t in layers]
    kv = torch.cat([out[0], out[1]], dim=2)  # [L, 2, 4 * BS, H, D], as a fetch returns it
    target = torch.tensor([0, 3, 1, 5])
    for i in range(2):
        scatter_layer(kv[i], fresh[i], codec, target, first=1)
        assert fresh[i][0].eq(0).all()  # skipped
        for j in range(1, 4):
            assert torch.equal(fresh[i][target[j]], layers[i][blocks[j]])


def test_the_head_major_view_reads_any_physical_stride_order():
    # vLLM's GPU layouts: logical [blocks, H, block_size, 2*D] over memory ordered [blocks, block_size, H, 2*D]
    phys = torch.zeros(6, BS, H, 2 * D)
    layer = phys.permute(0, 2, 1, 3)
    k, v = token_kv(2 * BS, 0)
    blocks = torch.tensor([3, 0])
    for j, b in enumerate(blocks.tolist()):
        layer[b, :, :, :D] = k[j * BS:(j + 1) * BS].transpose(0, 1)
        layer[b, :, :, D:] = v[j * BS:(j + 1) * BS].transpose(0, 1)
    codec = HeadMajorCodec(BS, H, D)
    out = gather_chunks([layer], codec, blocks, torch.empty(1, 1, 2, 2 * BS, H, D))
    assert torch.equal(out[0], chunk_of([(k, v)], slice(0, 2 * BS)))
    other = torch.zeros(6, BS, H, 2 * D).permute(0, 2, 1, 3)
    scatter_layer(out[0, 0], other, codec, torch.tensor([1, 4]))
    assert torch.equal(other[1], layer[3]) and torch.equal(other[4], layer[0])


def test_a_kernel_that_does_not_store_a_permutation_is_refused():
    def drops_v(k, v, cache):
        vec_write(k, torch.zeros_like(v), cache, torch.arange(BS, 2 * BS))

    def rescales(k, v, cache):  # as a quantising (fp8) cache would
        vec_write(k * 0.5, v * 0.5, cache, torch.arange(BS, 2 * BS))

    def spills(k, v, cache):
        vec_write(k, v, cache, torch.arange(BS, 2 * BS))
        cache[0, 0, 0, 0] = 1.0

    for bad, why in ((drops_v, "unwritten"), (rescales, "unchanged|permutation"), (spills, "outside")):
        with pytest.raises(ValueError, match=why):
            learn_codec(bad, (H, BS, 2 * D), BS, H, D, torch.float32)


def test_learning_handles_coordinates_beyond_one_digit():
    bs, h, d = 160, 1, 130  # token and dim indices past 127 go through two base-128 digits

    def write(key, value, cache):
        flat = cache.view(2, h, 2 * bs * d)
        flat[1, :, :bs * d] = key.permute(1, 2, 0).reshape(h, -1)  # K transposed, as the CPU kernel does
        flat[1, :, bs * d:] = value.transpose(0, 1).reshape(h, -1)

    codec = learn_codec(write, (h, bs, 2 * d), bs, h, d, torch.bfloat16)
    block = torch.randn(1, h, bs, 2 * d)
    assert torch.equal(codec.blocks(codec.pieces(block)), block)
    k = codec.pieces(block)[0, 0]  # [bs, h, d]
    assert torch.equal(k, block.view(h, 2 * bs * d)[:, :bs * d].view(h, d, bs).permute(2, 0, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scatter_chunks_writes_what_scatter_layer_writes_from_chunk_major_kv(dtype):
    from kvmesh.paged import SplitKVCodec, scatter_chunks

    c = 2 * BS  # 2 blocks per chunk; 3 chunks, one layer of a device load's staging [N, L, 2, C, H, D]
    staging = torch.randn(3, 2, 2, c, H, 4, dtype=torch.float32).to(dtype)  # head_dim 4: int64 words in bf16
    caches = {  # FlashAttention's [2, blocks, bs, H, D] through a transposed view, FlashInfer's, vLLM's logical
        SplitKVCodec(BS, H, 4): (lambda: torch.zeros(2, 9, BS, H, 4, dtype=dtype).transpose(0, 1),
                                 lambda: torch.zeros(9, 2, BS, H, 4, dtype=dtype)),
        HeadMajorCodec(BS, H, 4): (lambda: torch.zeros(9, H, BS, 8, dtype=dtype),),
    }
    for codec, makes in caches.items():
        for make in makes:
            for first, n in [(0, 6), (1, 6), (3, 5), (2, 3), (1, 2), (5, 6)]:  # whole, skipped and partial chunks
                ids = torch.randperm(9)[:n]
                a, b = make(), make()
                scatter_chunks(staging[:, 1], a, codec, ids, first)
                scatter_layer(staging[:, 1].transpose(0, 1).reshape(2, 3 * c, H, 4)[:, :n * BS], b, codec, ids, first)
                assert torch.equal(a, b), (codec, first, n)
                assert n == first or bool(a.ne(0).any())
