"""Membership and leases: the node keys (`P:{n}:*`, one Redis Cluster slot), their scripts, and what a reader
keeps of the node table between reads.

    join(node_id, info, lease_ms) -> Lease           mutates: new incarnation, epoch created if missing
    heartbeat(lease, lease_ms[, info]) -> "ok"|"resync"|"fenced"   mutates: extends the lease when "ok"
    leave(lease)                                     mutates: removes the node if still this incarnation
    expire(node_id, inc)                             mutates: ends a lease now (Ray reported the node dead)
    node_table() -> NodeTable                        read, one round trip: the whole table only when the
                                                     membership version moved since this reader's last read;
                                                     else the version and the leases that lapse within
                                                     `table_horizon_ms` (O(log n) and a few bytes at any size)
    claim(name, holder, ttl_ms)                      mutates: a short lease on a named job

A restarted node gets a new incarnation. A Redis that lost its data loses its epoch too: nodes see that on their
next heartbeat and re-join (new incarnation) and re-register.
"""

from __future__ import annotations

import logging
import os
import threading

import redis

from kvmesh.directory.records import LISTPACK_MAX_ENTRIES, Keys, Lease, NodeTable, pairs
from kvmesh.directory.scripts import EXPIRE, HEARTBEAT, JOIN, LEAVE, NODE_TABLE, no_writes
from kvmesh.redisconn import primaries_config, primaries_info
from kvmesh.wire import NodeInfo, WireError

log = logging.getLogger("kvmesh.directory")


class Membership:
    def __init__(self, client, keys: Keys) -> None:
        self._redis, self.keys = client, keys
        # node_table's rows as of membership version `_table_ver` of epoch `_table_epoch`: node id -> (inc, info)
        self._table_lock = threading.Lock()
        self._table_ver, self._table_epoch = b"", b""
        self._rows: dict[bytes, tuple[int, bytes | None]] = {}
        self._unreadable_seen: set[tuple[bytes, int]] = set()  # (node, incarnation) records logged as unreadable
        # node_table: leases further off than this are read only on a membership change; it must exceed how long a
        # reader goes between reads (horizon_for)
        self.table_horizon_ms = 3000
        self.join_script = client.register_script(JOIN)
        self.heartbeat_script = client.register_script(HEARTBEAT)
        self.leave_script = client.register_script(LEAVE)
        self.expire_script = client.register_script(EXPIRE)
        # a script is a write unless flagged (Redis >= 7): unflagged, the table read would wait out a write pause
        # (CLIENT PAUSE WRITE, and every FAILOVER) and the readers' breakers open, though it only reads
        # (sent whole with EVAL, not by its SHA: loading a script is a write, refused during the pause too, and a
        # server that just took over has none loaded). Called as table_script(keys=, args=); a test may wrap it.
        if self.server_major() >= 7:
            table = no_writes(NODE_TABLE)
            self.table_script = lambda keys, args: client.eval(table, len(keys), *keys, *args)
        else:
            self.table_script = client.register_script(NODE_TABLE)

    def join(self, info: NodeInfo, lease_ms: int, last_incarnation: int = 0) -> Lease:
        k = self.keys
        epoch, inc, prev = self.join_script(
            keys=[k.epoch, k.counter, k.inc, k.deadline, k.info, k.ver, k.clock],
            args=[info.node_id, os.urandom(8).hex(), lease_ms, info.pack(), last_incarnation, os.urandom(8).hex()],
        )
        return Lease(info.node_id, int(inc), epoch, int(prev))

    def heartbeat(self, lease: Lease, lease_ms: int, info: NodeInfo | None = None) -> str:
        """ "ok", "resync" (the directory lost this incarnation: join again) or "fenced" (another process of the
        node joined since). `info`: this process's record, which tells a newer incarnation of its own (a join
        whose reply was lost) from another process's."""
        k = self.keys
        r = self.heartbeat_script(
            keys=[k.epoch, k.inc, k.deadline, k.clock, k.info],
            args=[lease.node_id, lease.incarnation, lease.epoch, lease_ms, info.pack() if info is not None else b""],
        )
        return r.decode() if isinstance(r, bytes) else str(r)

    def leave(self, lease: Lease) -> bool:
        k = self.keys
        return bool(
            self.leave_script(
                # (and its published stats: a node id gone for good must not stay on the live page, nor be one
                # more field of a hash every reader of it reads whole, for the cluster's life)
                keys=[k.inc, k.deadline, k.info, k.ver, k.stats],
                args=[lease.node_id, lease.incarnation, os.urandom(8).hex()],
            )
        )

    def expire(self, node_id: str, incarnation: int) -> bool:
        """End the lease of `node_id`'s `incarnation` now (Ray reported the node dead); False if it is not current."""
        return bool(self.expire_script(keys=[self.keys.inc, self.keys.deadline], args=[node_id, incarnation]))

    def forget(self, node_id: str, incarnation: int) -> bool:
        """Remove a dead node's row from the node table once its entries are purged (if it is still that one)."""
        return self.leave(Lease(node_id, incarnation, b""))

    def holder_of(self, incarnation: int) -> str | None:
        """The node whose current incarnation `incarnation` is (its row may have lapsed), or None. A Redis that
        restarted empty can hand a number out again: a purge of a node's earlier incarnation must not hit another
        node's current one."""
        for node, inc in self._redis.hgetall(self.keys.inc).items():
            if int(inc) == incarnation:
                return node.decode()
        return None

    def claim(self, name: str, holder: str, ttl_ms: int) -> bool:
        """A short lease on a named job (the janitor's round, one incarnation's purge): True if `holder` has it."""
        key = self.keys.claim(name)
        if self._redis.set(key, holder, nx=True, px=ttl_ms):
            return True
        if self._redis.get(key) == holder.encode():
            self._redis.pexpire(key, ttl_ms)
            return True
        return False

    def node_table(self) -> NodeTable:
        """The live nodes, one round trip. The rows (incarnations and infos) come again only when the membership
        version moved since this reader last read them; the leases, only those that lapse within
        `table_horizon_ms` (a reader refreshes well within it): every other live node's deadline reads as the
        horizon, a bound below its real one, so liveness is judged as before while a healthy cluster's refresh costs
        a few bytes instead of every node's row (docs/scale.md: 1,000 nodes x 9 clients)."""
        with self._table_lock:
            ver, epoch, rows = self._table_ver, self._table_epoch, self._rows
        k = self.keys
        sec, usec, epoch_now, ver_now, incs, leases, infos, whole = self.table_script(
            keys=[k.epoch, k.inc, k.deadline, k.info, k.ver], args=[ver, epoch, self.table_horizon_ms]
        )
        now_ms = int(sec) * 1000 + int(usec) // 1000
        deadlines = {node: int(float(ms)) for node, ms in pairs(leases).items()}
        if whole:
            infos = pairs(infos)
            rows = {node: (int(inc), infos.get(node)) for node, inc in pairs(incs).items()}
            with self._table_lock:
                self._table_ver, self._table_epoch, self._rows = ver_now, epoch_now, rows
        else:
            horizon = now_ms + self.table_horizon_ms
            deadlines = {node: deadlines.get(node, horizon) for node in rows}
        live, dead, until, unreadable = {}, {}, {}, {}
        for node, (inc, raw) in rows.items():
            deadline = deadlines.get(node, 0)
            if deadline <= now_ms or not raw:
                dead[node.decode()] = inc
                continue
            try:
                info = NodeInfo.unpack(raw, incarnation=inc)
            except WireError as e:  # one node of another release must not take every reader's table down
                unreadable[node.decode()] = inc
                if (node, inc) not in self._unreadable_seen:
                    if len(self._unreadable_seen) >= 1024:  # (said once per record; a long upgrade says it again)
                        self._unreadable_seen.clear()
                    self._unreadable_seen.add((node, inc))
                    log.warning("kvmesh: node %s's record is unreadable here (%s): its chunks are not read", node, e)
                continue
            live[info.incarnation] = info
            until[info.incarnation] = deadline
        return NodeTable(epoch_now or None, now_ms, live, tuple(dead), until, dead, unreadable=unreadable or None)

    def table_version(self) -> tuple[bytes, bytes]:
        """(membership version, epoch) of the rows this reader keeps: what its next `node_table` sends."""
        with self._table_lock:
            return self._table_ver, self._table_epoch

    def forget_table(self) -> None:
        """Drop the rows kept: the next `node_table` reads the whole table (benchmarks: a whole read's cost)."""
        with self._table_lock:
            self._table_ver, self._table_epoch, self._rows = b"", b"", {}

    # -- the server ---------------------------------------------------------------------------------------------
    def server_major(self) -> int:
        """The directory server's major Redis version (Valkey 8 says 7, its compatibility level); 0 if unknown."""
        try:
            info = (primaries_info(self._redis) or [{}])[0]
            return int(str(info.get("redis_version", "0")).split(".")[0])
        except (redis.RedisError, ValueError):
            return 0

    def server_identity(self) -> str:
        """Which Redis server process (each master's, in Redis Cluster) holds the directory now: its run id. It
        changes when a server restarts (even with its data on disk) or a replica takes over, and what such a
        server has may lag what nodes registered: they re-join and re-register (`KVNode` compares it every
        heartbeat). The epoch catches only a Redis that came back empty."""
        return ",".join(sorted(str(i["run_id"]) for i in primaries_info(self._redis)))

    def encoding_advice(self) -> str | None:
        """A warning when the directory's server keeps groups of more than LISTPACK_MAX_ENTRIES chunks as listpacks,
        where every field an HMGET asks for is found by a linear search. None when the setting is at most that, or
        cannot be read (a managed Redis without CONFIG, an ACL user without it)."""
        try:
            configs = primaries_config(self._redis, "hash-max-*-entries")
        except redis.RedisError:
            return None
        worst = 0
        for c in configs:
            for name in ("hash-max-listpack-entries", "hash-max-ziplist-entries"):
                try:
                    worst = max(worst, int(c.get(name, 0)))
                except (TypeError, ValueError):
                    pass
        if worst <= LISTPACK_MAX_ENTRIES:
            return None
        return (
            f"kvmesh: the directory's Redis keeps hashes of up to {worst} fields as listpacks "
            f"(hash-max-listpack-entries), searched field by field: the lookups and store checks of a group that "
            f"large cost the server time that grows with the square of its size. Start it with "
            f"--hash-max-ziplist-entries {LISTPACK_MAX_ENTRIES}, Redis's default (or CONFIG SET "
            f"hash-max-listpack-entries {LISTPACK_MAX_ENTRIES}: a larger group then turns into a hash table at its "
            f"next registration)"
        )

    def check_integrity(self) -> None:
        """Every node with an incarnation has a deadline and a readable info record naming it."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.inc).zrange(self.keys.deadline, 0, -1, withscores=True).hgetall(self.keys.info)
        incs, leases, infos = pipe.execute()
        deadlines = dict(leases)
        for node, inc in incs.items():
            assert node in deadlines, f"node {node!r} has no lease deadline"
            assert node in infos, f"node {node!r} has no info"
            try:
                info = NodeInfo.unpack(infos[node], int(inc))
            except WireError:  # a record of another release: this one cannot check it (node_table skips it)
                continue
            assert info.node_id == node.decode(), f"node {node!r} info mismatch"
