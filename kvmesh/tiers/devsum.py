"""Device checksum: a position-weighted sum over a chunk's bytes, computed with torch ops where the bytes are (on
the GPU for GPU-tier chunks; the same function runs on CPU tensors, bit for bit).

    device_checksum(buf) -> 0-d int64 tensor       pure; asynchronous on CUDA (queued on the current stream)
    device_checksums(bufs) -> int64 tensor [n]     pure; one result per buffer
    host_device_checksum(buf) -> int               pure; S of host bytes, block by block (a KVNode records it for
                                                   its CPU-slab chunks, so device sinks verify them on the GPU)
    reference_checksum(data) -> int                pure Python/numpy, the definition (tests compare against it)
    Coefficients                                   a per-(device, words) cache of the constants (owned by a tier or
                                                   a mapper), and `row_sums`, the one place S's terms are summed:
                                                   by one fused Triton kernel on a GPU where it gives the torch ops'
                                                   sums (`devsum_triton`), else by the torch ops
    Verify(expected, sums, event).result() -> bool  a `LayerwiseLoad.checks` entry: waits for the sums, compares
    verify_rows_by_layer(flat, rows, expected, events)  S of rows of a device staging tensor, summed layer group
                                                   by layer group as each group's copy lands (a side stream)

Definition (written down once). View the bytes as little-endian int32 words w_0..w_{n-1} (a tail of 1-3 bytes is
zero-padded into one more word). With the odd constants c_i = ((i * 0x9E3779B1 + 0x632BE5AB) mod 2^31) | 1:

    S = sum_i  int32(w_i * c_i mod 2^32)        the products wrap to signed 32 bits; the sum is exact in int64

The sum cannot overflow: each term is in [-2^31, 2^31) and a chunk holds far fewer than 2^32 words (|S| < 2^63).

Why any single changed byte is detected (and, more generally, any change confined to one 4-byte word): let word
i change from w to w' != w (mod 2^32). c_i is odd, so it is invertible mod 2^32 and w*c_i != w'*c_i (mod 2^32):
the wrapped products p, p' differ as int32 values. Every other term is unchanged and S is exact, so S changes by
p' - p, a non-zero integer. Hence S' != S. (Changes spread over several words are caught with probability about
1 - 2^-32, like any 32-bit check; a corrupt GPU-tier chunk is one bad DMA or one flipped cell, i.e. one word.)

Cost. With torch ops: one read of the chunk and of the constants, one int32 product written and read back, one
int64 reduction: about 4 bytes of memory traffic per chunk byte, ~11 ms for 4 GiB on an H200, on a side stream.
Fused (`devsum_triton`, where Triton is): the chunk is read once, the constants are computed in registers: 1 byte of
traffic per chunk byte. The fused kernel is used on a device only after it gave the torch ops' sums there on words
that wrap every way (`fused_ok`, once per process and device); `KVMESH_DEVICE_CHECKSUM=torch` turns it off.

Which checksum is checked where (a GPU-tier chunk may carry both):
- xxh3-64 (`kvmesh.tiers.checksum`): over host bytes. Computed by the writer of host bytes, verified whenever a
  chunk's host bytes cross a process, node or disk boundary (slab reads, peer pulls, disk reads).
- device checksum (this module): over device bytes. Computed by the GPU tier when a chunk is placed in it (from
  the host: after the H2D copy, so it covers the bytes as they sit in the pool; from an engine's GPU: by the
  writer, over the bytes it wrote into the pool), and verified by a reader of a GPU-tier chunk over the bytes it
  received in its own device buffer (D2D or peer-to-peer, no host copy). A CPU-slab chunk gets one too, computed
  by its KVNode's device-checksum thread (`host_device_checksum`) over the slot's bytes, and recorded only if the
  same bytes still match the chunk's xxh3 (so it vouches for nothing xxh3 would not); a same-node reader that
  DMAs the chunk into a device buffer verifies that instead of xxh3 on its CPU threads. A slab chunk whose
  device checksum is not known yet is checked with xxh3 as before. A chunk leaving the GPU tier for the host
  (demotion, a host reader) keeps the xxh3 it entered with; one that entered from a GPU has its device checksum
  verified on the GPU first and its xxh3 computed over the host copy (`GpuTier.host_checksum`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

import numpy as np
import torch

from kvmesh.cudart import side_stream

_MUL, _ADD = 0x9E3779B1, 0x632BE5AB
log = logging.getLogger("kvmesh.devsum")
_fused_lock = threading.Lock()
_fused_by_device: dict[torch.device, bool] = {}  # whether the fused kernel gave the torch ops' sums on a device


def fused_ok(device: torch.device) -> bool:
    """Whether S's terms are summed by the fused Triton kernel on `device` (a CUDA device): Triton imports, the
    kernel compiles, and its sums equal the torch ops' on rows of words that wrap every way, at a start offset
    (checked once per process and device, here: the first call compiles the kernel, ~1 s, later processes read
    Triton's cache). Never raises; False leaves the torch ops, which compute the same S."""
    if device.type != "cuda" or os.environ.get("KVMESH_DEVICE_CHECKSUM", "fused") == "torch":
        return False
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    with _fused_lock:
        ok = _fused_by_device.get(device)
        if ok is None:
            ok = _fused_by_device[device] = _check_fused(device)
        return ok


def _disable_fused(device: torch.device, error: Exception) -> None:
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    with _fused_lock:
        _fused_by_device[device] = False
    log.warning("kvmesh: the fused device checksum failed on %s (%s); using torch ops", device, error)


def _check_fused(device: torch.device) -> bool:
    try:
        from kvmesh.tiers import devsum_triton

        g = torch.Generator(device="cpu").manual_seed(0x5EED)
        words = torch.randint(-(2**31), 2**31, (3, 3 * devsum_triton.BLOCK + 5), dtype=torch.int64, generator=g)
        words[0, :4] = torch.tensor([0, -1, -(2**31), 2**31 - 1])
        words = words.to(torch.int32).to(device)
        for start, a, b in ((0, 0, words.shape[1]), (7, 1, 1 + devsum_triton.BLOCK), (0, 0, 1), (5, 0, 0)):
            part = words[:, a:b]
            c = _constants(start + part.shape[1], device)[start:]
            want = torch.mul(part, c).sum(dim=1, dtype=torch.int64)
            if not torch.equal(devsum_triton.row_sums(part, start), want):
                log.warning("kvmesh: the fused device checksum differs from the torch ops on %s; using those", device)
                return False
        # separate buffers, by their addresses (one of them 4 bytes off a 16-byte boundary)
        n = words.shape[1] - 2
        bufs = [words[0, :n].clone(), words[1, 1 : 1 + n], words[2, 2 : 2 + n]]
        want = torch.stack([torch.mul(b, _constants(b.numel(), device)).sum(dtype=torch.int64) for b in bufs])
        if not torch.equal(devsum_triton.buffer_sums(bufs), want):
            log.warning("kvmesh: the fused device checksum differs from the torch ops on %s; using those", device)
            return False
        return True
    except Exception as e:  # no Triton, no compiler, a kernel that fails: the torch ops compute the same S
        log.info("kvmesh: fused device checksum unavailable on %s (%s); using torch ops", device, e)
        return False


def _constants(n: int, device) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.int64, device=device)
    return (((i * _MUL + _ADD) & 0x7FFFFFFF) | 1).to(torch.int32)


class Coefficients:
    """The constants c_i for buffers of up to `n` words, per device (grown on demand, shared by every buffer)."""

    def __init__(self) -> None:
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def get(self, n: int, device: torch.device) -> torch.Tensor:
        c = self._by_device.get(device)
        if c is None or c.numel() < n:
            c = self._by_device[device] = _constants(max(n, 2 * c.numel() if c is not None else 0), device)
        return c[:n]

    def row_sums(self, words: torch.Tensor, start: int = 0) -> torch.Tensor:
        """For each row of int32 `words` [rows, n], the sum of S's terms int32(w_j * c_(start+j)) over its words,
        as int64 [rows] on their device (queued on the current stream on CUDA). Rows of one chunk's words summed
        at their start offsets add up to the chunk's S."""
        if words.is_cuda and (words.stride(1) == 1 or words.shape[1] <= 1) and fused_ok(words.device):
            from kvmesh.tiers import devsum_triton

            try:
                return devsum_triton.row_sums(words, start)
            except Exception as e:  # (a kernel that checked out but fails on other shapes: the torch ops from now)
                _disable_fused(words.device, e)
        c = self.get(start + words.shape[1], words.device)[start:]
        return torch.mul(words, c).sum(dim=1, dtype=torch.int64)


def _words(buf: torch.Tensor) -> torch.Tensor:
    """The bytes of `buf` as int32 words (a view where the size and alignment allow, else a padded copy)."""
    b = buf.reshape(-1).view(torch.uint8) if buf.dtype != torch.uint8 else buf.reshape(-1)
    n = b.numel()
    if n % 4 == 0 and b.storage_offset() % 4 == 0:
        try:
            return b.view(torch.int32)
        except RuntimeError:  # a storage whose base is not 4-byte aligned
            pass
    padded = torch.zeros(-(-n // 4) * 4, dtype=torch.uint8, device=b.device)
    padded[:n] = b
    return padded.view(torch.int32)


def device_checksum(buf: torch.Tensor, coefficients: Coefficients | None = None) -> torch.Tensor:
    """S (see the module docstring) of `buf`'s bytes, as a 0-d int64 tensor on `buf`'s device. On CUDA the work
    is queued on the current stream; read the value with `int()` (which waits) or compare it on the device."""
    w = _words(buf)
    return (coefficients or Coefficients()).row_sums(w.view(1, -1))[0]


def device_checksums(bufs: Sequence[torch.Tensor], coefficients: Coefficients | None = None) -> torch.Tensor:
    """S of each buffer, as an int64 tensor [len(bufs)] on the buffers' device (all on one device)."""
    coefficients = coefficients or Coefficients()
    if not bufs:
        return torch.zeros(0, dtype=torch.int64)
    words = [_words(b) for b in bufs]
    rows = _as_rows(words)
    if rows is not None:  # evenly spaced buffers of one size in one storage (slots of a pool, rows of a staging)
        return coefficients.row_sums(rows)
    if len(words) > 1 and words[0].is_cuda and fused_ok(words[0].device):
        try:  # buffers anywhere: one launch per length, through a device array of their addresses
            return _buffer_sums(words)
        except Exception as e:  # (a kernel that checked out but fails here: the torch ops from now)
            _disable_fused(words[0].device, e)
    return torch.stack([coefficients.row_sums(w.view(1, -1))[0] for w in words])


def _buffer_sums(words: list[torch.Tensor]) -> torch.Tensor:
    from kvmesh.tiers import devsum_triton

    by_len: dict[int, list[int]] = {}
    for k, w in enumerate(words):
        by_len.setdefault(w.numel(), []).append(k)
    out = torch.empty(len(words), dtype=torch.int64, device=words[0].device)
    for idx in by_len.values():
        sums = devsum_triton.buffer_sums([words[k] for k in idx])
        out[torch.tensor(idx, device=out.device)] = sums
    return out


def _as_rows(words: list[torch.Tensor]) -> torch.Tensor | None:
    """`words` as the rows of one strided [n, words] view when they are evenly spaced in one storage and of one
    size (one kernel for them all instead of one each), else None."""
    w0 = words[0]
    n = w0.numel()
    if len(words) < 2 or not w0.is_cuda:
        return None
    step = words[1].data_ptr() - w0.data_ptr()
    if step <= 0 or step % 4:
        return None
    base = w0.untyped_storage().data_ptr()
    for k, w in enumerate(words):
        if w.numel() != n or w.untyped_storage().data_ptr() != base or w.data_ptr() != w0.data_ptr() + k * step:
            return None
    return w0.as_strided((len(words), n), (step // 4, 1))


def host_device_checksum(
    buf: torch.Tensor, coefficients: Coefficients | None = None, block_words: int = 1 << 16
) -> int:
    """S of the bytes of CPU tensor `buf`, bit for bit what `device_checksum` returns, computed a block of words at
    a time into one reused product buffer that stays in cache (several times faster on the CPU than one product
    the size of the chunk, and no chunk-sized temporary)."""
    assert not buf.is_cuda, "host_device_checksum is the CPU path"
    w = _words(buf)
    n = w.numel()
    c = (coefficients or Coefficients()).get(n, w.device)
    tmp = torch.empty(min(n, block_words), dtype=torch.int32)
    total = 0
    for a in range(0, n, block_words):
        b = min(n, a + block_words)
        p = tmp[: b - a]
        torch.mul(w[a:b], c[a:b], out=p)
        total += int(p.sum(dtype=torch.int64))
    return total


def reference_checksum(data) -> int:
    """The definition, in numpy (bytes-like in): what `device_checksum` must return."""
    b = np.frombuffer(bytes(data), dtype=np.uint8)
    pad = (-len(b)) % 4
    if pad:
        b = np.concatenate([b, np.zeros(pad, dtype=np.uint8)])
    w = b.view("<u4").astype(np.uint64)
    i = np.arange(len(w), dtype=np.uint64)
    c = ((i * np.uint64(_MUL) + np.uint64(_ADD)) & np.uint64(0x7FFFFFFF)) | np.uint64(1)
    p = (w * c) & np.uint64(0xFFFFFFFF)  # w < 2^32 and c < 2^31: the product fits in 64 bits
    signed = p.astype(np.int64) - (p >= 2**31).astype(np.int64) * 2**32
    return int(signed.sum())


class Verify:
    """One entry of `LayerwiseLoad.checks`: `result()` waits for `sums` (queued after `event` on a side stream)
    and says whether every one equals `expected` (the checksums the tier recorded)."""

    def __init__(
        self, sums: torch.Tensor, expected: Sequence[int], event=None, positions: Sequence[int] | None = None
    ) -> None:
        self.sums, self.expected, self.event = sums, [int(x) for x in expected], event
        self.positions = None if positions is None else list(positions)  # sums[positions[j]] is expected[j]'s
        self._ok: list[bool] | None = None

    def per_chunk(self) -> list[bool]:
        if self._ok is None:
            if self.event is not None:
                self.event.synchronize()
            got = self.sums.cpu().tolist()
            if self.positions is not None:
                got = [got[p] for p in self.positions]
            self._ok = [g == e for g, e in zip(got, self.expected)]
        return self._ok

    def result(self) -> bool:
        return all(self.per_chunk())

    def good_prefix(self) -> int:
        """How many leading chunks matched (a fetch truncates at the first failed chunk)."""
        ok = self.per_chunk()
        return next((i for i, g in enumerate(ok) if not g), len(ok))


def verify_on_side_stream(
    dsts: Sequence[torch.Tensor], expected: Sequence[int], after=None, coefficients: Coefficients | None = None
) -> Verify:
    """Checksum `dsts` off the critical path: on CUDA, on a new side stream that first waits for `after` (a CUDA
    event, e.g. the end of the copies into `dsts`); on the CPU, at once. Returns the pending `Verify`."""
    if not dsts or not dsts[0].is_cuda:
        return Verify(device_checksums(dsts, coefficients), expected)
    device = dsts[0].device
    stream = side_stream(device)
    if after is not None:
        stream.wait_event(after)
    else:
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        sums = device_checksums(dsts, coefficients)
        done = torch.cuda.Event()
        done.record(stream)
    for d in dsts:
        d.record_stream(stream)  # the caching allocator must not reuse a destination before the sums read it
    return Verify(sums, expected, done)


def verify_rows_by_layer(
    flat: torch.Tensor,
    rows: Sequence[int],
    expected: Sequence[int],
    events: Sequence,
    coefficients: Coefficients | None = None,
) -> Verify:
    """Checksum rows `rows` of `flat` (a [n, chunk bytes] uint8 view of a `LayerwiseLoad`'s staging) against
    `expected`, off the critical path and overlapping the copies: on CUDA a side stream sums each layer group's
    bytes (the layers that share an event in `events`, one per layer) as soon as that group's copy has landed,
    one batched product and reduction per group over every row, and adds the partial sums (S is a sum over
    words, so the partial sums add up to it exactly); what is left once the last copy ends is the last group's
    sum. Elsewhere (the CPU, groups not 4-byte aligned, no events) `verify_on_side_stream` over whole rows."""
    rows = list(rows)
    layers = len(events)
    if (
        not rows
        or not flat.is_cuda
        or layers == 0
        or any(e is None for e in events)
        or flat.shape[1] % (4 * layers) != 0
    ):
        last = next((e for e in reversed(events) if e is not None), None)
        return verify_on_side_stream([flat[i] for i in rows], expected, last, coefficients)
    coefficients = coefficients or Coefficients()
    device = flat.device
    lo, hi = min(rows), max(rows) + 1
    span = flat[lo:hi]
    layer_words = flat.shape[1] // 4 // layers
    groups: list[tuple[int, int, torch.cuda.Event]] = []  # (first layer, end layer, event) of each group
    for layer, ev in enumerate(events):
        if groups and groups[-1][2] is ev:
            groups[-1] = (groups[-1][0], layer + 1, ev)
        else:
            groups.append((layer, layer + 1, ev))
    stream = side_stream(device)  # (each group's event is after everything the copies waited for)
    with torch.cuda.stream(stream):
        acc = torch.zeros(hi - lo, dtype=torch.int64, device=device)
        for first, end, ev in groups:
            stream.wait_event(ev)
            a, b = first * layer_words, end * layer_words
            acc += coefficients.row_sums(span[:, 4 * a : 4 * b].view(torch.int32), a)
        done = torch.cuda.Event()
        done.record(stream)
    flat.record_stream(stream)  # the caching allocator must not reuse the staging before the sums read it
    # (rows are picked out of the span's sums on the host: an index tensor copied to the device here would wait
    # for the copies)
    return Verify(acc, expected, done, [r - lo for r in rows])
