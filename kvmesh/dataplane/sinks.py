"""Sinks: where the chunks of one fetch land. A sink owns its staging memory: nothing in it is shared with another
fetch, so no run can overwrite what an earlier run delivered.

Every sink has, for chunk index i of the fetch (0-based within the match):

    prepare(staged)         the chunk indices that will arrive through `segments`/`put` (peer runs), before any
                            source begins: a sink that needs staging for them allocates it here, once
    segments(i) -> [array]  writable host memory chunk i's bytes land in, in chunk byte order (a receiver writes
                            the socket's bytes straight into it). Distinct chunks never share memory
    put(i, src)             copy chunk i's bytes (chunk layout, host memory) into the sink
    adopt(i, src, checksum, on_bad, device_sum=None) -> bool
                            take page-locked `src` (a pinned slab slot) by reference instead of copying; the sink
                            verifies it itself (against `device_sum`, the slot's device checksum, over the bytes as
                            they land on the device where it is given and the sink copies to a device; else
                            against `checksum`, xxh3), calls `on_bad()` if it fails, and keeps `src` until it is
                            released. False: this sink copies instead
    adopt_device(i, src, device_sum, on_bad)
                            (sinks with `device_reads`) the same for a GPU-tier slot mapped through CUDA IPC: copied
                            device to device, its device checksum (tiers.devsum) verified on a side stream
    commit(i, checksum)     chunk i landed and was verified
    on_release(fn)          fn() runs once the sink reads no adopted memory any more (a source's unpin)
    finish(n) -> result     the fetch delivered chunks [0, n) intact; what the caller gets

`Sink` declares them, with the defaults of a sink that only copies: nothing to prepare, nothing adopted (sources
release at once), nothing to do at commit. Sinks here: `HostSink` (a new CPU tensor, or a caller's `out=`) and
`DeviceSink` (a device, with completion per layer). A KVNode's pull-through lands in its own slots through
`kvmesh.pullthrough.SlotSink` (or `BufferSink`), sinks of the same base.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import numpy as np
import torch

from kvmesh.spec import KVSpec
from kvmesh.tiers import checksum


class Sink:
    """The sink protocol, with defaults; a sink gives `segments`, `put` and `finish` at least."""

    device_reads = False  # whether GPU-tier slots may be adopted device to device (`adopt_device`)

    def prepare(self, staged: Sequence[int]) -> None:
        pass

    def segments(self, i: int) -> list[np.ndarray]:
        raise NotImplementedError

    def put(self, i: int, src) -> None:
        raise NotImplementedError

    def adopt(
        self, i: int, src, chunk_checksum: int, on_bad: Callable[[], None], device_sum: int | None = None
    ) -> bool:
        return False

    def adopt_device(self, i: int, src: torch.Tensor, device_sum: int, on_bad: Callable[[], None]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not read device to device")

    def commit(self, i: int, chunk_checksum: int) -> None:
        pass

    def on_release(self, fn: Callable[[], None]) -> None:
        fn()  # nothing adopted: sources release at once

    def finish(self, n: int):
        raise NotImplementedError


class HostSink(Sink):
    """Into a `[num_layers, 2, >= n * chunk_tokens, heads, head_dim]` contiguous CPU tensor: chunk i fills tokens
    [i * chunk_tokens, (i + 1) * chunk_tokens) of every layer's K and V."""

    def __init__(self, spec: KVSpec, out: torch.Tensor) -> None:
        self.spec, self.out = spec, out
        s = spec
        self._u8 = out.view(torch.uint8).view(
            s.num_layers, 2, out.shape[2], s.num_kv_heads * s.head_dim * s.element_size
        )
        self._np: np.ndarray | None = None  # the same memory as numpy (slices cheap enough for every chunk)

    def _dst(self, i: int) -> torch.Tensor:
        c = self.spec.chunk_tokens
        return self._u8[:, :, i * c : (i + 1) * c]

    def segments(self, i: int) -> list[np.ndarray]:
        if self._np is None:
            self._np = self._u8.numpy()
        c, u8 = self.spec.chunk_tokens, self._np
        return [u8[layer, kv, i * c : (i + 1) * c] for layer in range(self.spec.num_layers) for kv in (0, 1)]

    def put(self, i: int, src) -> None:
        s = self.spec
        self._dst(i).copy_(torch.frombuffer(src, dtype=torch.uint8).view(s.num_layers, 2, s.chunk_tokens, -1))

    def finish(self, n: int) -> torch.Tensor:
        return self.out[:, :, : n * self.spec.chunk_tokens]


class DeviceSink(Sink):
    """Onto a device (`movers.to_device`: layer group by layer group, completion per layer). Same-node chunks are
    adopted: DMA'd straight from the page-locked slab, unpinned on `load.release()`, and verified while the copies
    run (`load.verified()`): on the device, by their device checksum over the bytes as they landed in the staging
    (with the GPU-tier chunks' sums, layer group by layer group on a side stream), where the node recorded one;
    else xxh3 on CPU threads. Peer chunks land in page-locked staging that belongs to this fetch alone, one row per
    chunk. `finish(n)` returns (LayerwiseLoad or None, n)."""

    def __init__(self, spec: KVSpec, device: torch.device, verify: Executor, min_copy_bytes: int = 8 << 20) -> None:
        self.spec, self.device, self.min_copy_bytes = spec, device, min_copy_bytes
        self.device_reads = device.type == "cuda"  # GPU-tier chunks may be adopted device to device
        # chunk index -> (device sum, on_bad): GPU-tier chunks, and slab chunks whose device sum the node knows
        self._device: dict[int, tuple[int, Callable[[], None]]] = {}
        self._verify = verify
        self._srcs: dict[int, object] = {}  # chunk index -> host memory the device copy reads
        self._rows: dict[int, int] = {}  # chunk index -> its staging row
        self._staging: torch.Tensor | None = None
        self._checks: list = []  # futures of the adopted chunks' verifications
        self._checked: list[int] = []  # the chunk index each verifies
        self._releases: list[Callable[[], None]] = []

    def prepare(self, staged: Sequence[int]) -> None:
        if not staged:
            return
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        self._staging = torch.empty((len(staged), self.spec.chunk_bytes), dtype=torch.uint8, pin_memory=pin)
        self._rows = {i: r for r, i in enumerate(staged)}

    def _row(self, i: int) -> torch.Tensor:
        assert self._staging is not None and i in self._rows, f"chunk {i} was not announced to prepare()"
        row = self._staging[self._rows[i]]
        self._srcs[i] = row
        return row

    def segments(self, i: int) -> list[np.ndarray]:
        return [self._row(i).numpy()]

    def put(self, i: int, src) -> None:
        self._row(i).copy_(torch.frombuffer(src, dtype=torch.uint8))

    def adopt(
        self, i: int, src, chunk_checksum: int, on_bad: Callable[[], None], device_sum: int | None = None
    ) -> bool:
        self._srcs[i] = src
        if device_sum is not None:  # checked on the device in finish(), over what landed there
            self._device[i] = (device_sum, on_bad)
            return True

        def check() -> bool:
            ok = checksum(src) == chunk_checksum
            if not ok:
                on_bad()
            return ok

        self._checks.append(self._verify.submit(check))
        self._checked.append(i)
        return True

    def adopt_device(self, i: int, src: torch.Tensor, device_sum: int, on_bad: Callable[[], None]) -> None:
        self._srcs[i] = src
        self._device[i] = (device_sum, on_bad)

    def on_release(self, fn: Callable[[], None]) -> None:
        self._releases.append(fn)

    def _release(self) -> None:
        for f in self._checks:  # the verifying threads read adopted memory too: done before it is unpinned
            f.result()
        fns, self._releases = self._releases, []
        for fn in fns:
            fn()

    def finish(self, n: int):
        from kvmesh.movers import to_device

        if n == 0:
            self._release()
            return None, 0
        load = to_device([self._srcs[i] for i in range(n)], self.spec, self.device, min_copy_bytes=self.min_copy_bytes)
        load.checks, load.checked = self._checks, self._checked
        on_device = sorted(i for i in self._device if i < n)
        if on_device:  # device checksums of what landed, on a side stream as each layer group lands
            from kvmesh.tiers.devsum import verify_rows_by_layer

            flat = load.staging.view(load.staging.shape[0], -1).view(torch.uint8)
            v = verify_rows_by_layer(flat, on_device, [self._device[i][0] for i in on_device], load.events)
            for j, i in enumerate(on_device):
                load.checks.append(_DeviceCheck(v, j, self._device[i][1]))
                load.checked.append(i)
        load.on_release = [self._release]
        if self._staging is not None:
            load._keep.append(self._staging)
        return load, n


class _DeviceCheck:
    """One chunk's share of a batch of device checksums (a GPU-tier chunk, or a slab chunk with a recorded device
    sum), as a `LayerwiseLoad.checks` entry."""

    def __init__(self, verify, j: int, on_bad: Callable[[], None]) -> None:
        self._verify, self._j, self._on_bad = verify, j, on_bad
        self._reported = False

    def result(self) -> bool:
        ok = self._verify.per_chunk()[self._j]
        if not ok and not self._reported:
            self._reported = True
            self._on_bad()
        return ok
