"""Moves between an engine's KV layouts and kvmesh chunks, and between host tiers and the GPU.

Layouts
    chunk       [L, 2, C, H, D] contiguous, "page-first": what tiers hold and the wire carries
    contiguous  per layer K and V [1, H, T, D]: transformers' DynamicCache

(The paged movers, vLLM's [2, num_blocks, block_size, H, D] layers and a block table, and the device -> host
copies that no product path uses are in bench/movers_paged.py, for the benchmarks and their tests; the vLLM
connector moves blocks through kvmesh.paged and kvmesh.dataplane.)

Primitives (none allocate per page; each runs one indexed kernel per layer over every chunk of a batch):

    scatter_contiguous(chunks, keys, values, start)                         chunks -> K/V (in place)
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
from kvmesh.spec import KVSpec

MiB = 1 << 20


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
