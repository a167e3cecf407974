"""Tier cascade stories with a 2-slot GPU tier (on a CPU stand-in device) above a 3-slot CPU slab."""

import pytest
import torch

from kvmesh.cascade import Cascade
from kvmesh.tiers import TIER_CPU, TIER_GPU, checksum
from kvmesh.tiers.cpu import CpuTier
from kvmesh.tiers.gpu import GpuTier

SLOT = 64
G = b"g" * 16


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture
def cascade(tmp_path):
    cpu = CpuTier(str(tmp_path / "slab"), 3, SLOT)
    c = Cascade(cpu, GpuTier(2, SLOT, device="cpu"))
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
