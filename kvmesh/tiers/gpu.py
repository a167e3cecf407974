"""GPU tier: the slots of a `SlotPool` in one device allocation per GPU of the node.

The KVNode's fastest tier where its node has GPUs. Slots are split evenly over the pools (pool k holds slots
[k * per_pool, (k + 1) * per_pool)). Chunks arrive from host memory (a store or a promotion: `buffer(slot)` is
written, then `complete_store`) or from an engine's GPU (`write_chunks` into a mapped pool, then
`complete_device_store` with the device checksums of what landed). They leave by copy: down to the CPU tier when
evicted, into a CPU slot for a host reader, or device to device to a same-node reader through CUDA IPC
(kvmesh.tiers.gpu_ipc).

    buffer(slot) / chunk_view(slot)            the slot's device memory (a uint8 view)
    device_of(slot) -> torch.device            which GPU holds it
    exports(node_id, incarnation) -> [PoolExport]   one CUDA IPC handle per pool (CUDA pools only; else
                                               GpuIpcError "no_cuda")
    device_sum(slot) -> int                    the device checksum recorded when the chunk was placed (waits for it)
    complete_device_store(ticket, device_sum)  mutates: a chunk written by an engine's GPU becomes readable
    host_checksum(slot, host_bytes) -> int | None   the xxh3 a copy of the chunk on the host carries (None: the
                                               device bytes fail their device checksum; do not keep the copy)
    verify(slot) -> bool                       pure: the device checksum of the bytes now equals the recorded one

Each slot holds two checksums (see kvmesh.tiers.devsum for which is checked where): `record(slot).checksum`, the
xxh3 it entered the node with (0 and `host_sum_known` False for a chunk that came from a GPU), and the device
checksum, computed on a side stream when the chunk was placed from the host, or given by the GPU writer.
`device` may be "cpu" (a plain tensor per pool) to exercise the cascade logic on machines without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.cudart import side_stream
from kvmesh.tiers import TIER_GPU, checksum
from kvmesh.tiers.devsum import Coefficients, device_checksum, fused_ok
from kvmesh.tiers.slots import SlotPool, StoreTicket


def _devices(device) -> list[torch.device]:
    if isinstance(device, str) and "," in device:
        device = [d.strip() for d in device.split(",") if d.strip()]
    if isinstance(device, (list, tuple)):
        if not device:
            raise ValueError("GpuTier needs at least one device")
        return [torch.device(d) for d in device]
    return [torch.device(device)]


class GpuTier(SlotPool):
    tier_id = TIER_GPU

    def __init__(
        self, num_slots: int, slot_bytes: int, device: str | torch.device | Sequence[str | torch.device] = "cuda"
    ) -> None:
        super().__init__(num_slots, slot_bytes)
        self.devices = _devices(device)
        if len(self.devices) > num_slots:
            raise ValueError(f"GpuTier: {num_slots} slots cannot be split over {len(self.devices)} GPUs")
        self.device = self.devices[0]
        self.per_pool = -(-num_slots // len(self.devices))
        self._pools: list[DevicePool | None] = []  # per device: a DevicePool on CUDA, None on the CPU stand-in
        self.pools: list[torch.Tensor] = []  # per device: uint8 over that pool's slots
        for k, dev in enumerate(self.devices):
            n = min(self.per_pool, num_slots - k * self.per_pool)
            if dev.type == "cuda":
                from kvmesh.tiers.gpu_ipc import DevicePool

                p = DevicePool(n * slot_bytes, dev)
                assert p.tensor is not None  # (a pool is open until its close())
                self._pools.append(p)
                self.pools.append(p.tensor)
            else:
                self._pools.append(None)
                self.pools.append(torch.empty(n * slot_bytes, dtype=torch.uint8, device=dev))
        self.pool = self.pools[0] if len(self.pools) == 1 else None  # the one pool of a single-GPU tier
        self.coefficients = Coefficients()
        for dev in self.devices:  # the fused device checksum compiles at start, not at the first placement
            fused_ok(dev)
        self._sums: list = [None] * num_slots  # per slot: int, a pending 0-d device tensor, or None (free)
        self._sum_events: list = [None] * num_slots
        self._host_known = [True] * num_slots  # False: the chunk came from a GPU, its xxh3 is computed on demand
        self._streams: dict = {}

    # -- memory ---------------------------------------------------------------------------------------------------
    def locate(self, slot: int) -> tuple[int, int]:
        """(pool index, byte offset in that pool) of a slot."""
        k = slot // self.per_pool
        return k, (slot - k * self.per_pool) * self.slot_bytes

    def device_of(self, slot: int) -> torch.device:
        return self.devices[slot // self.per_pool]

    def buffer(self, slot: int) -> torch.Tensor:
        k, off = self.locate(slot)
        return self.pools[k][off : off + self.slot_bytes]

    def chunk_view(self, slot: int) -> torch.Tensor:
        return self.buffer(slot)[: self._slots[slot].nbytes]

    def exports(self, node_id: str, incarnation: str) -> list:
        """One `PoolExport` per pool, for same-node readers (raises GpuIpcError "no_cuda" on the CPU stand-in)."""
        from kvmesh.tiers.gpu_ipc import GpuIpcError

        out = []
        for k, p in enumerate(self._pools):
            if p is None:
                raise GpuIpcError("no_cuda", f"pool {k} is on {self.devices[k]}, not a CUDA device")
            out.append(p.export(node_id, incarnation, k * self.per_pool, self.slot_bytes))
        return out

    # -- checksums ------------------------------------------------------------------------------------------------
    def _side(self, dev: torch.device):
        s = self._streams.get(dev)
        if s is None:
            s = self._streams[dev] = side_stream(dev)
        return s

    def _place_sum(self, slot: int) -> None:
        """Queue the device checksum of a slot just written from the host (off the caller's critical path)."""
        view = self.chunk_view(slot)
        if not view.is_cuda:
            self._sums[slot] = int(device_checksum(view, self.coefficients))
            return
        side = self._side(view.device)
        side.wait_stream(torch.cuda.current_stream(view.device))  # after the copy that wrote the slot
        with torch.cuda.stream(side):
            self._sums[slot] = device_checksum(view, self.coefficients)
            ev = torch.cuda.Event()
            ev.record(side)
        self._sum_events[slot] = ev

    def device_sum(self, slot: int) -> int:
        v = self._sums[slot]
        assert v is not None, f"slot {slot} holds no placed chunk"
        if isinstance(v, torch.Tensor):
            ev = self._sum_events[slot]
            if ev is not None:
                ev.synchronize()
            v = self._sums[slot] = int(v)
            self._sum_events[slot] = None
        return v

    def checksum_of(self, slot: int) -> int:
        """The device checksum of the chunk's bytes now (compare with `device_sum`)."""
        return int(device_checksum(self.chunk_view(slot), self.coefficients))

    def verify(self, slot: int) -> bool:
        s = self._slots[slot]
        return s.ready and self.checksum_of(slot) == self.device_sum(slot)

    def host_checksum(self, slot: int, host_bytes) -> int | None:
        if self._host_known[slot]:
            return self._slots[slot].checksum
        if not self.verify(slot):
            return None
        return checksum(host_bytes)

    # -- store ----------------------------------------------------------------------------------------------------
    def complete_store(self, ticket: StoreTicket, chunk_checksum: int) -> None:
        super().complete_store(ticket, chunk_checksum)
        if self._slots[ticket.slot].key != ticket.key:
            return  # discarded while it was written: released already
        self._host_known[ticket.slot] = True
        self._place_sum(ticket.slot)

    def complete_device_store(self, ticket: StoreTicket, device_sum: int) -> None:
        """A chunk written into the slot by an engine's GPU (`gpu_ipc.write_chunks`, whose sums say what landed)."""
        super().complete_store(ticket, 0)
        if self._slots[ticket.slot].key != ticket.key:
            return  # discarded while it was written: released already
        self._host_known[ticket.slot] = False
        self._sums[ticket.slot], self._sum_events[ticket.slot] = int(device_sum), None

    def _release(self, slot: int) -> None:
        super()._release(slot)
        self._sums[slot] = self._sum_events[slot] = None
        self._host_known[slot] = True

    def close(self) -> None:
        for p in self._pools:
            if p is not None:
                p.close()
        self._pools, self.pools, self.pool = [], [], None
