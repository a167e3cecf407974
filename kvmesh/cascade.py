"""The tier cascade of one KVNode: GPU (optional) above the CPU slab. Pure logic over the tiers; the node holds
its lock around every call and turns `changes` into directory updates.

    holds(key) / best_tier(key)             which tier has a chunk (the directory shows the best one)
    prepare(key, group, nbytes)             reserve a slot in the top tier; its victims are demoted, not dropped
    complete(tier, ticket, checksum)        the chunk becomes readable
    pin_host(keys) -> [cpu slot]            the leading run of keys, pinned in the CPU slab (readers need host
                                            bytes); a chunk only on the GPU is copied into a CPU slot first
    promote(keys) -> int                    copy CPU-only chunks up into the GPU tier (promotion on hit), head
                                            of the prefix first, never evicting another chunk of the same hit
    discard(key)                            forget a chunk everywhere (corruption)
    ready_chunks() -> [(group, key, tier)]  everything held, with its best tier

Copies between tiers keep the chunk's checksum: it was verified when the bytes entered the node. The GPU tier is
inclusive of nothing and exclusive of nothing: a chunk may sit in both tiers (a copy made for a reader, or a
promotion), and leaving one tier moves it down only when no copy remains below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmesh.tiers import TIER_CPU, TIER_GPU
from kvmesh.tiers.cpu import CpuTier
from kvmesh.tiers.slots import SlotPool, StoreTicket

if TYPE_CHECKING:
    from kvmesh.tiers.gpu import GpuTier


def _bytes(view):
    import torch  # only copies between the GPU and CPU tiers come here

    return view if isinstance(view, torch.Tensor) else torch.frombuffer(view, dtype=torch.uint8)


class Cascade:
    def __init__(self, cpu: CpuTier, gpu: GpuTier | None = None) -> None:
        self.cpu, self.gpu = cpu, gpu
        # (group, key) -> the chunk's best tier now, or None once no tier holds it; drained by the node
        self.changes: dict[tuple[bytes, bytes], int | None] = {}
        self.counts = {"demotions": 0, "promotions": 0, "drops": 0, "host_copies": 0}

    @property
    def top(self) -> SlotPool:
        return self.gpu if self.gpu is not None else self.cpu

    def best_tier(self, key: bytes) -> int | None:
        if self.gpu is not None and self.gpu.slot_of(key) is not None:
            return TIER_GPU
        if self.cpu.slot_of(key) is not None:
            return TIER_CPU
        return None

    def holds(self, key: bytes) -> bool:
        return (key in self.cpu._by_key) or (self.gpu is not None and key in self.gpu._by_key)

    # -- placing ------------------------------------------------------------------------------------------------
    def prepare(self, key: bytes, group: bytes, nbytes: int) -> StoreTicket | None:
        if self.holds(key):
            return None
        return self.top.prepare_store(key, group, nbytes, on_evict=self._evicting(self.top))

    def complete(self, ticket: StoreTicket, chunk_checksum: int) -> None:
        tier = self.top
        tier.complete_store(ticket, chunk_checksum)
        rec = tier.record(ticket.slot)
        self.changes[(rec.group, rec.key)] = tier.tier_id

    def abort(self, ticket: StoreTicket) -> None:
        self.top.abort_store(ticket)

    def _evicting(self, tier: SlotPool):
        def on_evict(slot: int) -> None:
            rec = tier.record(slot)
            if tier is self.gpu and self.cpu.slot_of(rec.key) is None:
                self._copy(self.gpu, slot, self.cpu)  # demote instead of dropping
                self.counts["demotions"] += 1
            below = None
            if tier is self.gpu:
                below = TIER_CPU if self.cpu.slot_of(rec.key) is not None else None
            elif self.gpu is not None and self.gpu.slot_of(rec.key) is not None:
                below = TIER_GPU  # the CPU copy goes, the GPU one stays
            if below is None:
                self.counts["drops"] += 1
            self.changes[(rec.group, rec.key)] = below
        return on_evict

    def _copy(self, src: SlotPool, slot: int, dst: SlotPool, protect=frozenset()) -> int | None:
        """Copy the chunk in src's slot into a new slot of dst; returns that slot (None if dst had no room)."""
        rec = src.record(slot)
        t = dst.prepare_store(rec.key, rec.group, rec.nbytes, on_evict=self._evicting(dst), protect=protect)
        if t is None:
            return None
        _bytes(dst.buffer(t.slot))[: rec.nbytes].copy_(_bytes(src.buffer(slot))[: rec.nbytes])
        dst.complete_store(t, rec.checksum)
        return t.slot

    # -- reading ------------------------------------------------------------------------------------------------
    def pin_host(self, keys: list[bytes]) -> list[int]:
        n = 0
        for key in keys:
            if self.cpu.slot_of(key) is None:
                gslot = self.gpu.slot_of(key) if self.gpu is not None else None
                if gslot is None:
                    break
                self.gpu._slots[gslot].pins += 1  # keep it while copying
                try:
                    copied = self._copy(self.gpu, gslot, self.cpu)
                finally:
                    self.gpu._slots[gslot].pins -= 1
                if copied is None:
                    break
                self.counts["host_copies"] += 1
            n += 1
        slots = self.cpu.pin(keys[:n])
        if self.gpu is not None:
            for key in keys[:n]:
                self.gpu._policy.touch(key)
        return slots

    def promote(self, keys: list[bytes]) -> int:
        if self.gpu is None:
            return 0
        done = 0
        hit = set(keys)  # a promotion never evicts another chunk of the same hit
        for key in keys:
            slot = self.cpu.slot_of(key)
            if slot is None or self.gpu.slot_of(key) is not None:
                continue
            if self._copy(self.cpu, slot, self.gpu, protect=hit) is None:
                break
            rec = self.cpu.record(slot)
            self.changes[(rec.group, rec.key)] = TIER_GPU
            self.counts["promotions"] += 1
            done += 1
        return done

    def discard(self, key: bytes) -> None:
        group = None
        for tier in (self.gpu, self.cpu):
            if tier is None:
                continue
            i = tier._by_key.get(key)
            if i is not None:
                group = tier.record(i).group
                tier.discard(key)
        if group is not None:
            self.changes[(group, key)] = None

    def ready_chunks(self) -> list[tuple[bytes, bytes, int]]:
        seen: dict[bytes, tuple[bytes, bytes, int]] = {}
        for tier in (self.cpu, self.gpu):
            if tier is None:
                continue
            for group, key in tier.ready_chunks():
                seen[key] = (group, key, tier.tier_id)  # the GPU pass comes last: best tier wins
        return list(seen.values())

    def drain(self) -> dict[tuple[bytes, bytes], int | None]:
        out, self.changes = self.changes, {}
        return out

    def check_integrity(self, verify_checksums: bool = False) -> None:
        self.cpu.check_integrity(verify_checksums)
        if self.gpu is not None:
            self.gpu.check_integrity(verify_checksums)
