"""`Registrar`: the single writer of one KVNode's directory state, its lease and its chunk entries.

    post(changes) -> seq       mutates (no I/O): queue the cascade's changes, {(group, key): best tier or None};
                               call it under the node's lock, so changes are queued in the order they were made.
                               Newer changes to a chunk replace older ones still queued
    wait(seq, timeout) -> bool reads: until every change posted up to `seq` was sent (False: not yet, e.g. Redis
                               is away; they stay queued and are sent when it answers). Not at all while the last
                               round failed to reach Redis: a store waiting on it would hold one of the node's
                               request threads (pins queue behind them) for nothing
    flush(timeout) -> bool     reads: until nothing is queued or being sent
    lease, fenced              reads: the incarnation this node registers under; whether a newer one exists
    shutdown(held)             mutates: unregisters `held`, leaves the directory, stops the thread

One thread, `kvmesh-node-registrar`, does every directory write of this node: entries, heartbeats, re-joins and
re-registrations. So a `register` that was posted before an `unregister` of the same chunk reaches Redis before
it, by construction; no entry is left behind by two threads racing to Redis (the phantom-entry race of writers
that drained changes under a lock and sent them outside it).

Each round: heartbeat when due ("resync" after an emptied, restarted or failed-over Redis: re-join under a new
incarnation and register everything held; "fenced": a newer incarnation exists, stop); then send what is queued.
A batch that fails is put back under anything newer and sent again next round.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import redis

from kvmesh.directory import Directory, Lease
from kvmesh.wire import NodeInfo

log = logging.getLogger("kvmesh.node")
RETRY_S = 0.2  # after a failed send, the next try comes this much later (or at the next heartbeat)
MAX_QUEUED = 1 << 17  # changes queued while Redis is away, at most: beyond, the queue goes and the node re-joins


class Registrar:
    def __init__(
        self,
        directory: Directory,
        info: NodeInfo,
        lease_ms: int,
        heartbeat_s: float,
        node_lock: threading.Lock,
        held: Callable[[], list],
        holds_group: Callable[[bytes], bool],
        count: Callable[..., None],
        event: Callable[..., None],
        on_rejoin: Callable[[list[int]], None],
    ) -> None:
        """`held()` (called under `node_lock`): every chunk held, as (group, key, best tier); `holds_group(g)`
        (under the lock): whether the node still holds a chunk of group g; `on_rejoin(incs)`: incarnations this
        node had before a re-join, whose entries the janitor purges."""
        self.directory = directory
        self.info = info
        self.lease_ms = lease_ms
        self.heartbeat_s = heartbeat_s
        self._node_lock = node_lock
        self._held, self._holds_group = held, holds_group
        self._count, self._event, self._on_rejoin = count, event, on_rejoin
        self.lease: Lease = directory.join(info, lease_ms)
        self._server = directory.server_identity()  # the Redis server(s) this incarnation registered with
        self.fenced = False
        self._cv = threading.Condition()
        self._queued: dict = {}  # (group, key) -> tier | None, guarded by _cv
        # (group, key) -> tier of chunks whose entries listed MAX_HOLDERS others: sent again every heartbeat until
        # one of those leaves (guarded by _cv)
        self._refused: dict = {}
        self._posted = 0  # sequence number of the last post
        self._sent = 0  # every post up to this one has been sent
        self._sending = False
        self._reregister = False  # everything held must be registered afresh (after a re-join, or a failed one)
        self._rejoin_due = False  # the queue overflowed: re-join first (its unregisters are lost with it)
        self._overflows = 0  # how often (a batch in flight across one is not put back: the re-join covers it)
        self._next_heartbeat = time.monotonic() + heartbeat_s
        self._retry_at = 0.0
        self._failing = False  # the last round failed to reach Redis (cleared by the next round that does)
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvmesh-node-registrar", daemon=True)
        self._thread.start()

    # -- the writers' side ------------------------------------------------------------------------------------
    def post(self, changes: dict) -> int:
        with self._cv:
            if changes and not self.fenced:  # a fenced node registers nothing any more
                self._queued.update(changes)
                self._posted += 1
                if len(self._queued) > MAX_QUEUED:  # a long outage under churn (mostly unregisters of chunks
                    self._queued.clear()  # stored and evicted meanwhile): re-join under a new incarnation once
                    self._rejoin_due = self._reregister = True  # Redis answers (the janitor purges the old
                    self._overflows += 1  # one's entries through its index) and register what is held then
                self._cv.notify()
            return self._posted

    def wait(self, seq: int, timeout: float) -> bool:
        end = time.monotonic() + timeout
        with self._cv:
            while self._sent < seq and not self._stop and not self._failing:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return self._sent >= seq

    def flush(self, timeout: float = 10.0) -> bool:
        end = time.monotonic() + timeout
        with self._cv:
            while (self._queued or self._sending or self._reregister) and not self.fenced:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.notify()
                self._cv.wait(min(left, 0.05))
            return True

    def heartbeat_now(self) -> None:
        """Heartbeat on the next round instead of when due (e.g. to notice a lost directory at once)."""
        with self._cv:
            self._next_heartbeat = 0.0
            self._cv.notify()

    def unlisted(self) -> set:
        """(group, key) of chunks held but not listed: their entries list MAX_HOLDERS others (tried again every
        heartbeat)."""
        with self._cv:
            return set(self._refused)

    @property
    def pending(self) -> bool:
        with self._cv:
            return bool(self._queued or self._sending or self._reregister)

    # -- the thread ---------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._due():
                    self._cv.wait(min(1.0, max(0.001, self._wake_at() - time.monotonic())))
                if self._stop:
                    return
            try:
                if time.monotonic() >= self._next_heartbeat:
                    self._next_heartbeat = time.monotonic() + self.heartbeat_s
                    self._heartbeat()
                if self._rejoin_due and not self.fenced:
                    self._rejoin()
                    self._count("registrar_queue_overflows")
                if self._reregister:
                    self._register_all()
                self._send()
                self._failing = False
            except redis.RedisError as e:
                with self._cv:
                    self._failing = True
                    self._cv.notify_all()  # (writers waiting for this round stop waiting)
                self._count("directory_errors")
                self._retry_at = time.monotonic() + RETRY_S
                log.debug("KVNode %s: directory write failed (%s); will retry", self.info.node_id[:8], e)
            except Exception as e:  # never let the writer die: a bug here would leave the directory stale forever
                self._retry_at = time.monotonic() + RETRY_S
                log.exception("KVNode %s: registrar round failed: %s", self.info.node_id[:8], e)

    def _due(self) -> bool:
        now = time.monotonic()
        return now >= self._next_heartbeat or (
            (self._queued or self._reregister) and now >= self._retry_at and not self.fenced
        )

    def _wake_at(self) -> float:
        return min(self._next_heartbeat, self._retry_at) if (self._queued or self._reregister) else self._next_heartbeat

    def _heartbeat(self) -> None:
        if self.fenced:
            return
        d = self.directory
        state = d.heartbeat(self.lease, self.lease_ms, self.info)
        if state == "ok" and d.server_identity() != self._server:
            state = "resync"  # a restarted or failed-over Redis: it may lack or keep entries wrongly
            self._count("directory_server_changed")
        if state == "ok" and self._refused:
            with self._cv:  # (a newer change of one of them, queued meanwhile, wins)
                for change, tier in self._refused.items():
                    self._queued.setdefault(change, tier)
                self._refused = {}
        if state == "resync":
            self._rejoin()
        elif state == "fenced":
            with self._cv:
                self.fenced = True
                self._queued.clear()
                self._sent = self._posted
                self._cv.notify_all()
            log.warning(
                "KVNode %s incarnation %d was superseded; no longer registering",
                self.info.node_id[:8],
                self.lease.incarnation,
            )
            # what it registered after its successor purged it would be left for good (no row names it any more,
            # so no janitor will): this writer, the only one, takes it out itself, now that it writes nothing else
            self._count("purged_entries", d.purge(self.lease.incarnation))

    def _rejoin(self) -> None:
        """The directory lost this node (restarted empty, or failed over): re-join under a new incarnation so
        nothing registered before can be mistaken for current, then register everything held."""
        old = self.lease.incarnation
        server = self.directory.server_identity()
        # (a join that raised may still have run: the next heartbeat finds this process's own record under a newer
        # incarnation and asks for a resync again, never a fence; the server is noted only once the join answered)
        self.lease = self.directory.join(self.info, self.lease_ms, old)
        self._server = server
        # What the old incarnation registered in this Redis before the heartbeat noticed (an emptied Redis does
        # not know it as "previous") is dead now; give its memory back too.
        self._on_rejoin([i for i in dict.fromkeys((self.lease.previous, old)) if i and i != self.lease.incarnation])
        self._count("resyncs")
        log.warning(
            "KVNode %s re-joined the directory as incarnation %d", self.info.node_id[:8], self.lease.incarnation
        )
        self._event("resync", "directory_lost", f"incarnation {self.lease.incarnation}")
        with self._cv:
            self._reregister = True
            self._rejoin_due = False  # (a heartbeat's resync re-joined: an overflow's is covered by it)

    def _register_all(self) -> None:
        """Register everything held under the current incarnation. What is queued now is covered by the snapshot
        (taken under the node's lock, where posts happen), so the queue is emptied with it, but for the chunks
        gone: their unregisters stay queued (a round that failed part way, on one server of a Redis Cluster, may
        have registered them before they went; a snapshot taken after never names them)."""
        with self._node_lock:
            chunks = self._held()
            with self._cv:
                self._queued = {change: tier for change, tier in self._queued.items() if tier is None}
                seq = self._posted
        by_tier: dict[int, dict[bytes, list[bytes]]] = defaultdict(lambda: defaultdict(list))
        for group, key, tier in chunks:
            by_tier[tier][group].append(key)
        refused = {}
        for tier, groups in by_tier.items():  # a RedisError leaves _reregister set: the next round redoes it
            for group, keys in self.directory.register_many(self.lease, tier, groups).items():
                refused.update({(group, k): tier for k in keys})
        self._reregister = False
        with self._cv:
            self._refused = refused
        with self._cv:
            self._sent = max(self._sent, seq)
            self._cv.notify_all()

    def _send(self) -> None:
        with self._cv:
            if not self._queued or self.fenced:
                return
            batch, self._queued = self._queued, {}
            seq, overflows = self._posted, self._overflows
            self._sending = True
        try:
            self._write(batch)
        except BaseException:
            with self._cv:  # put it back; changes made meanwhile are newer and win (unless the queue overflowed
                if self._overflows == overflows:  # meanwhile: the re-join registers what is held then, and an
                    for change, tier in batch.items():  # unregister put back would undo a newer register lost
                        self._queued.setdefault(change, tier)  # with the queue)
            raise
        finally:
            with self._cv:
                self._sending = False
                self._cv.notify_all()
        with self._cv:
            self._sent = max(self._sent, seq)
            self._cv.notify_all()

    def _write(self, batch: dict) -> None:
        removed: dict[bytes, list[bytes]] = defaultdict(list)
        by_tier: dict[int, dict[bytes, list[bytes]]] = defaultdict(lambda: defaultdict(list))
        for (group, key), tier in batch.items():
            if tier is None:
                removed[group].append(key)
            else:
                by_tier[tier][group].append(key)
        d = self.directory
        for group, keys in removed.items():
            d.unregister(self.lease, group, keys)
        refused: dict = {}
        for tier, groups in by_tier.items():
            for group, keys in groups.items():
                refused.update({(group, k): tier for k in d.register(self.lease, tier, group, keys)})
        with self._cv:
            for change in batch:
                self._refused.pop(change, None)
            self._refused.update(refused)
        if refused:
            self._count("registrations_refused_full", len(refused))
        if removed:  # groups this node no longer holds anything of leave its purge index
            d.disown(self.lease, list(removed), self._holds_no_chunk_of)

    def _holds_no_chunk_of(self, group: bytes) -> bool:
        with self._node_lock:
            return not self._holds_group(group)

    def check_listed(self, held: dict, groups: set) -> None:
        """That the directory lists exactly `held` ((group, field) -> best tier) under this incarnation, and its
        purge index exactly `groups` (raises AssertionError)."""
        d, inc = self.directory, self.lease.incarnation
        listed = d.entries_of(inc)
        unfindable = held.keys() - listed.keys()
        phantom = listed.keys() - held.keys()
        assert not unfindable, f"{len(unfindable)} chunk(s) held but not in the directory"
        assert not phantom, f"{len(phantom)} directory entries for chunks not held"
        moved = [c for c, t in held.items() if listed[c] != t]
        assert not moved, f"{len(moved)} directory entries name the wrong tier"
        indexed = d.redis.smembers(d.own_key(inc))
        assert indexed == groups, (
            f"the purge index lists {len(indexed - groups)} group(s) not held and misses {len(groups - indexed)}"
        )

    def stop(self) -> None:
        """Stop the thread, as a crash would: nothing is unregistered, the directory is not left (the lease lapses,
        the janitors of other nodes purge the entries)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def shutdown(self, held: list) -> None:
        """Unregister `held` ((group, key, tier) of everything still held) and leave; the lease lapses on its own
        if Redis does not answer."""
        self.stop()
        if self.fenced:
            return
        try:
            batch = {(g, k): None for g, k, _t in held}
            with self._cv:
                batch.update({c: None for c in self._queued})
            self._write(batch)
            if self._rejoin_due:  # the queue overflowed: entries of chunks evicted meanwhile may be left, and
                self.directory.purge(self.lease.incarnation)  # only the own index knows them
            else:
                self.directory.drop_own_index(self.lease)  # (every entry is gone; the node still holds the chunks)
            self.directory.leave(self.lease)
        except redis.RedisError:
            pass
