"""Cluster eviction: a KVNode does not simply drop the last copy of a chunk other nodes read.

    read_by_peer(key)          mutates: a node other than this one read the chunk (the holder's serving path)
    leaving(key, group, nbytes, checksum, view, demoted, replica)
                               mutates: the cascade evicts the chunk from the CPU slab; `demoted`: it went down
                               to this node's disk tier. Decides with `policy.save_last_copy`; a chunk worth saving
                               that had no room on disk is copied aside and queued for a handoff. Under the node's
                               lock, no I/O: a memory copy of one chunk at most
    watch(cascade, replicas)   the cascade's eviction hooks (`on_leave`, `on_written`) call `leaving` from here on
    forget(key)                mutates: a chunk dropped as corrupt is neither saved on disk nor handed off
    shutdown()                 mutates: stops the handoff thread (queued handoffs are dropped)

The order of choices: a chunk demoted to this node's disk tier (the cascade does that whenever it has a disk tier
with room) is safe already and counted as saved there (until the disk evicts it in its turn: chunks leaving from
the disk tier are not handed off). It is judged once its disk write ends (`on_written`): one the disk
refused (full, failing) has left the node then, its bytes still in the write buffer, and goes on as any chunk
leaving the node; a chunk that leaves the node, was read by other nodes lately (a replica pulled
from elsewhere too: its source may have evicted the original since), and whose expected recompute outweighs a
move, is handed to the live peer with the most free room (CPU and disk, from the stats the nodes publish each
heartbeat) unless the directory lists another live holder; anything else is dropped as before.

A handoff never blocks eviction: the bytes are copied aside (at most `max_bytes` waiting at once, beyond that the
chunk is dropped) and one thread (`kvmesh-node-handoff`) does the network part, each step bounded: it asks the
directory whether another live node still holds the chunk (then it is not the last copy: dropped), picks a target
and pushes the chunk through the target's ordinary store path (`NodeHandle.store`, verified against the chunk's
checksum there, registered by the target before it answers), waiting at most `HANDOFF_TIMEOUT_S`. Any failure
(no target, a dead or slow target, a directory error) drops the chunk, as eviction did before: never wrong data,
never a hang. The evicting node unregisters its copy as usual; the target registers its own.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import numpy as np

from kvmesh.cascade import Cascade
from kvmesh.policy import Leaving, save_last_copy
from kvmesh.replication import Replicas
from kvmesh.tiers import TIER_DISK
from kvmesh.wire import StoreItem

log = logging.getLogger("kvmesh.lastcopy")
HANDOFF_TIMEOUT_S = 5.0  # a target's store must answer within this
MOVE_BPS = 1 << 30  # bytes per second a handoff is assumed to move (the policy's cost of a move)
READS_KEPT = 65536  # chunks whose peer reads are remembered (least recently read forgotten first)


@dataclass(slots=True)
class _Reads:
    count: int
    last: float  # monotonic time of the last read by another node


@dataclass(slots=True)
class Handoff:
    """One chunk copied aside for a handoff."""

    group: bytes
    key: bytes
    nbytes: int
    checksum: int
    data: np.ndarray


class LastCopies:
    def __init__(
        self,
        node_id: str,
        window_s: float,
        max_bytes: int,
        recompute_bps: float,
        count: Callable[..., None],
        directory,
        stats_key: str,
        peers: Callable,
    ) -> None:
        """`count(name, n)`: the node's counters (takes the node's lock: called only from the handoff thread);
        `directory`: the node's `Directory`; `stats_key`: the Redis hash of the nodes' published stats;
        `peers(node_id)`: a handle of that node's KVNode, or None."""
        self.node_id, self.window_s, self.max_bytes, self.recompute_bps = node_id, window_s, max_bytes, recompute_bps
        self._count, self._directory, self._stats_key, self._peers = count, directory, stats_key, peers
        self._reads: OrderedDict[bytes, _Reads] = OrderedDict()  # under the node's lock
        self.counts: dict[str, int] = {"last_copy_saved_disk": 0, "handoffs_queued": 0, "handoff_refused_busy": 0}
        self._waiting = 0  # bytes copied aside, not handed off yet (under the node's lock)
        self._queue: queue.SimpleQueue[Handoff | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _waiting against the handoff thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvmesh-node-handoff", daemon=True)
        self._thread.start()
        # chunks that left the slab for a disk write still in flight: key -> whether a replica; judged once the
        # write ends (saved on disk, or leaving the node if the disk refused it)
        self.leaving_to_disk: dict[bytes, bool] = {}
        self._cascade: Cascade | None = None
        self._replicas: Replicas | None = None

    def watch(self, cascade: Cascade, replicas: Replicas) -> None:
        self._cascade, self._replicas = cascade, replicas
        cascade.on_leave, cascade.on_written = self.on_leave, self.on_written

    # -- under the node's lock -----------------------------------------------------------------------------------
    def read_by_peer(self, key: bytes) -> None:
        r = self._reads.get(key)
        if r is None:
            self._reads[key] = _Reads(1, time.monotonic())
            if len(self._reads) > READS_KEPT:
                self._reads.popitem(last=False)
        else:
            r.count += 1
            r.last = time.monotonic()
            self._reads.move_to_end(key)

    def _worth_saving(self, key: bytes, nbytes: int, replica: bool) -> bool:
        r = self._reads.get(key)
        if r is None:
            return False
        c = Leaving(nbytes, r.count, time.monotonic() - r.last, replica)
        return save_last_copy(c, self.window_s, self.recompute_bps, MOVE_BPS)

    def leaving(
        self,
        key: bytes,
        group: bytes,
        nbytes: int,
        checksum: int,
        view: Callable[[], memoryview],
        demoted: bool,
        replica: bool,
    ) -> None:
        if not self._worth_saving(key, nbytes, replica):
            if not demoted:
                self._reads.pop(key, None)
            return
        if demoted:  # on this node's disk now: saved without a move
            self.counts["last_copy_saved_disk"] += 1
            return
        self._reads.pop(key, None)  # its reads go with it (the target starts afresh: no ping-pong)
        with self._lock:
            if self._waiting + nbytes > self.max_bytes:
                self.counts["handoff_refused_busy"] += 1
                return
            self._waiting += nbytes
        data = np.frombuffer(view(), dtype=np.uint8)[:nbytes].copy()
        self.counts["handoffs_queued"] += 1
        self._queue.put(Handoff(group, key, nbytes, checksum, data))

    def on_leave(self, slot: int, rec, below: int | None) -> None:
        """The cascade evicts from the slab; the chunk's bytes are still in `slot`."""
        assert self._cascade is not None and self._replicas is not None  # (`watch` set the hook)
        if below is not None and below != TIER_DISK:
            return  # (a copy stays in the GPU tier above)
        if below == TIER_DISK and self._cascade.writing(rec.key):  # not on disk yet: the disk may refuse it
            self.leaving_to_disk[rec.key] = self._replicas.is_replica(rec.key)
            return
        cpu = self._cascade.cpu
        replica = self._replicas.is_replica(rec.key)
        self.leaving(
            rec.key, rec.group, rec.nbytes, rec.checksum, lambda: cpu.chunk_view(slot), below is not None, replica
        )

    def on_written(self, job, ok: bool) -> None:
        """The cascade ends a disk write; the chunk's bytes are still in `job.data`."""
        assert self._cascade is not None  # (`watch` set the hook)
        key = job.ticket.key
        replica = self.leaving_to_disk.pop(key, None)
        if replica is None:
            return  # (it never left the slab for this write)
        if not ok and self._cascade.best_tier(key) is not None:
            return  # (back in the slab meanwhile: it leaves again later)
        data = job.data
        self.leaving(key, job.group, job.nbytes, job.checksum, lambda: memoryview(data), ok, replica)

    def forget(self, key: bytes) -> None:
        self.leaving_to_disk.pop(key, None)

    # -- the handoff thread --------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if job is None:
                return
            outcome = "failed"
            try:
                outcome = self._hand_off(job)
            except Exception as e:  # noqa: BLE001 - any failure is a drop, as eviction was before
                log.debug("handoff failed: %s", e)
            finally:
                with self._lock:
                    self._waiting -= job.nbytes
            self._count(f"handoff_{outcome}")
            if outcome == "ok":
                self._count("handoff_bytes", job.nbytes)

    def _hand_off(self, job: Handoff) -> str:
        d = self._directory
        table = d.node_table()
        holders = d.holders(job.group, [job.key], table)[0]
        if any(h.node_id != self.node_id for h in holders):
            return "not_last"  # another live node holds it: dropping this copy loses nothing
        target = self._target(set(table.by_node()), job.nbytes)
        if target is None:
            return "no_target"
        handle = self._peers(target)
        if handle is None:
            return "failed"
        stored = handle.store([StoreItem(job.group, job.key, job.nbytes, job.checksum)], job.data)
        return "ok" if stored.result(HANDOFF_TIMEOUT_S) == 1 else "refused"

    def _target(self, live: set[str], nbytes: int) -> str | None:
        """The live peer with the most free room (CPU slab and disk tier), from the stats nodes publish: in free
        slots (`free_bytes`), as each chunk takes a whole slot whatever its size (a peer full of a smaller model's
        chunks holds few bytes, and a handoff there evicts one of them); a record without them (an earlier
        release's) by bytes."""
        best, room = None, nbytes - 1
        for node, raw in d_items(self._directory.redis.hgetall(self._stats_key)):
            if node == self.node_id or node not in live:
                continue
            s = msgpack.unpackb(raw, raw=False)
            free = s.get("free_bytes", s.get("capacity_bytes", 0) - s.get("used_bytes", 0)) + s.get(
                "disk_free_bytes", s.get("disk_capacity_bytes", 0) - s.get("disk_used_bytes", 0)
            )
            if free > room:
                best, room = node, free
        return best

    def shutdown(self) -> None:
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout=HANDOFF_TIMEOUT_S + 1)


def d_items(h: dict) -> list[tuple[str, bytes]]:
    return [(k.decode() if isinstance(k, bytes) else k, v) for k, v in h.items()]
