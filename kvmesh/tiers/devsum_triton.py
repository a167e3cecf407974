"""The device checksum's terms summed by one fused Triton kernel: each word is read once, its constant c_i computed
in registers, the wrapped product summed in int64 without ever being written (the torch ops of `devsum` read the
word and a constant tensor, write the products and read them back: four times the traffic, and a constant tensor
the size of the chunk per device). Imported only where Triton is (a CUDA build of torch brings it);
`devsum.Coefficients` picks this path after checking it against the torch ops on the device.

    row_sums(words, start) -> int64 tensor [rows]   pure; queued on the current stream: for each row of int32
                                                    `words` [rows, n] (unit stride along a row), the sum of
                                                    int32(w_j * c_(start+j)) over its n words
    buffer_sums(bufs) -> int64 tensor [len(bufs)]   pure; the same for separate contiguous int32 buffers of one
                                                    length (start 0), found through a device array of their
                                                    addresses: one launch for a hit's chunks wherever they landed
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 8192  # words per program: 32 KiB read per program, one int64 partial written


@triton.jit
def _row_sums_kernel(w_ptr, part_ptr, row_stride, n, start, parts, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    w = tl.load(w_ptr + row * row_stride + offs, mask=mask, other=0)
    # c_i = ((i * 0x9E3779B1 + 0x632BE5AB) mod 2^31) | 1 in 32-bit arithmetic that wraps (a 64-bit product costs
    # several instructions a word, and made the kernel compute-bound): mod 2^31 depends only on i mod 2^32
    i = (offs + start).to(tl.int32)
    c = ((i * -1640531535 + 1663821227) & 2147483647) | 1
    p = w * c  # wraps to int32, as the definition says
    tl.store(part_ptr + row * parts + pid, tl.sum(p.to(tl.int64), axis=0))


def row_sums(words: torch.Tensor, start: int = 0) -> torch.Tensor:
    assert words.dtype == torch.int32 and words.dim() == 2 and words.is_cuda
    rows, n = words.shape
    if rows == 0:
        return torch.zeros(0, dtype=torch.int64, device=words.device)
    assert words.stride(1) == 1 or n <= 1, "words must have unit stride along a row"
    parts = max(1, triton.cdiv(n, BLOCK))
    part = torch.empty((rows, parts), dtype=torch.int64, device=words.device)
    with torch.cuda.device(words.device):  # (Triton launches on the current device's current stream)
        _row_sums_kernel[(parts, rows)](words, part, words.stride(0), n, start, parts, BLOCK=BLOCK, num_warps=8)
    return part.sum(dim=1) if parts > 1 else part[:, 0]


@triton.jit
def _buffer_sums_kernel(addr_ptr, part_ptr, n, parts, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = tl.program_id(1)
    base = tl.load(addr_ptr + row).to(tl.pointer_type(tl.int32))
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    w = tl.load(base + offs, mask=mask, other=0)
    i = offs.to(tl.int32)
    c = ((i * -1640531535 + 1663821227) & 2147483647) | 1
    p = w * c
    tl.store(part_ptr + row * parts + pid, tl.sum(p.to(tl.int64), axis=0))


def buffer_sums(bufs: list[torch.Tensor]) -> torch.Tensor:
    """S's terms summed over each of `bufs` (contiguous int32 on one CUDA device, of one length) in one launch. The
    buffers must stay alive until the kernel has run (the caller's: it reads them later on the current stream)."""
    n, device = bufs[0].numel(), bufs[0].device
    assert all(b.dtype == torch.int32 and b.is_contiguous() and b.numel() == n and b.device == device for b in bufs)
    addrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64).to(device)
    parts = max(1, triton.cdiv(n, BLOCK))
    part = torch.empty((len(bufs), parts), dtype=torch.int64, device=device)
    with torch.cuda.device(device):
        _buffer_sums_kernel[(parts, len(bufs))](addrs, part, n, parts, BLOCK=BLOCK, num_warps=8)
    return part.sum(dim=1) if parts > 1 else part[:, 0]
