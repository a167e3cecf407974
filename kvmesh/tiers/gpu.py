"""GPU tier: the slots of a `SlotPool` in one device allocation.

The KVNode's fastest tier where its node has a GPU. Chunks placed here arrive from host memory (a store or a
promotion) and leave by copy: down to the CPU tier when evicted, or into a CPU slot when a reader needs host
bytes. `device` may be "cpu" to exercise the cascade logic on machines without a GPU (tests do).
"""

from __future__ import annotations

import torch

from kvmesh.tiers import TIER_GPU, checksum
from kvmesh.tiers.slots import SlotPool


class GpuTier(SlotPool):
    tier_id = TIER_GPU

    def __init__(self, num_slots: int, slot_bytes: int, device: str | torch.device = "cuda") -> None:
        super().__init__(num_slots, slot_bytes)
        self.device = torch.device(device)
        self.pool = torch.empty(num_slots * slot_bytes, dtype=torch.uint8, device=self.device)

    def buffer(self, slot: int) -> torch.Tensor:
        return self.pool[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]

    def chunk_view(self, slot: int) -> torch.Tensor:
        return self.buffer(slot)[: self._slots[slot].nbytes]

    def checksum_of(self, slot: int) -> int:
        return checksum(self.chunk_view(slot).cpu().numpy())

    def close(self) -> None:
        self.pool = None
