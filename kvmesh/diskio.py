"""`DiskIO`: a node's disk I/O threads (`kvmesh-node-io-*`) and their queue. Two kinds of work, each a small
dataclass put on the queue under the node's lock:

    Write(job)      a chunk bound for the disk tier (`writeback.WriteJob`: a demotion or a write-through); the
                    cascade ends it (`finish_write`) whether it landed or not
    Verify(found)   a chunk the disk tier found at start-up: readable at once (every disk read is verified),
                    registered once its bytes check out, dropped if they do not

`outstanding` counts what was put and is not done yet, queued or in a thread's hands (under the lock): the node's
stats show it as `disk_pending_io`.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.cascade import Cascade
from kvmesh.tiers import checksum
from kvmesh.writeback import WriteJob

log = logging.getLogger("kvmesh.node")


@dataclass(frozen=True, slots=True)
class Write:
    job: WriteJob


@dataclass(frozen=True, slots=True)
class Verify:
    found: object  # a record the disk tier recovered: slot, key, group, nbytes, checksum


class DiskIO:
    def __init__(
        self,
        cascade: Cascade,
        lock,
        counts: Counter,
        post_changes: Callable[[], int],
        event: Callable[..., None],
        stop: threading.Event,
        node_id: str,
    ) -> None:
        """`lock`: the node's (guards the cascade and `counts`); `post_changes` (under it): the cascade's changes to
        the registrar; `event(kind, reason, detail)`: the live page's events."""
        self.cascade, self.lock, self.counts = cascade, lock, counts
        self._post_changes, self._event, self._stop, self.node_id = post_changes, event, stop, node_id
        self.outstanding = 0
        self._queue: queue.SimpleQueue[Write | Verify] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def put(self, work: Write | Verify) -> None:
        """Caller holds the lock (or no I/O thread runs yet)."""
        self.outstanding += 1
        self._queue.put(work)

    def put_writes(self) -> None:
        """Caller holds the lock: the cascade's disk writes, queued now (they free write-back buffers)."""
        for job in self.cascade.take_writes():
            self.put(Write(job))

    def start(self, n: int) -> None:
        for i in range(n):
            t = threading.Thread(target=self._loop, name=f"kvmesh-node-io-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def join(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout=timeout)

    def _loop(self) -> None:
        disk = self.cascade.disk
        while not self._stop.is_set():
            try:
                work = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            assert disk is not None  # (writes and start-up verifications exist only with a disk tier)
            try:
                if isinstance(work, Write):
                    self._write(disk, work.job)
                else:
                    self._verify(disk, work.found)
            except Exception:  # (an I/O thread that died would leave every later write queued for good)
                log.exception("KVNode %s: disk %s failed", self.node_id[:8], type(work).__name__.lower())
            finally:
                with self.lock:
                    self.outstanding -= 1

    def _write(self, disk, item: WriteJob) -> None:
        ok, no_space = True, False
        try:
            disk.write_chunk(item.ticket.slot, item.data, item.nbytes, item.ticket.key, item.group, item.checksum)
        except OSError as e:
            ok, no_space = False, e.errno == errno.ENOSPC
            code = errno.errorcode.get(e.errno or 0, "EIO")  # (exported by its errno name: disk_write_E*)
            with self.lock:
                self.counts[f"disk_write_{code}"] += 1
            log.warning(
                "KVNode %s: disk write failed (%s); the chunk stays where it was or is dropped", self.node_id[:8], e
            )
            self._event("disk_write_failed", code, str(e))
        except Exception:  # noqa: BLE001 - not an I/O error (a bug): the write is ended as failed all the same,
            ok = False  # else its disk slot, buffer and pending entry (and a last-copy decision) stay for good
            log.exception("KVNode %s: disk write failed", self.node_id[:8])
        with self.lock:
            self.cascade.finish_write(item, ok)
            if no_space:  # a disk tier bigger than its file system's free space: the next writes evict from
                disk.park_unbacked(item.ticket.slot)  # the slots that have their blocks, instead of failing
                # for good (this slot too: blocks of an earlier, smaller chunk do not make room for this one)
            self._post_changes()

    def _verify(self, disk, item) -> None:
        """A chunk found on disk at start-up: register it once its bytes check out."""
        failed = None
        try:
            good = checksum(disk.read_chunk(item.slot, item.nbytes)) == item.checksum
        except OSError as e:  # unreadable, not known corrupt: dropped, counted as a disk read error
            good, failed = False, errno.errorcode.get(e.errno or 0, "EIO")
        with self.lock:
            if disk.record(item.slot).key != item.key:
                return  # already gone (evicted or read and found corrupt)
            if good:
                self.cascade.record_change(item.group, item.key)
                self.counts["disk_recovered"] += 1
            else:
                if failed is not None:
                    self.cascade.count_read_error(failed)
                else:
                    try:
                        disk.invalidate(item.slot)
                    except OSError as e:  # (a disk that refuses writes now: the record stays, and the
                        # next start verifies it again; this one drops the chunk all the same)
                        log.warning("KVNode %s: a corrupt disk record stays (%s)", self.node_id[:8], e)
                    self.counts["disk_recovery_corrupt"] += 1
                self.cascade.discard(item.key)
            self._post_changes()
