"""Tier cascade stories with a 2-slot GPU tier above a 3-slot CPU slab: on the GPU where there is one, else on a CPU
stand-in device (the same cascade)."""

import pytest
import torch

from kvmesh.cascade import Cascade
from kvmesh.tiers import TIER_CPU, TIER_GPU, checksum
from kvmesh.tiers.cpu import CpuTier
from kvmesh.tiers.gpu import GpuTier

SLOT = 64
G = b"g" * 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture
def cascade(tmp_path):
    cpu = CpuTier(str(tmp_path / "slab"), 3, SLOT)
    c = Cascade(cpu, GpuTier(2, SLOT, device=DEVICE))
    yield c
    cpu.close()


def put(c: Cascade, i: int) -> None:
    t = c.prepare(k(i), G, SLOT)
    data = bytes([i]) * SLOT
    c.top.buffer(t.slot)[:SLOT] = torch.tensor(list(data), dtype=torch.uint8)
    c.complete(t, checksum(data))


def test_stores_land_on_the_gpu_and_evictions_demote_to_the_cpu(cascade):
    put(cascade, 1)
    put(cascade, 2)
    assert cascade.drain() == {(G, k(1)): TIER_GPU, (G, k(2)): TIER_GPU}
    put(cascade, 3)  # the GPU is full: 1 (least recent) is demoted, not dropped
    assert cascade.best_tier(k(1)) == TIER_CPU and cascade.best_tier(k(3)) == TIER_GPU
    assert cascade.drain() == {(G, k(1)): TIER_CPU, (G, k(3)): TIER_GPU}
    assert cascade.counts["demotions"] == 1
    cascade.check_integrity(verify_checksums=True)  # the demoted bytes kept their checksum


def test_a_reader_gets_host_bytes_for_a_gpu_chunk_and_the_directory_still_says_gpu(cascade):
    put(cascade, 7)
    cascade.drain()
    slots = cascade.pin_host([k(7), k(8)])
    assert len(slots) == 1 and bytes(cascade.cpu.chunk_view(slots[0])) == bytes([7]) * SLOT
    assert cascade.best_tier(k(7)) == TIER_GPU and cascade.drain() == {}
    cascade.cpu.unpin(slots)


def test_a_hit_on_the_cpu_promotes_to_the_gpu(cascade):
    for i in (1, 2, 3):
        put(cascade, i)  # 1 was demoted to the CPU
    cascade.drain()
    assert cascade.promote([k(1)]) == 1  # evicts the GPU's LRU (2), which is demoted in turn
    assert cascade.best_tier(k(1)) == TIER_GPU and cascade.best_tier(k(2)) == TIER_CPU
    assert cascade.drain() == {(G, k(2)): TIER_CPU, (G, k(1)): TIER_GPU}
    cascade.check_integrity(verify_checksums=True)


def test_a_promotion_whose_room_demotes_into_a_pinned_slab_copies_its_own_bytes(cascade):
    """Promoting 1 evicts 4 from the GPU, whose demotion needs a CPU slot: with 2 and 3 pinned by readers, the only
    one left was 1's own, which 4's bytes then overwrote before they were copied up as 1 (with 1's checksum)."""
    for i in (1, 2, 3, 4, 5):  # the CPU holds 1, 2 and 3; the GPU 4 and 5
        put(cascade, i)
    pins = cascade.cpu.pin([k(2), k(3)])
    assert cascade.promote([k(1)]) in (0, 1)  # (no room anywhere is fine; wrong bytes are not)
    cascade.cpu.unpin(pins)
    for tier in (cascade.gpu, cascade.cpu):
        slot = tier.slot_of(k(1))
        if slot is not None:
            b = tier.buffer(slot)[:SLOT]
            assert (bytes(b.cpu().tolist()) if isinstance(b, torch.Tensor) else bytes(b)) == bytes([1]) * SLOT
    assert cascade.best_tier(k(1)) is not None
    cascade.check_integrity(verify_checksums=True)


def test_when_everything_is_full_the_oldest_chunks_are_dropped_and_reported_gone(cascade):
    for i in range(1, 7):  # 2 GPU + 3 CPU slots, 6 chunks: the oldest leaves both tiers
        put(cascade, i)
    changes = cascade.drain()
    assert changes[(G, k(1))] is None and cascade.best_tier(k(1)) is None
    assert sum(1 for i in range(1, 7) if cascade.best_tier(k(i)) is not None) == 5
    assert cascade.counts["drops"] == 1
    cascade.check_integrity()


def test_discard_removes_a_chunk_from_every_tier(cascade):
    put(cascade, 1)
    cascade.cpu.unpin(cascade.pin_host([k(1)]))  # now on both tiers
    cascade.drain()
    cascade.discard(k(1))
    assert cascade.best_tier(k(1)) is None and cascade.drain() == {(G, k(1)): None}


@pytest.fixture
def three_tiers(tmp_path):
    from kvmesh.tiers.disk import DiskTier

    cpu = CpuTier(str(tmp_path / "slab3"), 2, SLOT)
    disk = DiskTier(str(tmp_path / "disk"), 3, SLOT)
    c = Cascade(cpu, None, disk)
    yield c
    cpu.close()
    disk.close()


def put_cpu(c: Cascade, i: int) -> None:
    t = c.prepare(k(i), G, SLOT)
    data = bytes([i]) * SLOT
    c.top.buffer(t.slot)[:SLOT] = data
    c.complete(t, checksum(data))


def run_writes(c: Cascade) -> None:
    for job in c.take_writes():
        c.disk.write_chunk(job.ticket.slot, job.data, job.nbytes, job.ticket.key, job.group, job.checksum)
        c.finish_write(job, True)


def test_cpu_evictions_go_to_disk_and_come_back_on_read(three_tiers):
    from kvmesh.tiers import TIER_DISK

    c = three_tiers
    for i in (1, 2, 3):  # the CPU holds 2: 1 is written back to disk
        put_cpu(c, i)
    run_writes(c)
    assert c.best_tier(k(1)) == TIER_DISK and c.counts["disk_writes"] == 1
    assert c.drain()[(G, k(1))] == TIER_DISK
    slots = c.pin_host([k(1), k(3)])  # 1 is read back into the slab (evicting 2, which goes to disk)
    assert len(slots) == 2 and bytes(c.cpu.chunk_view(slots[0])) == bytes([1]) * SLOT
    c.cpu.unpin(slots)
    run_writes(c)
    assert c.best_tier(k(1)) == TIER_CPU and c.best_tier(k(2)) == TIER_DISK
    c.check_integrity(verify_checksums=True)


def test_a_read_from_a_full_disk_keeps_its_chunk_from_the_write_back_it_causes(three_tiers):
    """Reading chunk 1 into the full slab evicts a CPU chunk, whose write-back needs a disk slot on a full disk: it
    must take another chunk's (the least recent one not being read), never the slot being read. Before, the read
    pinned whatever then lay in its slot: a healthy chunk failed its checksum and that slot stayed pinned."""
    c = three_tiers
    for i in (1, 2, 3, 4, 5):  # the CPU holds 4 and 5, the disk 1, 2 and 3 (1 the least recent)
        put_cpu(c, i)
        run_writes(c)
    slots = c.pin_host([k(1)])  # evicts 4 from the CPU: its write-back evicts 2 from the disk, not 1
    assert len(slots) == 1 and bytes(c.cpu.chunk_view(slots[0])) == bytes([1]) * SLOT
    c.cpu.unpin(slots)
    run_writes(c)
    assert c.counts["disk_checksum_failures"] == 0
    assert [s.pins for s in c.disk._slots] == [0, 0, 0]
    assert c.best_tier(k(2)) is None and c.best_tier(k(4)) is not None and c.best_tier(k(1)) is not None
    c.check_integrity(verify_checksums=True)


def test_write_through_writes_every_chunk(three_tiers):
    from kvmesh.tiers import TIER_DISK

    c = three_tiers
    c.write_policy = "write_through"
    put_cpu(c, 1)
    put_cpu(c, 2)
    run_writes(c)
    assert c.counts["disk_writes"] == 2
    put_cpu(c, 3)  # 1 leaves the CPU: it is on disk already, nothing to write
    assert c.take_writes()[0].ticket.key == k(3) and c.best_tier(k(1)) == TIER_DISK


def test_a_failed_disk_write_drops_the_chunk_and_says_so(three_tiers):
    c = three_tiers
    for i in (1, 2, 3):
        put_cpu(c, i)
    c.drain()
    (job,) = c.take_writes()
    c.finish_write(job, False)
    assert c.best_tier(k(1)) is None and c.drain() == {(G, k(1)): None}
    assert c.counts["disk_write_errors"] == 1


def test_a_read_longer_than_the_slab_gets_its_leading_chunks_from_the_gpu_tier(tmp_path):
    # 6 chunks in the GPU tier, 3 slots in the slab: copying chunk k up once evicted chunks 0..k-1 of the same
    # read, and the read pinned nothing
    cpu = CpuTier(str(tmp_path / "slab"), 3, SLOT)
    c = Cascade(cpu, GpuTier(6, SLOT, device=DEVICE))
    try:
        for i in range(6):
            put(c, i)
        slots = c.pin_host([k(i) for i in range(6)])
        assert [bytes(c.cpu.chunk_view(s)) for s in slots] == [bytes([i]) * SLOT for i in range(3)]
        c.cpu.unpin(slots)
        c.check_integrity(verify_checksums=True)
    finally:
        cpu.close()


def test_chunks_of_a_prompt_already_in_the_slab_do_not_keep_its_first_chunk_out(tmp_path):
    # a 2-slot slab over disk; a read of chunks 3 and 4 left them in the slab. A read of the whole prompt then
    # protected every key it named, 3 and 4 among them: chunk 1 found no slot to evict, and the read got nothing
    from kvmesh.tiers.disk import DiskTier

    cpu, disk = CpuTier(str(tmp_path / "slab"), 2, SLOT), DiskTier(str(tmp_path / "disk"), 8, SLOT)
    c = Cascade(cpu, None, disk)
    try:
        for i in (1, 2, 3, 4, 5, 6):
            put_cpu(c, i)
            run_writes(c)
        c.cpu.unpin(c.pin_host([k(3), k(4)]))
        run_writes(c)
        slots = c.pin_host([k(i) for i in (1, 2, 3, 4, 5, 6)])
        assert [bytes(c.cpu.chunk_view(s)) for s in slots] == [bytes([1]) * SLOT, bytes([2]) * SLOT]
        c.cpu.unpin(slots)
        run_writes(c)
        c.check_integrity(verify_checksums=True)
    finally:
        cpu.close()
        disk.close()
