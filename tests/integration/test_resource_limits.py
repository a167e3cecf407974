"""Tiers on file systems that run out of space while a KVNode runs: a /dev/shm that Ray's object store fills, a disk
tier configured bigger than its disk's free space. Real tmpfs mounts of a few pages (where this process may mount;
skipped elsewhere), a real redis-server, KVNodes as plain objects."""

import contextlib
import os
import subprocess
import tempfile

import pytest
import redis

from kvmesh.config import KVMeshConfig
from kvmesh.wire import pack_keys
from tests.conftest import wait_until
from tests.integration.nodes import WireNode
from tests.integration.test_node import SLOT, chunks, k, lookup, settled


@contextlib.contextmanager
def small_tmpfs(size: int):
    """A tmpfs of `size` bytes of this test's own (so filling it touches nothing else)."""
    path = tempfile.mkdtemp(prefix="kvmesh-small-fs-")
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.decode().strip()}")
        try:
            yield path
        finally:
            subprocess.run(["umount", "-l", path], check=False)
    finally:
        os.rmdir(path)


def fill(directory: str) -> None:
    """Something else (Ray's object store) takes every byte left on `directory`'s file system."""
    fd = os.open(os.path.join(directory, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


def held(node, ids) -> list[int]:
    return [i for i in ids if node.cascade.best_tier(k(i)) is not None]


def test_a_full_shared_memory_keeps_storing_into_the_slots_that_have_memory(private_redis, make_node):
    """The slab is sparse and each slot gets its memory at its first store. Once /dev/shm was full, every later
    store popped the same slot without memory again and was refused: the node stored nothing new for as long as
    /dev/shm stayed full, while its slots with memory kept chunks nobody read. Now the tier goes on as an LRU of
    the slots that have memory; the directory names only what is held, and what is read is bit-exact."""
    redis.Redis.from_url(private_redis.url).flushall()
    with small_tmpfs(64 * 1024) as shm:
        node = make_node("node-s" * 4, "kvnode-s", wire=True, redis_url=private_redis.url, key_prefix="rl",
                         cpu_bytes=8 * SLOT, slot_bytes=SLOT, shm_dir=shm)
        try:
            if node.tier.page_locked:  # (registered with CUDA: every slot got its memory at start, none can lack it)
                pytest.skip("a page-locked slab has all its memory from the start")
            assert node.store(*chunks(1, 2)) == 2
            fill(shm)
            stored = [node.store(*chunks(i)) for i in range(3, 10)]
            assert sum(stored) >= 6, stored  # at most the store that found /dev/shm full is refused
            st = node.stats()
            assert st["slab_unbacked_refusals"] >= 1 and st["store_refused_full"] <= 1
            assert held(node, range(1, 10)) == [8, 9]  # the two slots with memory hold the latest chunks
            ids = list(range(1, 10))
            assert lookup(node, [8, 9]) and len(lookup(node, [8, 9])) == 2
            raw = node.directory.lookup_raw(b"g" * 16, [k(i) for i in ids])
            assert [i for i, r in zip(ids, raw) if r] == [8, 9]  # evicted chunks left the directory
            _, data = node.pull(pack_keys([k(8), k(9)]))
            assert data.size == 2 * SLOT and (data[:SLOT] == 8).all() and (data[SLOT:] == 9).all()
            node.check_integrity(directory=True)
        finally:
            node.shutdown()


def test_a_disk_tier_bigger_than_its_disk_keeps_the_latest_chunks(private_redis, make_node):
    """A disk tier's file is sparse too: with a budget bigger than the disk's free space, the writes past it
    failed (ENOSPC) and every later one took the same never-written slot again and failed as well: the disk kept
    its first chunks for good and dropped every newer one. Now the disk goes on as an LRU of the slots that have
    their blocks."""
    redis.Redis.from_url(private_redis.url).flushall()
    with small_tmpfs(64 * 1024) as disk_fs:  # 8 slots of a header page and a data page; 64 configured
        node = make_node("node-d" * 4, "kvnode-d", wire=True, redis_url=private_redis.url, key_prefix="rl",
                         cpu_bytes=2 * SLOT, slot_bytes=SLOT, disk_dir=os.path.join(disk_fs, "disk"),
                         disk_bytes=64 * SLOT)
        try:
            for i in range(1, 41, 4):
                node.store(*chunks(i, i + 1, i + 2, i + 3))
                wait_until(lambda: settled(node), 10)
            st = node.stats()
            assert st["disk_write_ENOSPC"] >= 1
            on_disk = [i for i in range(1, 41) if node.cascade.disk.slot_of(k(i)) is not None]
            assert on_disk and max(on_disk) > 30, on_disk  # the disk took recent chunks, not only its first ones
            assert st["disk_writes"] > 20, st["disk_writes"]
            ids = list(range(1, 41))
            raw = node.directory.lookup_raw(b"g" * 16, [k(i) for i in ids])
            assert [i for i, r in zip(ids, raw) if r] == held(node, ids)  # the directory names what is held
            for i in on_disk[-2:]:
                _, data = node.pull(pack_keys([k(i)]))
                assert data.size == SLOT and (data == i % 251).all()
            node.check_integrity(directory=True)
        finally:
            node.shutdown()


@pytest.mark.parametrize("setting", ["shm_dir", "disk_dir"])
def test_a_tier_directory_that_is_a_file_is_named_by_its_setting(private_redis, tmp_path, setting):
    """A first start whose shm_dir or disk_dir is a file said `FileExistsError: [Errno 17] File exists: '<path>'`
    (what `kvmesh.start` shows as the KVNode's one line): neither which option, nor what is wrong with it."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    dirs = {"shm_dir": str(tmp_path), "disk_dir": str(tmp_path / "disk"), setting: str(blocker)}
    cfg = KVMeshConfig(redis_url=private_redis.url, key_prefix="rl", cpu_bytes=8 * SLOT, slot_bytes=SLOT,
                       disk_bytes=8 * SLOT, **dirs)
    with pytest.raises(NotADirectoryError, match=f"KVMeshConfig.{setting} '{blocker}'.*[Nn]ot a directory"):
        WireNode(cfg, "node-f" * 4, "kvnode-f")
    assert not [f for f in os.listdir(tmp_path) if f.startswith("kvmesh-")]  # and it left no slab behind


def test_a_full_disk_slot_written_with_a_smaller_chunk_does_not_freeze_the_tier(private_redis, make_node):
    """A disk slot is flagged as having its blocks after any write, but a chunk smaller than the slot allocates
    only its own pages. When a bigger chunk then lands in that slot on a full disk (ENOSPC), the slot still counts
    as having its space: it is not set aside, goes back on top of the free stack, and every later bigger chunk
    pops it again and fails, while the slots that do have their blocks keep their old chunks for good."""
    redis.Redis.from_url(private_redis.url).flushall()
    big = 2 * SLOT
    with small_tmpfs(64 * 1024) as disk_fs:  # 16 pages: a small chunk takes 2 (header + 1), a big one 3
        node = make_node("node-v" * 4, "kvnode-v", wire=True, redis_url=private_redis.url, key_prefix="rl",
                         cpu_bytes=2 * big, slot_bytes=big, disk_dir=os.path.join(disk_fs, "disk"), disk_bytes=64 * big)
        try:
            node.store(*chunks(1, size=SLOT))  # another model's smaller chunk: its disk slot gets 2 of 3 pages
            wait_until(lambda: settled(node), 10)
            for i in range(2, 40):
                node.store(*chunks(i, size=big))
                wait_until(lambda: settled(node), 10)
            on_disk = [i for i in range(1, 40) if node.cascade.disk.slot_of(k(i)) is not None]
            assert on_disk and max(on_disk) > 30, on_disk  # the disk keeps taking recent chunks
            node.check_integrity(directory=True)
        finally:
            node.shutdown()
