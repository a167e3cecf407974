"""`Serving`: how a KVNode hands out the chunks it holds. Three variants, one path: each pins the leading run of
the keys asked for through `take` (chunks on the disk or GPU tier are first brought into the slab), which also
accounts the reader and counts the call once.

    pin(keys, requester, gpu, hold_s) -> Pinned     a same-node reader: the pin lives in the pin table until
                                                    `unpin`, or its expiry (hold_s, then the pin TTL)
    pull(keys, requester) -> Pulled                 a peer through Ray: copied out, each chunk verified, unpinned
    pin_for_send(keys, requester) / unpin_sent      a peer through the DataServer (the reader verifies)
    report_corrupt(keys) -> int                     a reader found bad bytes: re-verify, drop the bad copies
    locate(keys) -> [[tier, file, offset]...]       where each copy lies (diagnostics; tests that damage one)

It owns the pin table, the per-reader accounting (bytes served by reader, hits by prompt group, peer reads for
`LastCopies`), the chunks hit on the CPU tier waiting for promotion, and the chunks a pull-through brought that
its readers have not pinned yet. All of it under the node's lock, as the cascade.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from kvmesh.cascade import Cascade
from kvmesh.config import KVMeshConfig
from kvmesh.handle import Pinned, Pulled
from kvmesh.lastcopy import LastCopies
from kvmesh.replication import Replicas
from kvmesh.tiers import checksum
from kvmesh.wire import MAX_DEADLINE_MS, PinnedChunk

log = logging.getLogger("kvmesh.node")
MAX_HOLD_S = MAX_DEADLINE_MS / 1000  # the longest a reader may ask a pin to be held beyond the pin TTL
PIN_WAIT_S = 1.0  # a pin waits at most this long for chunks it cannot bring into the slab this moment


@dataclass(slots=True)
class Taken:
    """The leading run `take` pinned: GPU-tier (slot, device sum) first, then slab slots with their records'
    (nbytes, checksum, devsum) as they were when pinned."""

    gpu: list[tuple[int, int]]
    slots: list[int]
    rows: list[tuple[int, int, int | None]]


class Serving:
    def __init__(
        self,
        cascade: Cascade,
        lock,
        counts: Counter,
        node_id: str,
        config: KVMeshConfig,
        last_copies: LastCopies,
        replicas: Replicas,
        post_changes: Callable[[], int],
        event: Callable[..., None],
        stop: threading.Event,
    ) -> None:
        """`lock`: the node's (guards the cascade, `counts` and this part's tables); `post_changes` (under it): the
        cascade's changes to the registrar; `event(kind, reason, detail)`: the live page's events."""
        self.cascade, self.tier, self.lock, self.counts, self.node_id = cascade, cascade.cpu, lock, counts, node_id
        self.pin_ttl_s, self.promote_on_hit = config.pin_ttl_s, config.promote_on_hit
        self.last_copies, self.replicas = last_copies, replicas
        self._post_changes, self._event, self._stop = post_changes, event, stop
        self.gpu_readable = False  # the GPU tier's pools are exported to same-node readers (CUDA IPC)
        self.slab_path = cascade.cpu.path
        # pin id -> (slab slots, GPU-tier slots, monotonic deadline)
        self._pins: dict[int, tuple[list[int], list[int], float]] = {}
        # from a random start: an unpin a client meant for this node's previous process (Ray restarted it under the
        # same handle) must not release a pin of this one
        self._pin_ids = itertools.count(secrets.randbits(48) + 1)
        self._pulling: Counter[bytes] = Counter()  # keys -> pull-throughs between their start and their pin
        self._promote: list[bytes] = []  # keys hit on the CPU tier, promoted by the maintenance thread
        self.served: Counter[str] = Counter()  # bytes served, by requesting node id
        self.served_at: dict[str, float] = {}  # when each was last served (monotonic)
        self.group_hits: Counter[bytes] = Counter()  # chunk hits by prompt group (first-chunk hash)

    # -- the one serving path ------------------------------------------------------------------------------------
    def take(self, keys: list[bytes], requester: str, gpu: bool = False, peer: bool = False) -> Taken:
        """Pin the leading run of `keys` held here for `requester` and account it, counted once: a same-node
        reader's as pins, a peer's (`peer`) as pulls. `gpu`: the reader maps this node's GPU pools: the leading
        keys held in the GPU tier are pinned there, the rest in the slab."""
        on_gpu = self._pin_gpu(keys) if gpu else []
        slots = self._pin_host(keys[len(on_gpu) :]) if len(on_gpu) < len(keys) else []
        with self.lock:
            self._account(requester, slots)
            recs = [self.tier.record(s) for s in slots]
            rows = [(r.nbytes, r.checksum, r.devsum) for r in recs]
            if peer:
                self.counts["pulls"] += 1
                self.counts["pulled_chunks"] += len(slots)
                self.counts["pulled_bytes"] += sum(r[0] for r in rows)
            else:
                self.counts["pins"] += 1
                self.counts["pinned_chunks"] += len(slots) + len(on_gpu)
                self.counts["pinned_gpu_chunks"] += len(on_gpu)
        return Taken(on_gpu, slots, rows)

    def pin(self, keys: list[bytes], requester: str = "", gpu: bool = False, hold_s: float = 0.0) -> Pinned:
        """`hold_s`: how long the reader may still read the slots (what is left of its fetch's deadline: a device
        sink reads adopted slots until its fetch ends): the pin lapses `pin_ttl_s` after that, never while it may
        be read."""
        t = self.take(keys, requester or self.node_id, gpu)
        with self.lock:
            pin_id = next(self._pin_ids)
            if t.slots or t.gpu:
                expires = time.monotonic() + min(max(0.0, hold_s), MAX_HOLD_S) + self.pin_ttl_s
                self._pins[pin_id] = (t.slots, [s for s, _ in t.gpu], expires)
        rows = [PinnedChunk(s, n, c, d) for s, (n, c, d) in zip(t.slots, t.rows)]
        gpu_rows = []
        if t.gpu:
            gpu_tier = self.cascade.gpu
            assert gpu_tier is not None  # (they were pinned in it)
            gpu_rows = [PinnedChunk(s, gpu_tier.record(s).nbytes, c) for s, c in t.gpu]
        return Pinned(pin_id, rows, self.slab_path, gpu_rows)

    def pull(self, keys: list[bytes], requester: str = "") -> Pulled:
        t = self.take(keys, requester or "?", peer=True)
        out = np.empty(sum(n for n, _, _ in t.rows), dtype=np.uint8)
        rows, bad, off = [], [], 0
        try:
            for s, (n, c0, _) in zip(t.slots, t.rows):
                dst = out[off : off + n]
                np.copyto(dst, np.frombuffer(self.tier.chunk_view(s), dtype=np.uint8))
                c = checksum(dst)
                if c != c0:
                    bad.append(s)
                    break
                rows.append((n, c))
                off += n
        finally:
            with self.lock:
                bad_keys = [k for s in bad if (k := self.tier.record(s).key) is not None]  # (pinned: held)
                self.tier.unpin(t.slots)
        self.drop_corrupt(bad_keys)
        return Pulled(rows, out[:off])

    def pin_for_send(
        self, keys: list[bytes], requester: str = ""
    ) -> tuple[list[int], list[tuple[int, int]], list[memoryview]]:
        """For the DataServer: pin the leading run of `keys`; the client verifies the checksums it receives."""
        t = self.take(keys, requester or "?", peer=True)
        return t.slots, [(n, c) for n, c, _ in t.rows], [self.tier.chunk_view(s) for s in t.slots]

    def unpin_sent(self, slots: list[int]) -> None:
        with self.lock:
            self.tier.unpin(slots)

    def _pin_gpu(self, keys: list[bytes]) -> list[tuple[int, int]]:
        """Pin the leading run of `keys` held in a CUDA GPU tier: (slot, device checksum) each."""
        gpu = self.cascade.gpu
        if gpu is None or not self.gpu_readable:
            return []
        with self.lock:
            slots = gpu.pin(keys)  # (and touches them in the GPU tier's LRU)
        return [(s, gpu.device_sum(s)) for s in slots]  # (the sum of a chunk placed moments ago may still be queued)

    def _pin_host(self, keys: list[bytes]) -> list[int]:
        """Pin the leading run of `keys` in the CPU slab: GPU-only chunks are copied into it, disk-only ones
        read into it (without the lock held). Call without the lock. A chunk this node holds but cannot bring in
        this moment (another reader's read of it in flight; every slot pinned by other readers) is waited for,
        up to PIN_WAIT_S: readers of the same prompt, or more windowed fetches than the slab holds at once, would
        otherwise cut each other short."""
        slots = self._pin_host_once(keys)
        until = time.monotonic() + PIN_WAIT_S
        while len(slots) < len(keys) and time.monotonic() < until and not self._stop.is_set():
            with self.lock:
                if not self.cascade.holds(keys[len(slots)]):
                    break  # (not here at all: the run ends)
            time.sleep(0.002)
            slots += self._pin_host_once(keys[len(slots) :])
        return slots

    def _pin_host_once(self, keys: list[bytes]) -> list[int]:
        with self.lock:
            n, reads = self.cascade.prepare_host(keys)
        ok = self.cascade.run_reads(reads) if reads else []
        with self.lock:
            corrupt = self.cascade.discard_corrupt()
            self.counts["corrupt_dropped"] += corrupt
            slots = self.cascade.finish_host(keys, n, reads, ok)
            if self.cascade.gpu is not None and self.promote_on_hit:
                self._promote.extend(keys[: len(slots)])
            if reads or corrupt:
                self._post_changes()
        if corrupt:  # (the reader's fetch ends there as "not_held": this node no longer holds it)
            log.warning("KVNode %s dropped %d corrupt chunk(s) of its own tiers", self.node_id[:8], corrupt)
            self._event("corrupt_chunk", "checksum", f"{corrupt} chunk(s) dropped")
        return slots

    def _account(self, requester: str, slots: list[int]) -> None:
        """Caller holds the lock: traffic by requesting node, and hits by prompt group (most reused prefixes)."""
        if not slots:
            return
        nbytes = 0
        for s in slots:
            rec = self.tier.record(s)
            nbytes += rec.nbytes
            self.group_hits[rec.group] += 1
            if requester != self.node_id and rec.key is not None:
                self.last_copies.read_by_peer(rec.key)
        self.served[requester] += nbytes
        self.served_at[requester] = time.monotonic()
        if len(self.group_hits) > 4096:  # keep the top ones only
            self.group_hits = Counter(dict(self.group_hits.most_common(1024)))

    def forget_readers(self, live: dict | set, idle_before: float) -> None:
        """Bytes served to readers that are no longer in the node table (`live`), and were not served since
        `idle_before`, go (a node id gone for good, e.g. a replaced machine, would otherwise stay one more entry of
        every stats snapshot and one more metric series, for this node's life). An empty table forgets nobody."""
        if not live:
            return
        with self.lock:
            for reader in [r for r in self.served if r not in live and self.served_at.get(r, 0.0) < idle_before]:
                del self.served[reader]
                self.served_at.pop(reader, None)

    def locate(self, keys: list[bytes]) -> list[list]:
        """Per key, [tier name, file, byte offset] of each copy held in the CPU slab or on disk (diagnostics, and
        the tests that damage a chunk where it lies)."""
        out = []
        with self.lock:
            for key in keys:
                where = []
                slot = self.tier.slot_of(key)
                if slot is not None:
                    where.append(["cpu", self.tier.path, slot * self.tier.slot_bytes])
                disk = self.cascade.disk
                if disk is not None and (dslot := disk.slot_of(key)) is not None:
                    where.append(["disk", disk.path, disk.data_offset(dslot)])
                out.append(where)
        return out

    # -- the pin table -------------------------------------------------------------------------------------------
    def unpin(self, pin_id: int) -> None:
        with self.lock:
            entry = self._pins.pop(pin_id, None)
            if entry is not None:
                self._release_pin(entry)

    def expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            for pin_id in [p for p, (_, _, deadline) in self._pins.items() if deadline < now]:
                self._release_pin(self._pins.pop(pin_id))
                self.counts["pins_expired"] += 1

    def pinned_chunks(self) -> int:
        """Caller holds the lock: chunks the pin table holds now."""
        return sum(len(s) + len(g) for s, g, _ in self._pins.values())

    def _release_pin(self, entry) -> None:
        slots, gpu_slots, _deadline = entry
        keys = [self.tier.record(s).key for s in slots]
        self.tier.unpin(slots)
        if gpu_slots:
            assert self.cascade.gpu is not None  # (they were pinned in it)
            keys += [self.cascade.gpu.record(s).key for s in gpu_slots]
            self.cascade.gpu.unpin(gpu_slots)
        if self.replicas.transient_chunks:
            self.drop_transient(keys)

    # -- pull-throughs, promotions, corruption -------------------------------------------------------------------
    @contextmanager
    def pulling(self, keys: list[bytes]) -> Iterator[None]:
        """Around a pull-through and its reader's pin: from its transfer, or another reader's, to its pin, what one
        reader's unpin must not drop under another (readers waiting on a shared transfer got none). After it, the
        chunks pulled only for readers that none of them pinned (evicted meanwhile) go."""
        with self.lock:
            self._pulling.update(keys)
        try:
            yield
        finally:
            with self.lock:
                self._pulling.subtract(keys)
                for key in keys:
                    if self._pulling[key] <= 0:
                        del self._pulling[key]
                self.drop_transient(keys)

    def drop_transient(self, keys) -> None:
        """Caller holds the lock: forget the transient chunks among `keys` that no reader pins any more (a pinned
        one goes at its last unpin). Never registered, so the directory hears nothing."""
        self.counts["transient_dropped"] += self.replicas.drop_unpinned(
            [k for k in keys if k not in self._pulling], self.cascade
        )

    def run_promotions(self) -> None:
        with self.lock:
            keys, self._promote = self._promote, []
            if keys:
                self.cascade.promote(list(dict.fromkeys(keys)))
                self._post_changes()

    def report_corrupt(self, keys: list[bytes]) -> int:
        """A reader found other bytes than a chunk's checksum says: each copy of `keys` held in memory (GPU tier,
        CPU slab) is checked here, and a chunk with a bad copy is dropped from every tier and the directory.
        (Disk copies are checked on every read.) Returns how many were dropped."""
        bad: set[bytes | None] = set()
        for tier in (self.cascade.gpu, self.tier):
            if tier is None:
                continue
            with self.lock:
                slots = [s for k in keys for s in tier.pin([k])]
            try:  # (a slot still being written is not judged)
                bad.update(tier.record(s).key for s in slots if tier.record(s).ready and not tier.verify(s))
            finally:
                with self.lock:
                    tier.unpin(slots)
        bad_keys = [k for k in keys if k in bad]  # (a pinned slot holds a chunk)
        self.drop_corrupt(bad_keys)
        return len(bad_keys)

    def drop_corrupt(self, keys: list[bytes]) -> None:
        """Forget corrupt chunks: out of every tier and out of the directory."""
        if not keys:
            return
        with self.lock:
            for key in keys:
                self.cascade.discard(key)
                self.last_copies.forget(key)  # (dropped: neither saved on disk nor handed off)
            self.counts["corrupt_dropped"] += len(keys)
            self._post_changes()
        log.warning("KVNode %s dropped %d corrupt chunk(s)", self.node_id[:8], len(keys))
        self._event("corrupt_chunk", "checksum", f"{len(keys)} chunk(s) dropped")
