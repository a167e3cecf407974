"""Disk tier file format on real files: commit records, torn writes, recovery."""

import os

import pytest

from kvmesh.tiers import checksum
from kvmesh.tiers.disk import HEADER, DiskTier, aligned_buffer

SLOT = 8192
G = b"g" * 16


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def chunk(i: int, n: int = SLOT):
    buf = aligned_buffer(n)
    buf[:n] = bytes([i % 251]) * n
    return buf


@pytest.fixture
def disk(tmp_path):
    d = DiskTier(str(tmp_path / "disk"), 4, SLOT)
    yield d
    d.close()


def write(d: DiskTier, i: int, n: int = SLOT) -> int:
    t = d.prepare_store(k(i), G, n)
    data = chunk(i, n)
    d.write_chunk(t.slot, data, n, k(i), G, checksum(memoryview(data)[:n]))
    d.complete_store(t, checksum(memoryview(data)[:n]))
    return t.slot


def test_round_trip_and_recovery_after_reopen(disk, tmp_path):
    write(disk, 1)
    write(disk, 2, n=5000)  # not a multiple of the 4 KiB block
    assert bytes(disk.read_chunk(disk.slot_of(k(2)), 5000)) == bytes([2]) * 5000
    disk.close()
    again = DiskTier(str(tmp_path / "disk"), 4, SLOT)
    found = {r.key: r for r in again.recover()}
    assert set(found) == {k(1), k(2)} and found[k(2)].nbytes == 5000
    assert found[k(1)].checksum == checksum(bytes([1]) * SLOT)
    again.close()


def test_a_write_killed_before_its_commit_record_leaves_nothing(disk, tmp_path):
    write(disk, 1)
    slot = disk.slot_of(k(1))
    # an overwrite of slot 0 by another chunk, interrupted after the bytes: the old record is already erased
    off = slot * (HEADER + disk.stride)
    os.pwrite(disk._fd, bytes(HEADER), off)
    os.pwrite(disk._fd, bytes([9]) * SLOT, off + HEADER)
    assert disk.recover() == []


def test_a_damaged_commit_record_is_ignored(disk):
    write(disk, 1)
    off = disk.slot_of(k(1)) * (HEADER + disk.stride)
    os.pwrite(disk._fd, b"\xff", off + 30)  # inside the record: its own checksum no longer matches
    assert disk.recover() == []


def test_torn_bytes_under_a_valid_record_fail_their_checksum(disk):
    write(disk, 1)
    slot = disk.slot_of(k(1))
    os.pwrite(disk._fd, b"\x00" * 10, slot * (HEADER + disk.stride) + HEADER + 100)
    rec = disk.recover()[0]
    assert checksum(disk.read_chunk(rec.slot, rec.nbytes)) != rec.checksum


def test_injected_enospc_raises_and_changes_nothing(disk):
    disk.fail_writes_with = 28  # ENOSPC
    t = disk.prepare_store(k(3), G, SLOT)
    with pytest.raises(OSError) as e:
        disk.write_chunk(t.slot, chunk(3), SLOT, k(3), G, 0)
    assert e.value.errno == 28
    disk.abort_store(t)
    assert disk.recover() == [] and len(disk) == 0


def test_disk_directories_are_claimed_one_per_live_node_and_outlive_node_ids(tmp_path):
    import os

    from kvmesh.tiers.disk import claim_directory

    a, fa = claim_directory(str(tmp_path), "node-a")
    b, fb = claim_directory(str(tmp_path), "node-b")
    assert a != b  # two live KVNodes on one machine never share a disk tier
    open(os.path.join(a, "chunks.slab"), "w").close()
    os.close(fa)  # node-a's process is gone
    again, fa2 = claim_directory(str(tmp_path), "node-a")
    assert again == a  # a restarted KVNode takes its own directory back
    os.close(fa2)
    other, fc = claim_directory(str(tmp_path), "node-c")  # a raylet restart: a new node id on this machine
    assert other == a  # adopts the free directory that holds chunks, not an empty one
    d, fd = claim_directory(str(tmp_path), "node-d")
    assert d not in (a, b)
    for f in (fb, fc, fd):
        os.close(f)


def test_read_verified_reads_on_the_tier_threads_and_names_each_outcome(disk):
    from kvmesh.tiers.disk import READ_CORRUPT, READ_FAILED, READ_OK, ChunkRead

    slots = [write(disk, i) for i in (1, 2, 3)]
    # chunk 2's bytes are damaged on disk under its valid record
    os.pwrite(disk._fd, b"\x00" * 10, slots[1] * (HEADER + disk.stride) + HEADER + 100)
    intos = [aligned_buffer(SLOT) for _ in range(4)]
    reads = [ChunkRead(s, SLOT, checksum(bytes([i]) * SLOT), into) for s, i, into in zip(slots, (1, 2, 3), intos)]
    reads.append(ChunkRead(disk.num_slots, SLOT, 0, intos[3]))  # past the end of the file: an I/O error
    assert disk.read_verified(reads) == [READ_OK, READ_CORRUPT, READ_OK, f"{READ_FAILED}:EIO"]
    # every read landed in its own buffer before the call returned
    assert bytes(intos[0][:SLOT]) == bytes([1]) * SLOT and bytes(intos[2][:SLOT]) == bytes([3]) * SLOT
    assert disk.read_verified([]) == []
