"""`GpuReads`: a worker's view of its own node's GPU tier, mapped once per client through CUDA IPC
(`tiers.gpu_ipc`), so that the `slab` source can read GPU-tier chunks device to device instead of through the slab.

    GpuReads.open(exports) -> GpuReads | None   maps every pool the node exported; None (and a log line) where that
                                                is impossible here (no CUDA, IPC not permitted, a GPU this process
                                                cannot see): the chunks then come through the slab, as before
    view(slot, nbytes) -> Tensor                a uint8 view of a pinned (or reserved) slot, on the pool's
                                                device (raises GpuIpcError if the pool is gone)
    devices / incarnation                       the GPUs the pools are on; the node incarnation that exported
                                                them (a GpuReserved reply naming another one is not written into)
    close()
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

log = logging.getLogger("kvmesh.client")


class GpuReads:
    def __init__(self, exports: Sequence[bytes]) -> None:
        from kvmesh.tiers.gpu_ipc import PoolExport, PoolMapper

        self.exports = [PoolExport.unpack(e) for e in exports]
        self._mapper = PoolMapper()
        try:
            self._pools = {e.pool_id: self._mapper.open(e) for e in self.exports}
        except BaseException:
            self._mapper.close()
            raise

    @classmethod
    def open(cls, exports: Sequence[bytes]) -> GpuReads | None:
        if not exports:
            return None
        try:
            import torch

            if not torch.cuda.is_available():
                return None
            from kvmesh.tiers.gpu_ipc import GpuIpcError

            try:
                return cls(exports)
            except (GpuIpcError, ValueError) as e:
                log.info(
                    "kvmesh: the node's GPU tier cannot be mapped here (%s): its chunks come through the slab",
                    getattr(e, "reason", e),
                )
                return None
        except ImportError:
            return None

    @property
    def devices(self) -> set:
        return {p.device for p in self._pools.values()}

    @property
    def incarnation(self) -> str:
        return self.exports[0].incarnation

    def view(self, slot: int, nbytes: int):
        from kvmesh.tiers.gpu_ipc import export_for

        e = export_for(self.exports, slot)
        return self._pools[e.pool_id].slot(slot, nbytes)

    def close(self) -> None:
        self._mapper.close()
