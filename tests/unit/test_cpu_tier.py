"""CPU tier: 4-slot stories with small integer-named keys."""

import os
import subprocess
import sys

import numpy as np
import pytest

from kvmesh.tiers import checksum
from kvmesh.tiers.cpu import CpuTier, SlabReader

SLOT = 64


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture
def tier(tmp_path):
    t = CpuTier(str(tmp_path / "slab"), num_slots=4, slot_bytes=SLOT)
    yield t
    t.close()


def put(tier: CpuTier, i: int, fill: int | None = None, group: bytes = b"g" * 16):
    ticket = tier.prepare_store(key(i), group, SLOT)
    if ticket is None:
        return None
    data = bytes([fill if fill is not None else i % 256]) * SLOT
    tier.buffer(ticket.slot)[:SLOT] = data
    tier.complete_store(ticket, checksum(data))
    return ticket


def test_store_and_pin_the_leading_run(tier):
    for i in (1, 2, 3):
        put(tier, i)
    assert len(tier) == 3
    slots = tier.pin([key(1), key(2), key(9), key(3)])  # stops at the first missing chunk
    assert len(slots) == 2
    assert bytes(tier.chunk_view(slots[1])) == bytes([2]) * SLOT
    tier.unpin(slots)
    tier.check_integrity(verify_checksums=True)


def test_storing_a_held_key_is_refused(tier):
    put(tier, 1)
    assert tier.prepare_store(key(1), b"g" * 16, SLOT) is None


def test_full_tier_evicts_least_recent_and_never_a_pinned_slot(tier):
    for i in (1, 2, 3, 4):
        put(tier, i)
    pinned = tier.pin([key(1)])  # 1 is now most recent and pinned
    t = put(tier, 5)  # evicts 2, the least recent
    assert [k for _g, k in t.evicted] == [key(2)]
    assert tier.slot_of(key(2)) is None and tier.slot_of(key(5)) is not None
    tier.pin([key(3)]), tier.pin([key(4)]), tier.pin([key(5)])
    assert put(tier, 6) is None  # every slot pinned: refused, nothing changed
    assert len(tier) == 4
    tier.unpin(pinned)
    assert [k for _g, k in put(tier, 6).evicted] == [key(1)]
    tier.check_integrity()


def test_a_slot_being_written_is_invisible_and_unevictable(tier):
    ticket = tier.prepare_store(key(1), b"g" * 16, SLOT)
    assert tier.pin([key(1)]) == []
    for i in (2, 3, 4):
        put(tier, i)
    assert put(tier, 5) is not None  # evicted 2, not the slot being written
    tier.abort_store(ticket)
    assert tier.slot_of(key(1)) is None
    tier.check_integrity()


def test_checksum_detects_corruption_and_discard_waits_for_readers(tier):
    put(tier, 1)
    slot = tier.pin([key(1)])[0]
    tier.buffer(slot)[5] ^= 0xFF  # a bit flip in memory
    assert not tier.verify(slot)
    with pytest.raises(AssertionError):
        tier.check_integrity(verify_checksums=True)
    tier.discard(key(1))
    assert tier.pin([key(1)]) == []  # no new reader gets it
    assert tier.record(slot).key == key(1)  # but the pinned reader still owns the slot
    tier.unpin([slot])
    assert tier.slot_of(key(1)) is None and len(tier) == 0
    tier.check_integrity()


def test_another_process_reads_the_slab_through_shared_memory(tier):
    put(tier, 7, fill=0xAB)
    slot = tier.slot_of(key(7))
    code = (f"from kvmesh.tiers.cpu import SlabReader; r = SlabReader({tier.path!r}, {4 * SLOT}); "
            f"print(bytes(r.view({slot * SLOT}, {SLOT})).hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert bytes.fromhex(out) == bytes([0xAB]) * SLOT
    r = SlabReader(tier.path, 4 * SLOT)
    with pytest.raises(TypeError):
        r.view(0, SLOT)[0] = 1  # readers map the slab read-only
    r.close()


def test_close_removes_the_slab(tmp_path):
    t = CpuTier(str(tmp_path / "s2"), 2, SLOT)
    assert os.path.exists(t.path)
    t.close()
    assert not os.path.exists(t.path)
    assert np.frombuffer(b"x", dtype=np.uint8).size == 1


def test_the_clients_of_a_process_share_one_mapping_of_a_slab(tmp_path):
    from kvmesh.tiers.cpu import CpuTier, SlabReader

    tier = CpuTier(str(tmp_path / "slab"), 4, 4096)
    try:
        a = SlabReader.open(tier.path, 4 * 4096)
        b = SlabReader.open(tier.path, 4 * 4096)
        assert a is b
        a.close()
        assert bytes(b.view(0, 4)) == bytes(4)  # still mapped for the other client
        b.close()
        c = SlabReader.open(tier.path, 4 * 4096)
        assert c is not a  # the last close unmapped it; a new user maps it afresh
        c.close()
    finally:
        tier.close()


def test_a_cpu_tier_bigger_than_its_shared_memory_is_shrunk_to_fit():
    from kvmesh.tiers.build import fit_slots

    assert fit_slots(100, 10, 2000) == 100  # fits: as configured
    assert fit_slots(100, 10, 999) == 49  # /dev/shm is smaller: half of what is free (Ray's store lives there too)
    assert fit_slots(100, 10, 5) == 1


def test_a_slot_whose_memory_cannot_be_allocated_refuses_its_store(tier, monkeypatch):
    # the slab is sparse; a write into a page a full /dev/shm cannot back kills the process (SIGBUS). Each slot
    # gets its memory (posix_fallocate) before its first write, and a slot that cannot refuses the store instead
    import errno

    assert put(tier, 1) is not None
    real = os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    assert tier.prepare_store(key(2), b"g" * 16, SLOT) is None and tier.unbacked_refusals == 1
    assert tier.slot_of(key(2)) is None and len(tier) == 1  # nothing half-made, and the first chunk untouched
    monkeypatch.setattr(os, "posix_fallocate", real)
    assert put(tier, 2) is not None
    tier.check_integrity(verify_checksums=True)


def test_a_full_shared_memory_leaves_an_lru_of_the_slots_that_have_memory(tier, monkeypatch):
    """Once /dev/shm had no memory for a slot, every later store popped that same unbacked slot again (abort put it
    back on top of the free stack) and was refused, for as long as /dev/shm stayed full, while slots that had
    memory held chunks nobody read: the cache froze with what it held (found by the resource-limits hunt)."""
    import errno

    from kvmesh.tiers import slots as slots_mod

    assert put(tier, 1) is not None and put(tier, 2) is not None  # 2 of 4 slots have memory
    real = os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    assert put(tier, 3) is None and tier.unbacked_refusals == 1  # the store that found /dev/shm full
    for i in range(4, 10):  # later ones evict least recent chunks from the slots that have memory
        assert put(tier, i) is not None, f"store {i} refused with 2 evictable slots"
    assert [tier.slot_of(key(i)) is not None for i in (8, 9)] == [True, True] and len(tier) == 2
    assert tier.unbacked_refusals == 1
    tier.check_integrity(verify_checksums=True)
    monkeypatch.setattr(os, "posix_fallocate", real)
    monkeypatch.setattr(slots_mod, "BACKING_RETRY_S", 0.0)  # memory again: the set-aside slots are used again
    assert all(put(tier, i) is not None for i in (10, 11))
    assert len(tier) == 4
    tier.check_integrity(verify_checksums=True)


def test_a_chunk_discarded_while_it_is_written_is_released_when_the_write_completes(tier):
    ticket = tier.prepare_store(key(1), b"g" * 16, SLOT)
    assert tier.discard(key(1))  # (a corrupt report, an eviction) while the writer still fills the slot
    data = bytes([1]) * SLOT
    tier.buffer(ticket.slot)[:SLOT] = data
    tier.complete_store(ticket, checksum(data))
    assert tier.slot_of(key(1)) is None and tier.pin([key(1)]) == [] and len(tier) == 0  # the slot is free again
    assert put(tier, 2) is not None and len(tier) == 1
    tier.check_integrity(verify_checksums=True)
