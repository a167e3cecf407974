"""Slot bookkeeping shared by every tier: fixed-size slots, one chunk per slot, an eviction policy, pins.

Primitives (the owner calls them under its own lock; none block on I/O):

    prepare_store(key, group, nbytes) -> StoreTicket | None   mutates: reserves a slot, evicting by policy; None
                                                              when the key is already held or every slot is pinned
    buffer(slot)                                               the writable memory of a reserved slot (per tier)
    complete_store(ticket, checksum)                           mutates: the chunk becomes readable
    abort_store(ticket)                                        mutates: the reservation is undone
    pin(keys) -> list[int]                                     mutates: pins the leading run of readable keys
    unpin(slots)                                               mutates
    hold(slot) / release(slot)                                 mutates: one pin on a slot whatever it holds (a
                                                               chunk being copied or read stays put meanwhile)
    touch(key)                                                 mutates: the chunk becomes the policy's most recent
    key in pool, pinned(key), group_of(key)                    reads: held (or being received), pinned, its group
    verify(slot) -> bool                                       pure: checksum of the slot's bytes matches
    host_checksum(slot, host_bytes) -> int | None              pure: the xxh3 a host copy of the chunk carries
    discard(key)                                               mutates: forget a chunk (freed once unpinned)
    check_integrity()                                          pure: raises AssertionError on broken invariants

Invariants: a pinned or writing slot is never evicted or reused; a key maps to at most one slot; a slot is free
or in `_by_key`, never both.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.policy import LRUPolicy


class Slot:
    """Record of one slot. Changed only by the owning `CpuTier`, under the owner's lock."""

    __slots__ = ("key", "group", "nbytes", "checksum", "pins", "ready", "doomed", "devsum")

    def __init__(self) -> None:
        self.key: bytes | None = None  # chunk hash held, None when free
        self.group: bytes = b""  # first-chunk hash of the chunk's prompt (its directory group)
        self.nbytes = 0  # bytes of the chunk (<= slot_bytes)
        self.checksum = 0  # checksum of those bytes, set when the chunk becomes readable
        self.pins = 0  # readers (and the writer) holding the slot
        self.ready = False  # readable: written and checksummed
        self.doomed = False  # discarded while pinned: freed on the last unpin
        # device checksum (tiers.devsum) of the bytes, where the tier records one (the CPU slab: its node's
        # device-checksum thread, after the chunk became readable); None until then, and reset whenever the slot
        # is taken for other bytes (prepare_store, adopt, release)
        self.devsum: int | None = None


BACKING_RETRY_S = 1.0  # slots set aside for want of space (`park_unbacked`) are tried again after this


@dataclass(frozen=True, slots=True)
class StoreTicket:
    slot: int
    key: bytes
    evicted: list[tuple[bytes, bytes]] = field(default_factory=list)  # (group, key) of chunks evicted for room


class SlotPool:
    """Bookkeeping of one tier; subclasses own the memory (`buffer`, `checksum_of`, `close`)."""

    tier_id = -1  # TIER_GPU / TIER_CPU / TIER_DISK, set by each tier

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        assert num_slots > 0 and slot_bytes > 0
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._slots = [Slot() for _ in range(num_slots)]
        self._free = list(range(num_slots - 1, -1, -1))  # stack: low slots first
        # Free slots whose memory or disk space the file system has not given yet (a sparse slab or file): each
        # tier sets a slot's flag once it has its space. When the file system has no more (a full /dev/shm or
        # disk), the free slots without space are set aside (`park_unbacked`): stores then evict from the slots
        # that have it, as an LRU of the smaller tier, instead of each popping such a slot again and being refused
        # for as long as the file system stays full (the tier froze with what it held)
        self._backed = bytearray(num_slots)
        self._parked: list[int] = []
        self._parked_at = 0.0
        self._by_key: dict[bytes, int] = {}
        self.group_counts: Counter[bytes] = Counter()  # group -> slots holding (or receiving) its chunks
        self._policy: LRUPolicy[bytes] = LRUPolicy()

    # -- queries ------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Readable chunks held."""
        return sum(1 for s in self._slots if s.ready and not s.doomed)

    def slot_of(self, key: bytes) -> int | None:
        i = self._by_key.get(key)
        return i if i is not None and self._slots[i].ready else None

    def record(self, slot: int) -> Slot:
        return self._slots[slot]

    def __contains__(self, key: bytes) -> bool:
        """Whether a slot holds the chunk or is receiving it (`slot_of` answers only for readable ones)."""
        return key in self._by_key

    def pinned(self, key: bytes) -> bool:
        i = self._by_key.get(key)
        return i is not None and self._slots[i].pins > 0

    def group_of(self, key: bytes) -> bytes | None:
        i = self._by_key.get(key)
        return None if i is None else self._slots[i].group

    def ready_chunks(self) -> list[tuple[bytes, bytes]]:
        """(group, key) of every readable chunk."""
        return [(s.group, s.key) for s in self._slots if s.ready and not s.doomed and s.key is not None]

    @property
    def used_bytes(self) -> int:
        return sum(s.nbytes for s in self._slots if s.key is not None)

    @property
    def free_bytes(self) -> int:
        """Room for chunks without evicting: the free slots (those set aside for want of space not counted) times
        the slot size. Not capacity less `used_bytes`: a chunk takes a whole slot whatever its size, so a tier full
        of a small model's chunks holds few bytes and has no room."""
        return len(self._free) * self.slot_bytes

    # -- store --------------------------------------------------------------------------------------------------
    def prepare_store(
        self,
        key: bytes,
        group: bytes,
        nbytes: int,
        on_evict: Callable[[int], None] | None = None,
        protect: set[bytes] | frozenset = frozenset(),
    ) -> StoreTicket | None:
        """`on_evict(slot)` runs for a victim while its bytes are still in place (to demote it); keys in
        `protect` are not evicted for this store."""
        assert 0 < nbytes <= self.slot_bytes
        if key in self._by_key:
            return None
        if self._parked and time.monotonic() - self._parked_at >= BACKING_RETRY_S:  # (the file system may have
            self._free.extend(sorted(self._parked, reverse=True))  # room again: tried first, low slots first)
            self._parked = []
        evicted: list[tuple[bytes, bytes]] = []
        if not self._free:
            victims = self._policy.evict(1, lambda k: self._slots[self._by_key[k]].pins == 0 and k not in protect)
            if victims is None:
                return None
            for k in victims:
                slot = self._by_key[k]
                s = self._slots[slot]
                evicted.append((s.group, k))
                if on_evict is not None:
                    s.pins += 1  # the victim's bytes stay put while they are demoted
                    try:
                        on_evict(slot)
                    finally:
                        s.pins -= 1
                self._release(slot)
        slot = self._free.pop()
        s = self._slots[slot]
        s.key, s.group, s.nbytes, s.pins, s.ready, s.doomed, s.devsum = key, group, nbytes, 1, False, False, None
        self._by_key[key] = slot
        self.group_counts[group] += 1
        return StoreTicket(slot, key, evicted)

    def adopt(self, found: list[tuple[int, bytes, bytes, int, int]]) -> int:
        """Take over chunks found in place (a disk tier after a restart) as readable: (slot, key, group, nbytes,
        checksum), most recent first. Returns how many were taken (a slot or key already in use is skipped)."""
        free = set(self._free)
        taken = 0
        for slot, key, group, nbytes, chunk_checksum in reversed(found):  # the most recent ends most recent
            if key in self._by_key or slot not in free:
                continue
            free.discard(slot)
            s = self._slots[slot]
            s.key, s.group, s.nbytes, s.checksum, s.pins, s.ready, s.doomed = (
                key,
                group,
                nbytes,
                chunk_checksum,
                0,
                True,
                False,
            )
            s.devsum = None
            self._by_key[key] = slot
            self.group_counts[group] += 1
            self._policy.insert(key)
            self._backed[slot] = 1  # (found in place: it has its space)
            taken += 1
        self._free = [i for i in self._free if i in free]
        return taken

    def park_unbacked(self, slot: int | None = None) -> int:
        """The file system had no space for a slot (`slot`, where known: it lacks space whatever it held before,
        e.g. a disk slot that had blocks only for a smaller chunk): set the free slots without space aside (for
        BACKING_RETRY_S). Returns how many are set aside now."""
        if slot is not None:
            self._backed[slot] = 0
        unbacked = [i for i in self._free if not self._backed[i]]
        if unbacked:
            self._free = [i for i in self._free if self._backed[i]]
            self._parked.extend(unbacked)
            self._parked_at = time.monotonic()
        return len(self._parked)

    @property
    def unbacked_slots(self) -> int:
        """Slots set aside now because the file system had no space for them."""
        return len(self._parked)

    def complete_store(self, ticket: StoreTicket, chunk_checksum: int) -> None:
        s = self._slots[ticket.slot]
        assert s.key == ticket.key and not s.ready
        s.checksum, s.ready = chunk_checksum, True
        s.pins -= 1
        if s.doomed:  # discarded while it was being written: gone once its last pin goes, never readable
            if not s.pins:
                self._release(ticket.slot)
            return
        self._policy.insert(ticket.key)

    def abort_store(self, ticket: StoreTicket) -> None:
        s = self._slots[ticket.slot]
        assert s.key == ticket.key and not s.ready
        s.pins -= 1
        self._release(ticket.slot)

    # -- read ---------------------------------------------------------------------------------------------------
    def pin(self, keys: list[bytes]) -> list[int]:
        slots = []
        for key in keys:
            i = self.slot_of(key)
            if i is None or self._slots[i].doomed:
                break
            slots.append(i)
        for i in slots:
            self._slots[i].pins += 1
        for key in reversed(keys[: len(slots)]):  # the head of the prefix ends most recent
            self._policy.touch(key)
        return slots

    def unpin(self, slots: list[int]) -> None:
        for i in slots:
            s = self._slots[i]
            assert s.pins > 0, f"unpin of unpinned slot {i}"
            s.pins -= 1
            if s.pins == 0 and s.doomed:
                self._release(i)

    def hold(self, slot: int) -> None:
        """One more pin on `slot`: it is neither evicted nor reused until `release`."""
        self._slots[slot].pins += 1

    def release(self, slot: int) -> None:
        self.unpin([slot])

    def touch(self, key: bytes) -> None:
        self._policy.touch(key)

    def verify(self, slot: int) -> bool:
        s = self._slots[slot]
        return s.ready and self.checksum_of(slot) == s.checksum

    # -- memory, provided by each tier --------------------------------------------------------------------------
    def buffer(self, slot: int):
        """The writable memory of a slot (slot_bytes long)."""
        raise NotImplementedError

    def checksum_of(self, slot: int) -> int:
        """Checksum of the chunk's bytes as they are in the slot now."""
        raise NotImplementedError

    def host_checksum(self, slot: int, host_bytes) -> int | None:
        """The xxh3 a host copy of the chunk carries (GpuTier: computed for chunks that came from a GPU)."""
        return self._slots[slot].checksum

    def discard(self, key: bytes) -> bool:
        i = self._by_key.get(key)
        if i is None:
            return False
        s = self._slots[i]
        self._policy.remove(key)
        if s.pins:
            s.doomed = True
        else:
            self._release(i)
        return True

    def _release(self, slot: int) -> None:
        s = self._slots[slot]
        assert s.pins == 0 and s.key is not None
        self._policy.remove(s.key)
        del self._by_key[s.key]
        self.group_counts[s.group] -= 1
        if not self.group_counts[s.group]:
            del self.group_counts[s.group]
        s.key, s.group, s.nbytes, s.checksum, s.ready, s.doomed, s.devsum = None, b"", 0, 0, False, False, None
        self._free.append(slot)

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def check_integrity(self, verify_checksums: bool = False) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "slot on the free list twice"
        parked = set(self._parked)
        assert len(parked) == len(self._parked) and not parked & free, "slot set aside twice, or set aside and free"
        for i, s in enumerate(self._slots):
            assert s.pins >= 0, f"slot {i} has negative pins"
            if i in free or i in parked:
                assert s.key is None and s.pins == 0, f"free slot {i} holds a chunk or pins"
                continue
            assert s.key is not None and self._by_key.get(s.key) == i, f"slot {i} not indexed by its key"
            assert 0 < s.nbytes <= self.slot_bytes
            if s.ready and not s.doomed:
                assert s.key in self._policy, f"readable slot {i} unknown to the policy"
                if verify_checksums:
                    assert self.verify(i), f"slot {i} fails its checksum"
            if not s.ready:
                assert s.pins >= 1, f"slot {i} being written without the writer's pin"
                assert s.devsum is None, f"slot {i} has a device checksum before its bytes are complete"
        assert len(free) + len(parked) + len(self._by_key) == self.num_slots, "slots lost"
        assert len(self._policy) <= len(self._by_key)
