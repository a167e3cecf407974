"""The paged half of kvmesh.movers, which only benchmarks (bench/gpu.py, bench/reuse.py) and their tests use: moves
between vLLM-style paged layers (per layer [2, num_blocks, block_size, H, D] plus a block table) and kvmesh chunks,
and from device chunks to host buffers. (The vLLM connector moves blocks through kvmesh.paged and
kvmesh.dataplane.)

    gather_paged(layers, block_table, out=None) -> [N, L, 2, C, H, D]       engine pages -> chunks
    scatter_paged(chunks, layers, block_table)                              chunks -> engine pages (in place)
    gather_contiguous(keys, values, start, num_chunks, chunk_tokens) -> [N, L, 2, C, H, D]
    to_host(chunks, host_dsts, stream=None) -> event                        device chunks -> host buffers, async
    store_paged(layers, block_table, host_dsts) -> event                    pages -> host chunks, pipelined
    load_paged(host_srcs, spec, layers, block_table) -> event               host chunks -> pages, pipelined
    load_and_store_paged(load, store) -> (event, event)                     both at once, batches interleaved

None allocates per page; each runs one indexed kernel per layer over every chunk of a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.cudart import side_stream
from kvmesh.movers import _as_bytes, to_device
from kvmesh.paged import raw
from kvmesh.spec import KVSpec


def _layer_shape(layers: Sequence[torch.Tensor]) -> tuple[int, int, int]:
    two, _nb, bs, h, d = layers[0].shape
    assert two == 2, "paged layers are [2, num_blocks, block_size, heads, head_dim]"
    return bs, h, d


def gather_paged(
    layers: Sequence[torch.Tensor], block_table: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Chunks [N, L, 2, C, H, D] from paged layers; block_table [N, C // block_size] lists each chunk's pages."""
    bs, h, d = _layer_shape(layers)
    n, pages = block_table.shape
    c = pages * bs
    flat = block_table.reshape(-1).to(layers[0].device, torch.long)
    if out is None:
        out = torch.empty((n, len(layers), 2, c, h, d), dtype=layers[0].dtype, device=layers[0].device)
    for i, kv in enumerate(layers):
        g = raw(kv).index_select(1, flat)  # [2, N*pages, bs, H, D]: one kernel for every page of the batch
        raw(out[:, i]).copy_(g.view(2, n, c, h, d).transpose(0, 1))
    return out


def scatter_paged(chunks: torch.Tensor, layers: Sequence[torch.Tensor], block_table: torch.Tensor) -> None:
    """Write chunks [N, L, 2, C, H, D] into the pages named by block_table [N, C // block_size]: one indexed
    write per layer and K/V, straight from the (strided) chunk memory."""
    bs, h, d = _layer_shape(layers)
    n, pages = block_table.shape
    idx = block_table.to(layers[0].device, torch.long)
    for i, kv in enumerate(layers):
        for j in (0, 1):
            raw(kv[j])[idx] = raw(chunks[:, i, j]).view(n, pages, bs, h, d)


def gather_contiguous(
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    start: int,
    num_chunks: int,
    chunk_tokens: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunks [N, L, 2, C, H, D] of tokens [start, start + N*C) from per-layer K/V [1, H, T, D]."""
    _, h, _, d = keys[0].shape
    n, c = num_chunks, chunk_tokens
    end = start + n * c
    if out is None:
        out = torch.empty((n, len(keys), 2, c, h, d), dtype=keys[0].dtype, device=keys[0].device)
    for i, (k, v) in enumerate(zip(keys, values)):
        out[:, i, 0].copy_(k[0, :, start:end].view(h, n, c, d).permute(1, 2, 0, 3))
        out[:, i, 1].copy_(v[0, :, start:end].view(h, n, c, d).permute(1, 2, 0, 3))
    return out


def to_host(chunks: torch.Tensor, host_dsts: Sequence, stream: torch.cuda.Stream | None = None):
    """Copy device chunks [N, ...] (contiguous) into N host buffers of chunk size, one DMA each, on `stream`
    (default: a new side stream that first waits for the work queued so far on the current stream). Returns the
    CUDA event that marks the end, or None on the CPU (done synchronously). Keep `chunks` alive until the event has
    passed."""
    n = chunks.shape[0]
    flat = chunks.view(n, -1).view(torch.uint8) if chunks.dtype != torch.uint8 else chunks.view(n, -1)
    if not chunks.is_cuda:
        for i in range(n):
            _as_bytes(host_dsts[i]).copy_(flat[i])
        return None
    if stream is None:
        stream = side_stream(chunks.device)
        stream.wait_stream(torch.cuda.current_stream(chunks.device))
    with torch.cuda.stream(stream):
        for i in range(n):
            _as_bytes(host_dsts[i]).copy_(flat[i], non_blocking=True)
        done = torch.cuda.Event(enable_timing=True)
        done.record(stream)
    return done


def store_paged(
    layers: Sequence[torch.Tensor],
    block_table: torch.Tensor,
    host_dsts: Sequence,
    batch_chunks: int = 8,
    stream: torch.cuda.Stream | None = None,
):
    """Engine pages -> host chunks without stalling the compute stream: on a side stream, gather `batch_chunks`
    chunks at a time into one of two device staging buffers and DMA each chunk out, so the gather of batch i+1
    overlaps the copies of batch i. Returns the final CUDA event (None on the CPU, where it runs inline)."""
    if not layers[0].is_cuda:
        n = block_table.shape[0]
        for a in range(0, n, batch_chunks):
            to_host(gather_paged(layers, block_table[a : a + batch_chunks]), host_dsts[a : a + batch_chunks])
        return None
    return _drain(_store_batches(layers, block_table, host_dsts, batch_chunks, stream))


def load_paged(
    host_srcs: Sequence,
    spec: KVSpec,
    layers: Sequence[torch.Tensor],
    block_table: torch.Tensor,
    batch_chunks: int = 8,
    stream: torch.cuda.Stream | None = None,
):
    """Host chunks -> engine pages, pipelined: one DMA per chunk into one of two device staging buffers, and
    the scatter of batch i (on its own stream) overlaps the copies of batch i+1. Completion is per batch, not
    per layer (see `to_device` for layer-wise). Returns the final CUDA event (None on the CPU)."""
    if not layers[0].is_cuda:
        n = block_table.shape[0]
        for a in range(0, n, batch_chunks):
            ld = to_device(host_srcs[a : a + batch_chunks], spec, layers[0].device)
            scatter_paged(ld.staging, layers, block_table[a : a + batch_chunks])
        return None
    return _drain(_load_batches(host_srcs, spec, layers, block_table, batch_chunks, stream))


def load_and_store_paged(load: tuple, store: tuple, batch_chunks: int = 8) -> tuple:
    """One engine step's loads and stores together: `load_paged(*load)` and `store_paged(*store)`, their batches
    enqueued alternately. Issued one after the other, the second pipeline would start only once the host had
    launched every batch of the first (a batch costs ~1-2 ms of kernel launches), leaving one DMA direction idle
    that long; interleaved, both directions run from the start. Returns (load event, store event)."""
    host_srcs, spec, dst_layers, load_table = load
    src_layers, store_table, host_dsts = store
    if not dst_layers[0].is_cuda:
        return (
            load_paged(host_srcs, spec, dst_layers, load_table, batch_chunks),
            store_paged(src_layers, store_table, host_dsts, batch_chunks),
        )
    steps = [
        _load_batches(host_srcs, spec, dst_layers, load_table, batch_chunks, None),
        _store_batches(src_layers, store_table, host_dsts, batch_chunks, None),
    ]
    last: list = [None, None]
    live = [0, 1]
    while live:
        for i in list(live):
            try:
                last[i] = next(steps[i])
            except StopIteration:
                live.remove(i)
    return last[0], last[1]


def _drain(batches):
    done = None
    for done in batches:  # noqa: B007 (the loop runs the generator; its last item is the result)
        pass
    return done


def _store_batches(layers, block_table, host_dsts, batch_chunks, stream):
    """store_paged on CUDA, one batch per step: yields each batch's completion event once it is enqueued.

    The staging buffer is layer-major, [L, 2, chunks x pages, block, H, D], so each layer's pages land in place
    with one `index_select` (a chunk-major buffer took a second, transposing copy per layer: twice the kernel
    launches before the first DMA, and twice the HBM traffic); each chunk then leaves in one strided DMA of 2L
    rows (`cudaMemcpy2DAsync`) into its host slot."""
    n = block_table.shape[0]
    device = layers[0].device
    stream = stream or side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    copy_stream = side_stream(device)
    bs, h, d = _layer_shape(layers)
    pages = block_table.shape[1]
    per_batch = min(batch_chunks, n)
    row = pages * bs * h * d  # elements of one chunk's K (or V) of one layer
    with torch.cuda.stream(stream):
        bufs = [torch.empty(per_batch * len(layers) * 2 * row, dtype=layers[0].dtype, device=device) for _ in "ab"]
    for buf in bufs:
        buf.record_stream(copy_stream)
    free = [None, None]  # event after which buffer i may be overwritten
    for j, a in enumerate(range(0, n, batch_chunks)):
        b = min(a + batch_chunks, n)
        staged = bufs[j % 2][: (b - a) * len(layers) * 2 * row].view(len(layers), 2, (b - a) * pages, bs, h, d)
        with torch.cuda.stream(stream):
            if free[j % 2] is not None:
                stream.wait_event(free[j % 2])
            flat = block_table[a:b].reshape(-1).to(device, torch.long)
            for i, kv in enumerate(layers):
                torch.index_select(raw(kv), 1, flat, out=raw(staged[i]))
            gathered = torch.cuda.Event()
            gathered.record(stream)
        copy_stream.wait_event(gathered)
        free[j % 2] = _rows_to_host(staged, b - a, host_dsts[a:b], copy_stream)
        yield free[j % 2]


def _rows_to_host(staged: torch.Tensor, m: int, host_dsts: Sequence, stream) -> torch.cuda.Event:
    """Chunk k of a layer-major batch [L, 2, m x pages, ...] to host_dsts[k] (chunk layout [L, 2, C, H, D]): 2L
    rows of one chunk's bytes each, one strided DMA per chunk (row by row where the runtime cannot be bound)."""
    from kvmesh.cudart import CudaError, memcpy_2d_async

    rows = staged.shape[0] * 2
    src = staged.view(torch.uint8).view(rows, m, -1)
    width = src.shape[2]
    with torch.cuda.stream(stream):
        for k in range(m):
            dst = _as_bytes(host_dsts[k])
            try:
                ok = memcpy_2d_async(dst.data_ptr(), width, src[0, k].data_ptr(), m * width, width, rows, stream)
            except CudaError:  # e.g. memory the runtime does not know
                ok = False
            if not ok:
                dst.view(rows, width).copy_(src[:, k], non_blocking=True)
        done = torch.cuda.Event(enable_timing=True)
        done.record(stream)
    return done


def _load_batches(host_srcs, spec, layers, block_table, batch_chunks, stream):
    """load_paged on CUDA, one batch per step: yields each batch's completion event once it is enqueued."""
    n = block_table.shape[0]
    device = layers[0].device
    copy_stream = stream or side_stream(device)
    scatter_stream = side_stream(device)
    for st in (copy_stream, scatter_stream):
        st.wait_stream(torch.cuda.current_stream(device))
    shape = (min(batch_chunks, n), *spec.chunk_shape)
    bufs = [torch.empty(shape, dtype=spec.torch_dtype, device=device) for _ in range(2)]
    for buf in bufs:
        buf.record_stream(copy_stream)
        buf.record_stream(scatter_stream)
    free: list = [None, None]
    for j, a in enumerate(range(0, n, batch_chunks)):
        b = min(a + batch_chunks, n)
        buf = bufs[j % 2][: b - a]
        flat = buf.view(b - a, -1).view(torch.uint8)
        with torch.cuda.stream(copy_stream):
            if free[j % 2] is not None:
                copy_stream.wait_event(free[j % 2])
            for i in range(a, b):
                flat[i - a].copy_(_as_bytes(host_srcs[i])[: spec.chunk_bytes], non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(copy_stream)
        with torch.cuda.stream(scatter_stream):
            scatter_stream.wait_event(arrived)
            scatter_paged(buf, layers, block_table[a:b])
            done = torch.cuda.Event(enable_timing=True)
            done.record(scatter_stream)
        free[j % 2] = done
        yield done
