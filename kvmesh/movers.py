"""Moves between an engine's KV layouts and kvmesh chunks, and between host tiers and the GPU.

Layouts
    chunk       [L, 2, C, H, D] contiguous, "page-first": what tiers hold and the wire carries
    paged       per layer [2, num_blocks, block_size, H, D] plus a block table: vLLM's layout on CUDA
    contiguous  per layer K and V [1, H, T, D]: transformers' DynamicCache

Primitives (none allocate per page; each runs one indexed kernel per layer over every chunk of a batch):

    gather_paged(layers, block_table, out=None) -> [N, L, 2, C, H, D]       engine pages -> chunks
    scatter_paged(chunks, layers, block_table)                              chunks -> engine pages (in place)
    gather_contiguous(keys, values, start, num_chunks, chunk_tokens) -> [N, L, 2, C, H, D]
    scatter_contiguous(chunks, keys, values, start)                         chunks -> K/V (in place)
    to_host(chunks, host_dsts, stream=None) -> event                        device chunks -> host buffers, async
    store_paged(layers, block_table, host_dsts) -> event                    pages -> host chunks, pipelined
    load_paged(host_srcs, spec, layers, block_table) -> event               host chunks -> pages, pipelined
    load_and_store_paged(load, store) -> (event, event)                     both at once, batches interleaved
    to_device(host_srcs, spec, device, ...) -> LayerwiseLoad                host chunks -> device, async, with
                                                                            completion per layer (one strided
                                                                            copy per layer over a run of chunks)

Host<->device copies move whole contiguous pieces: a chunk, or a group of its layers of at least
`min_copy_bytes` (a copy has a fixed cost of ~13 µs; 8 MiB pieces keep it under 10 %), all issued at once on a
side stream, so `store` never stalls the compute stream and a load can run under the attention of earlier layers.
Host buffers must be page-locked for the copies to be asynchronous (the CPU tier's slab is).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvmesh.cudart import side_stream
from kvmesh.paged import raw
from kvmesh.spec import KVSpec

MiB = 1 << 20


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


def scatter_contiguous(
    chunks: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    start: int,
    layers: range | None = None,
) -> None:
    """Write chunks [N, L', 2, C, H, D] into K/V [1, H, T, D] at token `start`; `layers` names which model
    layers the chunks' L' layers are (default: all)."""
    n, _, _, c, h, d = chunks.shape
    end = start + n * c
    for j, i in enumerate(layers if layers is not None else range(chunks.shape[1])):
        # one strided copy each, straight into the [H, n, C, D] view of the destination (a reshape of the
        # permuted source would first materialise it: twice the memory traffic, on the prefill's critical path)
        _into(keys[i][0, :, start:end], h, n, c, d).copy_(chunks[:, j, 0].permute(2, 0, 1, 3))
        _into(values[i][0, :, start:end], h, n, c, d).copy_(chunks[:, j, 1].permute(2, 0, 1, 3))


def _into(dst: torch.Tensor, h: int, n: int, c: int, d: int) -> torch.Tensor:
    try:
        return dst.view(h, n, c, d)
    except RuntimeError:  # a destination whose token dim cannot be split: copy through its own layout
        return dst.unflatten(1, (n, c))


def _as_bytes(buf) -> torch.Tensor:
    if isinstance(buf, torch.Tensor):
        return buf.view(torch.uint8).reshape(-1)
    return torch.frombuffer(buf, dtype=torch.uint8)


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


@dataclass
class LayerwiseLoad:
    """Chunks on their way to the device. `staging` is [N, L, 2, C, H, D]; layer l of every chunk is usable once
    `wait(l)` returns on the consuming stream. `then(fn)` queues fn(layer, staging[:, layer]) on the load stream
    after each layer arrives (e.g. a scatter into the engine's layout) and moves the per-layer events past it."""

    staging: torch.Tensor
    events: list  # per layer: a CUDA event, or None when already complete (CPU)
    stream: torch.cuda.Stream | None = None
    _keep: list = field(default_factory=list)  # host buffers referenced by queued copies
    started: torch.cuda.Event | None = None  # CUDA event recorded before the first copy (None on the CPU)
    cpu_seconds: float = 0.0  # on the CPU, how long the (synchronous) copies took
    checks: list = field(default_factory=list)  # futures of checksum verifications running beside the copies
    checked: list = field(default_factory=list)  # checks[j] verifies chunk checked[j] (when given)
    on_release: list = field(default_factory=list)  # callbacks once the copies are done (e.g. unpin sources)

    @property
    def num_layers(self) -> int:
        return self.staging.shape[1]

    def wait(self, layer: int) -> None:
        ev = self.events[layer]
        if ev is not None:
            torch.cuda.current_stream(self.staging.device).wait_event(ev)

    def then(self, fn: Callable[[int, torch.Tensor], None]) -> LayerwiseLoad:
        """The consumer runs on a stream of its own, so it overlaps the copies of later layers."""
        if self.stream is None:
            for layer in range(self.num_layers):
                fn(layer, self.staging[:, layer])
            return self
        consumer = side_stream(self.staging.device)
        consumer.wait_stream(torch.cuda.current_stream(self.staging.device))
        self.staging.record_stream(consumer)
        with torch.cuda.stream(consumer):
            for layer in range(self.num_layers):
                consumer.wait_event(self.events[layer])
                fn(layer, self.staging[:, layer])
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(consumer)
                self.events[layer] = ev
        self._keep.append(consumer)
        return self

    def synchronize(self) -> None:
        for ev in self.events:
            if ev is not None:
                ev.synchronize()

    def seconds(self) -> float:
        """How long the copies took, from issue to the last one (waits for them)."""
        if self.started is None:
            return self.cpu_seconds
        self.synchronize()
        return max(self.started.elapsed_time(ev) for ev in self.events if ev is not None) / 1000.0

    def verified(self) -> bool:
        """Whether every source chunk matched its checksum (waits for the checks). A consumer must not use what
        it computed from this load when this is False."""
        return all(f.result() for f in self.checks)

    def first_unverified(self) -> int:
        """The index of the first chunk whose verification failed, or the number of chunks if none did (waits
        for the checks): the chunks before it may be used."""
        bad = [i for i, f in zip(self.checked, self.checks) if not f.result()]
        if len(self.checked) < len(self.checks) and not all(f.result() for f in self.checks):
            return 0  # checks without chunk indices: nothing is known to be good
        return min(bad, default=self.staging.shape[0])

    def release(self) -> None:
        """Wait for the copies, then run the release callbacks (sources may be reused after this)."""
        self.synchronize()
        callbacks, self.on_release = self.on_release, []
        for cb in callbacks:
            cb()

    def __enter__(self) -> LayerwiseLoad:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def layer_groups(spec: KVSpec, min_copy_bytes: int) -> list[range]:
    """Consecutive layer ranges whose slice of one chunk is at least min_copy_bytes (the last may be smaller)."""
    layer_bytes = spec.chunk_bytes // spec.num_layers
    per = max(1, -(-min_copy_bytes // layer_bytes))
    return [range(i, min(i + per, spec.num_layers)) for i in range(0, spec.num_layers, per)]


def _runs(srcs: Sequence[torch.Tensor], nbytes: int) -> list[tuple[int, int, int]]:
    """Maximal runs of sources at evenly spaced addresses: (first index, count, stride in bytes). Chunks of one
    prompt usually sit in consecutive slab slots, so a run covers most of a load."""
    ptrs = [s.data_ptr() for s in srcs]
    runs: list[tuple[int, int, int]] = []
    i = 0
    while i < len(ptrs):
        j, stride = i + 1, nbytes
        if j < len(ptrs) and ptrs[j] - ptrs[i] >= nbytes:
            stride = ptrs[j] - ptrs[i]
            while j < len(ptrs) and ptrs[j] - ptrs[j - 1] == stride:
                j += 1
        runs.append((i, j - i, stride))
        i = j
    return runs


def to_device(
    host_srcs: Sequence,
    spec: KVSpec,
    device: torch.device | str,
    *,
    min_copy_bytes: int = 8 * MiB,
    stream: torch.cuda.Stream | None = None,
    out: torch.Tensor | None = None,
    strided: bool | None = None,
) -> LayerwiseLoad:
    """Copy N chunks (host buffers of spec.chunk_bytes, page-locked for speed; or device buffers on `device`) to
    the device, layer group by layer group: group g of every chunk is copied before group g+1 starts, so early
    layers complete first.

    `strided` (default: where the CUDA runtime can be bound): a layer group of a run of evenly spaced sources
    (`_runs`) moves as ONE strided copy (cudaMemcpy2DAsync: a row per chunk), so groups can be single layers
    without paying a copy's fixed cost per chunk: the consumer of layer i then waits for layer i alone, and the
    last layer's compute is all that is left once the copies end. Without it, a copy per chunk and group, groups
    of at least `min_copy_bytes` per chunk."""
    device = torch.device(device)
    n = len(host_srcs)
    staging = out if out is not None else torch.empty((n, *spec.chunk_shape), dtype=spec.torch_dtype, device=device)
    flat = staging.view(n, -1).view(torch.uint8)
    srcs = [_as_bytes(b) for b in host_srcs]
    layer_bytes = spec.chunk_bytes // spec.num_layers
    if device.type != "cuda":
        t0 = time.perf_counter()
        for i, src in enumerate(srcs):
            flat[i].copy_(src[: spec.chunk_bytes])
        return LayerwiseLoad(staging, [None] * spec.num_layers, cpu_seconds=time.perf_counter() - t0)
    runs = None
    if strided is not False and all(not s.is_cuda or s.device == device for s in srcs):
        from kvmesh.cudart import CudaError, cudart

        try:
            cudart()
            runs = _runs(srcs, spec.chunk_bytes)
        except CudaError:
            runs = None
    per_copy = min_copy_bytes if runs is None else max(1, min_copy_bytes * len(runs) // n)
    groups = layer_groups(spec, per_copy)
    stream = stream or side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # staging may have been allocated on the compute stream
    staging.record_stream(stream)
    events: list[torch.cuda.Event | None] = [None] * spec.num_layers
    started = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        started.record(stream)
        for g in groups:
            a, b = g.start * layer_bytes, g.stop * layer_bytes
            for i0, count, stride in runs if runs is not None else [(i, 1, 0) for i in range(n)]:
                if count > 1 and srcs[i0].is_cuda:  # device memory: one strided copy kernel (the copy engines
                    copy_run(flat, i0, count, srcs[i0], stride, a, b)  # move 2-D device copies ~10x slower)
                    continue
                if count > 1 and _copy_2d(flat, i0, count, srcs[i0], stride, a, b, stream):
                    continue
                for i in range(i0, i0 + count):
                    flat[i, a:b].copy_(srcs[i][a:b], non_blocking=True)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
            for layer in g:
                events[layer] = ev
    return LayerwiseLoad(staging, events, stream, srcs, started)


def copy_run(flat: torch.Tensor, i0: int, count: int, src0: torch.Tensor, stride: int, a: int, b: int) -> None:
    """Bytes [a, b) of `count` sources spaced `stride` bytes apart in one storage (starting at `src0`, a uint8
    view) into rows i0.. of `flat`, as one torch copy over strided views (in 8-byte words where aligned)."""
    w = b - a
    unit = (
        8
        if w % 8 == 0
        and stride % 8 == 0
        and a % 8 == 0
        and flat.stride(0) % 8 == 0
        and src0.storage_offset() % 8 == 0
        and flat.storage_offset() % 8 == 0
        else 1
    )
    dtype = torch.int64 if unit == 8 else torch.uint8
    base = src0 if unit == 1 else src0[: src0.numel() // 8 * 8].view(dtype)
    src = base.as_strided((count, w // unit), (stride // unit, 1), base.storage_offset() + a // unit)
    dst = flat[i0 : i0 + count, a:b]
    (dst if unit == 1 else dst.view(dtype)).copy_(src, non_blocking=True)


def _copy_2d(flat: torch.Tensor, i0: int, count: int, src0: torch.Tensor, stride: int, a: int, b: int, stream) -> bool:
    """Bytes [a, b) of `count` evenly spaced sources into rows i0.. of `flat`, as one strided copy."""
    from kvmesh.cudart import CudaError, memcpy_2d_async

    try:
        return memcpy_2d_async(
            flat[i0].data_ptr() + a, flat.stride(0), src0.data_ptr() + a, stride, b - a, count, stream
        )
    except CudaError:  # e.g. memory the runtime does not know: copy chunk by chunk instead
        return False
