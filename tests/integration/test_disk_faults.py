"""A disk tier under faults (writes refused or failing, corrupt records at restart, a close during hung I/O) keeps
its I/O threads alive, ends and counts every write, never counts a refused chunk as saved, never writes into
another file, and closes within its bound. KVNode objects in this process, real redis-server, real files."""

import errno
import os
import threading
import time

import numpy as np
import redis

from kvmesh.tiers import checksum
from kvmesh.tiers.disk import HEADER, ChunkRead, DiskTier, aligned_buffer, claim_directory
from kvmesh.wire import StoreItem, pack_keys, pack_store
from tests.conftest import wait_until

SLOT = 4096
G = b"g" * 16


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def chunks(*ids: int, size: int = SLOT):
    datas = [np.full(size, i % 251, dtype=np.uint8) for i in ids]
    items = [StoreItem(G, k(i), size, checksum(d)) for i, d in zip(ids, datas)]
    return pack_store(items), np.concatenate(datas)


def disk_node(private_redis, make_node, name="node-f" * 4, **kw):
    return make_node(name, "kvnode-f", wire=True, redis_url=private_redis.url, key_prefix="hf", slot_bytes=SLOT,
                     cpu_bytes=kw.pop("cpu_slots", 2) * SLOT, disk_bytes=kw.pop("disk_slots", 8) * SLOT, **kw)


def flip(node, key: bytes) -> None:
    disk = node.cascade.disk
    off = disk.slot_of(key) * (HEADER + disk.stride) + HEADER + 7
    with open(disk.path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 1]))


def test_a_start_up_verification_whose_erase_fails_does_not_kill_the_disk_io_threads(private_redis, make_node,
                                                                                      monkeypatch):
    """Two chunks found corrupt at restart on a disk that now refuses writes (EIO / remounted read-only): erasing
    their commit records fails. Each failure killed the I/O thread that verified it (the OSError escaped
    `_io_loop`), so with both threads dead no disk write ever ran again: write-backs piled up, and the corrupt
    chunks stayed adopted and uncounted."""
    redis.Redis.from_url(private_redis.url).flushall()
    node = disk_node(private_redis, make_node, write_policy="write_through")
    node.store(*chunks(1, 2, 3))
    wait_until(lambda: node.stats().get("disk_writes", 0) == 3, 5)
    flip(node, k(2))
    flip(node, k(3))
    node.kill()

    def refuse(self, slot):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(DiskTier, "invalidate", refuse)
    died = []
    monkeypatch.setattr(threading, "excepthook", lambda a: died.append(a.thread.name))
    again = disk_node(private_redis, make_node, write_policy="write_through")
    try:
        wait_until(lambda: again.stats().get("disk_recovered", 0) == 1, 5)
        wait_until(lambda: again.stats().get("disk_recovery_corrupt", 0) == 2, 5)
        assert not died, f"threads died: {died}"
        assert {again.cascade.best_tier(k(i)) for i in (2, 3)} == {None}  # the corrupt ones are dropped
        again.store(*chunks(11, 12, 13, 14))  # the disk still takes writes
        wait_until(lambda: again.stats().get("disk_writes", 0) >= 4, 5)
        wait_until(lambda: again.stats()["disk_pending_io"] == 0, 5)
        again.check_integrity()
    finally:
        again.shutdown()


def test_a_demotion_the_disk_refuses_is_not_counted_as_a_saved_last_copy(private_redis, make_node):
    """A chunk other nodes read leaves the CPU slab for the disk, and the disk refuses the write (full): the chunk
    has left the node. It was counted `last_copy_saved_disk` when the write was queued and was never handed off,
    so the cluster's last copy of a chunk peers read was lost on every full or failing disk."""
    redis.Redis.from_url(private_redis.url).flushall()
    node = disk_node(private_redis, make_node, recompute_bytes_per_s=1 << 20)
    try:
        assert node.store(*chunks(1)) == 1
        header, data = node.pull(pack_keys([k(1)], "peer-node-b"))  # another node reads it
        assert data.size == SLOT
        node.cascade.disk.fail_writes_with = errno.ENOSPC
        node.store(*chunks(2, 3))  # evicts 1 from the 2-slot CPU tier: its demotion fails
        wait_until(lambda: node.stats().get("disk_write_ENOSPC", 0) >= 1, 5)
        wait_until(lambda: node.stats()["disk_pending_io"] == 0 and not node.cascade._pending, 5)
        assert node.cascade.best_tier(k(1)) is None  # gone from this node
        st = node.stats()
        assert st["last_copy_saved_disk"] == 0, "counted saved on disk, yet not on disk"
        assert st["handoffs_queued"] == 1, "the last copy was not handed off"
    finally:
        node.shutdown()


def test_closing_the_disk_tier_under_a_write_in_flight_never_writes_into_another_file(tmp_path):
    """KVNode.shutdown closes the disk tier once its I/O threads are joined, 5 s at most: a write still in flight
    then (a slow or failing disk; or a node that dies in this process mid-write, `KVNode.kill`) went on with the
    fd numbers `close()` had just given back. The next file this process opened took such a number, and the write's
    commit record landed in it (or `close()` raised BufferError, the zero header's buffer still exported)."""
    import os
    import time

    from kvmesh.tiers.disk import aligned_buffer

    big = 256 << 20  # a write that takes a while
    d = DiskTier(str(tmp_path / "disk"), 2, big)
    data = aligned_buffer(big)
    data[:] = b"\x07" * big
    errors = []

    def write():
        try:
            d.write_chunk(1, data, big, k(1), G, 0)
        except OSError as e:
            errors.append(e)

    t = threading.Thread(target=write)
    t.start()
    time.sleep(0.02)  # the data write is under way
    d.close()
    others = [os.open(str(tmp_path / f"other{i}"), os.O_RDWR | os.O_CREAT, 0o600) for i in range(3)]
    t.join()
    try:
        for fd in others:
            head = os.pread(fd, 8, d._offset(1))
            assert head != b"KVMDISK1", "a commit record was written into another file"
    finally:
        for fd in others:
            os.close(fd)


def test_disk_pending_io_counts_the_writes_in_flight(private_redis, make_node):
    """`disk_pending_io` read the I/O queue's length only: a write an I/O thread had taken off the queue and was
    still doing was not pending, so "0 pending" came while writes were still landing (and a node killed then lost
    them)."""
    import time

    big = 8 << 20
    redis.Redis.from_url(private_redis.url).flushall()
    node = make_node("node-p" * 4, "kvnode-p", wire=True, redis_url=private_redis.url, key_prefix="hp",
                     cpu_bytes=12 * big, slot_bytes=big, disk_bytes=16 * big, write_policy="write_through")
    try:
        datas = [np.full(big, i, dtype=np.uint8) for i in range(10)]
        items = [StoreItem(G, k(i), big, checksum(d)) for i, d in enumerate(datas)]
        assert node.store(pack_store(items), np.concatenate(datas)) == 10
        until = time.monotonic() + 20
        while node.stats()["disk_pending_io"] > 0 and time.monotonic() < until:
            pass
        st = node.stats()
        assert st["disk_pending_io"] == 0
        assert st.get("disk_writes", 0) + st.get("disk_write_errors", 0) == 10, "writes still in flight"
    finally:
        node.shutdown()


def test_a_write_that_raises_no_oserror_is_still_ended(private_redis, make_node, monkeypatch):
    """_io_loop's new guard keeps the thread alive, but the write that raised is never ended: finish_write never
    runs, so its disk slot stays 'writing' (pinned) for good, its buffer never goes back to the pool, the key stays
    in cascade._pending and last_copies.leaving_to_disk, and the same key can never be stored again."""
    redis.Redis.from_url(private_redis.url).flushall()
    real = DiskTier.write_chunk

    def flaky(self, slot, data, nbytes, key, *a, **kw):
        if key == k(1):
            raise ValueError("not an OSError (a bug, a struct.error, a MemoryError...)")
        return real(self, slot, data, nbytes, key, *a, **kw)

    monkeypatch.setattr(DiskTier, "write_chunk", flaky)
    node = disk_node(private_redis, make_node)
    try:
        node.store(*chunks(1))
        node.store(*chunks(2, 3))  # evicts 1 from the 2-slot CPU tier: its demotion raises ValueError
        wait_until(lambda: node.stats()["disk_pending_io"] == 0, 5)
        time.sleep(0.3)
        assert k(1) not in node.cascade._pending, "the write that raised was never ended"
        assert k(1) not in node.last_copies.leaving_to_disk
        node.check_integrity()
    finally:
        node.shutdown()


def test_close_is_bounded_by_wait_s_under_a_hung_read(tmp_path, monkeypatch):
    """close(wait_s) promises to wait at most wait_s for reads and writes in flight, but it first calls
    self._readers.shutdown(wait=True), which waits for a hung read without any bound."""
    d = DiskTier(str(tmp_path / "disk"), 2, SLOT)
    t = d.prepare_store(k(1), G, SLOT)
    buf = aligned_buffer(SLOT)
    d.write_chunk(t.slot, buf, SLOT, k(1), G, checksum(memoryview(buf)[:SLOT]))
    d.complete_store(t, 0)
    release = threading.Event()
    real = os.preadv

    def hung(fd, bufs, off, *a):
        release.wait(10)
        return real(fd, bufs, off, *a)

    monkeypatch.setattr(os, "preadv", hung)
    into = aligned_buffer(SLOT)
    reader = threading.Thread(target=d.read_verified, args=([ChunkRead(t.slot, SLOT, 0, into)],))
    reader.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    closer = threading.Thread(target=d.close, kwargs={"wait_s": 0.5})
    closer.start()
    closer.join(3)
    took = time.monotonic() - t0
    release.set()
    closer.join()
    reader.join()
    assert took < 2, f"close(wait_s=0.5) took {took:.1f} s under a hung read"


def test_a_close_that_gives_up_on_a_hung_write_keeps_the_directory_claimed(tmp_path, monkeypatch):
    """Where close() gives up waiting (a hung write), it keeps the data fds open so the write lands in the right
    file, but it still releases the directory's lock: a next KVNode of this process (KVNodeActor's retry, a
    restart) claims the same directory and recovers it while the old write is still going to land there."""
    root = str(tmp_path / "root")
    path, lock_fd = claim_directory(root, "node-a")
    d = DiskTier(path, 2, SLOT, direct_io=False, lock_fd=lock_fd)  # (plain I/O: posix_fadvise)
    t = d.prepare_store(k(1), G, SLOT)
    release = threading.Event()
    real = DiskTier._pwrite_all

    def hung(fd, data, off):
        release.wait(10)
        return real(fd, data, off)

    monkeypatch.setattr(DiskTier, "_pwrite_all", staticmethod(hung))
    buf = aligned_buffer(SLOT)
    errors = []

    def write():
        try:
            d.write_chunk(t.slot, buf, SLOT, k(1), G, 0)
        except OSError as e:
            errors.append(e)

    w = threading.Thread(target=write)
    w.start()
    time.sleep(0.1)
    d.close(wait_s=0.2)  # gives up: the write is hung
    again, fd2 = claim_directory(root, "node-a")
    try:
        assert again != path, "the directory a write is still going into was handed to the next tier"
    finally:
        os.close(fd2)
        release.set()
        w.join()
    assert not errors, f"the write that close() left running failed after writing its commit record: {errors}"
