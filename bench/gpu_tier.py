"""GPU-tier parts of bench/gpu.py: the tier lives in a second process (bench.gpu_node: a real GpuTier, as a KVNode
holds it), this process maps its pool through CUDA IPC (kvmesh.tiers.gpu_ipc) and reads or writes it.

  G1  GPU-tier hit bandwidth: N slots of the other process's pool -> this process's device buffers, as a ratio to
      a raw device-to-device copy of the same bytes in the same run (goal >= 0.8); with and without the device
      checksum verification (which runs on a side stream), and a D2D store (copies + device checksums).
  G2  (with bench/gpu.py's P2 model) TTFT with a GPU-tier hit: the prefix's chunks stored device to device into
      the other process's GPU tier, then loaded layer by layer (one strided D2D copy per layer) under the suffix
      prefill, verified on the GPU.
"""

from __future__ import annotations

import torch

from bench.gpu_ipc_layerwise import read_to_device
from kvmesh.tiers.gpu_ipc import PoolMapper, export_for, read_chunks, write_chunks

MiB = 1 << 20


def _views(mapper: PoolMapper, exports, slots, nbytes):
    return [mapper.open(export_for(exports, s)).slot(s, nbytes) for s in slots]


def g1(device, timer, total_bytes: int, slot_bytes: int = 32 * MiB) -> dict:
    from bench.gpu_node import GpuNodeProcess
    from kvmesh.tiers import gpu_ipc

    n = max(2, total_bytes // slot_bytes)
    node = GpuNodeProcess(2 * n, slot_bytes)
    mapper = PoolMapper()
    try:
        placed = node.store_random(n, seed=11)
        slots, sums = [s for s, _ in placed], [v for _, v in placed]
        exports = node.exports()
        srcs = _views(mapper, exports, slots, slot_bytes)
        dst = torch.empty(n * slot_bytes, dtype=torch.uint8, device=device)
        dsts = [dst[i * slot_bytes:(i + 1) * slot_bytes] for i in range(n)]
        local = torch.empty_like(dst)
        raw = timer(lambda: dst.copy_(local, non_blocking=True))  # the same bytes, one D2D copy
        copies = timer(lambda: gpu_ipc._copy_all(srcs, dsts, None, None))  # what a hit's data path queues
        state = {}

        def hit():
            state["r"] = read_chunks(srcs, dsts, sums)
            state["ok"] = state["r"].verified()
        verified = timer(hit)
        ok = state["ok"] and all(bytes(dsts[i][:4096].cpu().numpy()) == node.chunk(slots[i])[:4096]
                                 for i in (0, n - 1))
        from kvmesh import KVSpec

        spec = KVSpec("g1", 32, 8, 128, "bfloat16", chunk_tokens=256)  # the 8B shape: 32 MiB chunks
        layerwise = None
        if spec.chunk_bytes == slot_bytes:  # the 8B shape's 32 MiB chunks: one strided copy per layer
            out = torch.empty((n, *spec.chunk_shape), dtype=spec.torch_dtype, device=device)
            layerwise = timer(lambda: read_to_device(srcs, spec, device, sums, out=out, verify=False))
        # a store: an engine's device chunks -> reserved slots of the other process's pool, with device sums
        wslots = node.reserve(n)
        wviews = _views(mapper, exports, wslots, slot_bytes)
        store = timer(lambda: write_chunks(dsts, wviews).sums())
        landed = node.complete_device(wslots, write_chunks(dsts, wviews).sums())
        node.check_integrity()
        return {
            "bytes": n * slot_bytes, "chunks": n, "slot_bytes": slot_bytes, "path": state["r"].path,
            "raw_d2d_gbps": n * slot_bytes / raw / 1e9, "hit_copies_gbps": n * slot_bytes / copies / 1e9,
            "hit_verified_gbps": n * slot_bytes / verified / 1e9,
            "hit_layerwise_gbps": n * slot_bytes / layerwise / 1e9 if layerwise else None,
            "store_d2d_with_sums_gbps": n * slot_bytes / store / 1e9,
            "ratio_to_d2d": raw / copies, "ratio_verified_to_d2d": raw / verified,
            "ratio_layerwise_to_d2d": raw / layerwise if layerwise else None,
            "ratio_store_to_d2d": raw / store, "bit_exact_and_verified": bool(ok), "stores_verified": all(landed),
            "goal": "ratio_to_d2d >= 0.8",
        }
    finally:
        mapper.close()
        node.close()


class GpuTierHit:
    """The prefix of a P2 prompt held in another process's GPU tier (stored there device to device)."""

    def __init__(self, chunks: torch.Tensor, spec) -> None:
        from bench.gpu_node import GpuNodeProcess

        n = chunks.shape[0]
        self.spec, self.n = spec, n
        self.node = GpuNodeProcess(n + 1, spec.chunk_bytes)
        self.mapper = PoolMapper()
        slots = self.node.reserve(n)
        exports = self.node.exports()
        self.srcs = _views(self.mapper, exports, slots, spec.chunk_bytes)
        flat = chunks.reshape(n, -1).view(torch.uint8)
        sums = write_chunks([flat[i] for i in range(n)], self.srcs).sums()
        self.stored_verified = all(self.node.complete_device(slots, sums))
        self.sums = sums

    def load(self, device, verify: bool = True):
        return read_to_device(self.srcs, self.spec, device, self.sums, verify=verify)

    def close(self) -> None:
        self.mapper.close()
        self.node.close()
