"""Block layouts of paged engines, and moves between their blocks and kvmesh chunks.

A paged engine keeps, per layer, `num_blocks` blocks of `block_size` tokens each. What one block looks like inside
depends on the engine and the platform. A codec converts a batch of blocks to and from *pieces*:

    piece    [2 (K, V), block_size, num_kv_heads, head_dim]    one block's KV in kvmesh's chunk order

and a chunk of C tokens is C / block_size consecutive pieces: chunk[layer, :, j*bs:(j+1)*bs] = piece j of that
layer. Codecs (both pure: they read their input and return a new tensor):

    HeadMajorCodec   vLLM's logical per-layer view [num_blocks, H, block_size, 2*D]: kv[b, h, t, :D] is token
                     t's K, kv[b, h, t, D:] its V. vLLM's GPU backends all present this view, whatever their
                     physical stride order, so the codec reads it through the tensor's strides.
    SplitKVCodec     per-layer blocks [n, 2, block_size, H, D] (any strides): the 5-D layouts of vLLM's GPU backends
                     before its KVCacheLayout descriptor (FlashAttention [2, num_blocks, bs, H, D], seen through
                     a transposed view; FlashInfer [num_blocks, 2, bs, H, D]) and LMCache's formats of them.
    LearnedCodec     any fixed permutation of a contiguous block's elements, learned once by writing known K/V
                     through the engine's own cache-write kernel (`learn_codec`). vLLM's CPU backend needs it: its
                     ISA-specific kernels pack each block themselves (the AVX-512 "vec" kernel stores each head's K
                     transposed, [head_dim, block_size], then its V, [block_size, head_dim]; AMX and NEON differ),
                     so the logical view above is not a token's K|V there.

Moves (one indexed read or write per layer for a whole batch of blocks, never one copy per block):

    gather_chunks(layers, codec, block_ids, out) -> out [N, L, 2, C, H, D]      blocks -> chunks
    scatter_layer(kv_layer, layer, codec, block_ids, first)                     one layer of chunks -> blocks
    scatter_chunks(chunks, layer, codec, block_ids, first)                      the same from chunk-major KV
                     [k, 2, C, H, D] (one layer of a device load's staging); with SplitKVCodec one pass, no copy
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def raw(t: torch.Tensor) -> torch.Tensor:
    """`t` as unsigned bytes of the same shape when its dtype is a one-byte float (fp8 KV caches): CUDA has no
    indexed copy (`index_copy_`, `index_put_`) for float8 types, and moving KV never needs its values, only its
    bytes. Other tensors as they are."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


@dataclass(frozen=True)
class HeadMajorCodec:
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_kv_heads, self.block_size, 2 * self.head_dim)

    def pieces(self, blocks: torch.Tensor) -> torch.Tensor:
        """[n, H, bs, 2D] (any strides) -> [n, 2, bs, H, D] (a view where the strides allow)."""
        n = blocks.shape[0]
        return blocks.view(n, self.num_kv_heads, self.block_size, 2, self.head_dim).permute(0, 3, 2, 1, 4)

    def blocks(self, pieces: torch.Tensor) -> torch.Tensor:
        """[n, 2, bs, H, D] -> [n, H, bs, 2D], contiguous."""
        n = pieces.shape[0]
        return pieces.permute(0, 3, 2, 1, 4).reshape(n, *self.block_shape)


@dataclass(frozen=True)
class SplitKVCodec:
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    def pieces(self, blocks: torch.Tensor) -> torch.Tensor:
        return blocks  # [n, 2, bs, H, D] already

    def blocks(self, pieces: torch.Tensor) -> torch.Tensor:
        return pieces.contiguous()


@dataclass(frozen=True)
class LearnedCodec:
    block_size: int
    num_kv_heads: int
    head_dim: int
    block_shape: tuple[int, ...]  # the layer tensor's shape per block (its elements are contiguous)
    to_piece: torch.Tensor  # long [E]: piece-flat index -> the block-flat element that holds it
    to_block: torch.Tensor  # long [E]: block-flat index -> the piece-flat element stored there

    def pieces(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        flat = blocks.reshape(n, -1)
        return (
            raw(flat)
            .index_select(1, self.to_piece.to(flat.device))
            .view(flat.dtype)
            .view(n, 2, self.block_size, self.num_kv_heads, self.head_dim)
        )

    def blocks(self, pieces: torch.Tensor) -> torch.Tensor:
        n = pieces.shape[0]
        flat = pieces.reshape(n, -1)
        return raw(flat).index_select(1, self.to_block.to(flat.device)).view(flat.dtype).view(n, *self.block_shape)


# Coordinates go through the kernel in base-128 digits (each digit + 1, so 0 means "never written"): every value
# is a small integer, exact in fp32, fp16 and bf16 whatever the kernel converts through.
_DIGIT = 128


def _num_digits(largest: int, base: int = _DIGIT) -> int:
    k = 1
    while base**k <= largest:
        k += 1
    return k


def learn_codec(
    write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
    block_shape: Sequence[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    digit_base: int = _DIGIT,
) -> LearnedCodec:
    """Learn how a cache-write kernel packs one block. `write(key, value, cache)` must store `key`/`value`
    ([block_size, H, D] each) as the tokens of block 1 of `cache` ([2, *block_shape], zeroed). Raises ValueError
    if what the kernel wrote is not a permutation of those elements confined to block 1 (the kernel converts or
    spreads values): kvmesh cannot move such blocks. `digit_base`: coordinates go through the kernel as digits
    1..digit_base, which must be exact in every format the kernel converts through (8 for an fp8 cache, whose
    `write` then hands back the decoded values in `dtype`)."""
    if not 2 <= digit_base <= _DIGIT:
        raise ValueError(f"digit_base must be in [2, {_DIGIT}], got {digit_base}")
    bs, H, D = block_size, num_kv_heads, head_dim
    t = torch.arange(bs).view(bs, 1, 1).expand(bs, H, D)
    h = torch.arange(H).view(1, H, 1).expand(bs, H, D)
    d = torch.arange(D).view(1, 1, D).expand(bs, H, D)
    coords = {"t": t, "h": h, "d": d}
    digits = {name: _num_digits(int(x.max()), digit_base) for name, x in coords.items()}
    reads: dict[tuple[str, int], torch.Tensor] = {}
    for name, x in coords.items():
        for k in range(digits[name]):
            val = ((x // digit_base**k) % digit_base + 1).to(torch.float32)
            cache = torch.zeros((2, *block_shape), dtype=dtype)
            write(val.to(dtype).contiguous(), (-val).to(dtype).contiguous(), cache)
            if bool(cache[0].ne(0).any()):
                raise ValueError("the cache-write kernel wrote outside the block it was given")
            reads[(name, k)] = cache[1].reshape(-1).to(torch.float32)
    first = reads[("t", 0)]
    if bool(first.eq(0).any()):
        raise ValueError("the cache-write kernel left part of a block unwritten (padding or another packing)")
    is_v = first < 0
    decoded = {}
    for name in coords:
        value = torch.zeros_like(first, dtype=torch.long)
        for k in range(digits[name]):
            r = reads[(name, k)]
            if bool(((r < 0) != is_v).any()) or bool(r.abs().ne(r.abs().round()).any()):
                raise ValueError("the cache-write kernel does not store K and V values unchanged")
            value += (r.abs().long() - 1) * digit_base**k
        decoded[name] = value
    e = 2 * bs * H * D
    # position in the piece [2, bs, H, D] of each block element
    c = ((is_v.long() * bs + decoded["t"]) * H + decoded["h"]) * D + decoded["d"]
    if c.numel() != e or bool(c.lt(0).any()) or bool(c.ge(e).any()) or bool(torch.bincount(c, minlength=e).ne(1).any()):
        raise ValueError("the cache-write kernel's block is not a permutation of its tokens' K and V")
    return LearnedCodec(bs, H, D, tuple(block_shape), to_piece=torch.argsort(c), to_block=c)


def gather_chunks(layers: Sequence[torch.Tensor], codec, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Chunks `out` [N, L, 2, C, H, D] from the blocks `block_ids` [N * C / bs] (chunk-major) of each layer."""
    n, _, _, c, h, d = out.shape
    bs = codec.block_size
    m = c // bs
    idx = block_ids.to(layers[0].device, torch.long)
    for i, layer in enumerate(layers):
        p = codec.pieces(raw(layer).index_select(0, idx).view(layer.dtype))  # [N*m, 2, bs, H, D]
        out[:, i].view(n, 2, m, bs, h, d).copy_(p.reshape(n, m, 2, bs, h, d).transpose(1, 2))
    return out


def scatter_layer(kv_layer: torch.Tensor, layer: torch.Tensor, codec, block_ids: torch.Tensor, first: int = 0) -> None:
    """Write one layer of chunk-layout KV, `kv_layer` [2, n*bs, H, D] (token-major, e.g. `fetch(...)[layer]`),
    into the blocks `block_ids` [n] of `layer`, skipping the first `first` of them (already computed there)."""
    bs = codec.block_size
    two, tokens, h, d = kv_layer.shape
    n = tokens // bs
    if first >= n:
        return
    pieces = kv_layer.view(2, n, bs, h, d).transpose(0, 1)[first:]  # [n - first, 2, bs, H, D]
    raw(layer).index_copy_(
        0, block_ids[first:].to(layer.device, torch.long), raw(codec.blocks(pieces).to(layer.device))
    )


def _words(*ts: torch.Tensor) -> list[torch.Tensor]:
    """The tensors as int64 words where all of them allow it (an indexed copy then moves 8 bytes per element)."""
    e = ts[0].element_size()
    ok = all(
        t.stride(-1) == 1
        and (t.shape[-1] * e) % 8 == 0
        and t.data_ptr() % 8 == 0
        and all(s * e % 8 == 0 for s in t.stride()[:-1])
        for t in ts
    )
    return [t.view(torch.int64) for t in ts] if ok else list(ts)


def scatter_chunks(chunks: torch.Tensor, layer: torch.Tensor, codec, block_ids: torch.Tensor, first: int = 0) -> None:
    """Write one layer of chunk-major KV, `chunks` [k, 2, C, H, D] (any strides, e.g. `load.staging[a:b, layer]`),
    into the blocks `block_ids` [n <= k * C / bs] (chunk-major) of `layer`, skipping the first `first` of them.
    SplitKVCodec's blocks are pieces: they are read through a strided view, one indexed write per run of whole
    chunks (and one per partial chunk at either end), no staging copy. Other codecs reorder first (one copy)."""
    k, _, c, h, d = chunks.shape
    bs = codec.block_size
    m, n = c // bs, block_ids.numel()
    if first >= n:
        return
    ids = block_ids.to(layer.device, torch.long)
    pieces = chunks.view(k, 2, m, bs, h, d).transpose(1, 2)  # [k, m, 2, bs, H, D]: piece j of chunk i
    if not isinstance(codec, SplitKVCodec):
        flat = pieces.reshape(k * m, 2, bs, h, d)[first:n]
        raw(layer).index_copy_(0, ids[first:n], raw(codec.blocks(flat).to(layer.device)))
        return
    dst, src = _words(raw(layer), raw(pieces.to(layer.device)))
    a, b = -(-first // m), n // m  # the whole chunks [a, b)
    if a > b:  # first and n fall in one chunk
        parts = [(first // m, first, n)]
    else:
        parts = [(first // m, first, a * m), (b, b * m, n)]
        if a < b:
            dst.index_put_((ids[a * m : b * m].view(b - a, m),), src[a:b])
    for i, lo, hi in parts:  # the partial chunks
        if lo < hi:
            dst.index_put_((ids[lo:hi],), src[i, lo - i * m : hi - i * m])
