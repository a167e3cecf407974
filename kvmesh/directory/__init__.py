"""The directory: which live node incarnations hold which chunks. Redis holds metadata only, never KV bytes.

Key layout (`P` is the configured key prefix):

    P:{n}:epoch            string   random id of this directory's lifetime; a Redis that restarted empty has none
    P:{n}:counter          string   INCR source of node incarnations, seeded from Redis's clock (ms)
    P:{n}:inc              hash     node_id -> current incarnation
    P:{n}:lease            zset     node_id scored by its lease deadline, ms on Redis's own clock
    P:{n}:info             hash     node_id -> msgpack NodeInfo (wire.py)
    P:{n}:ver              string   the membership version: a new random token at every join and leave (`inc` and
                                    `info` change only then), so a reader whose table has this version reads only
                                    the leases that lapse soon (`node_table`); random, not a count, so that a Redis
                                    restored from a snapshot never hands out a version a reader saw with other rows
    P:{n}:clock            string   the latest reading of Redis's clock (ms, to within a second) the lease scripts
                                    saw: a reading far behind it is a clock step back, and moves every lease back
    P:{n}:claim:<job>      string   short leases on jobs one node should do: the janitor round, one purge
    P:{n}:load             hash     replica id -> msgpack [1, node_id, pending prefill tokens, queue depth]: the
                                    load each serving replica last reported (`report_load`)
    P:{n}:load_at          hash     replica id -> when it reported, ms on Redis's own clock (the leases' clock)
    P:g:{<h1 hex>}         hash     chunk hash, first 6 bytes -> 0x02 then (inc u32 LE, tier u8) per holder
    P:o:<inc>              set      the groups incarnation <inc> has entries in: its purge reads only these (a
                                    group leaves it when the node's last chunk of that group does)
    P:s:{<h1 hex>}         hash     the group's summaries, in a group of at least SUMMARY_MIN entries: `v` -> the
                                    group's version (a new one at every change of an entry: Redis's clock, us), and
                                    per summary the field of the chain hash at a bucket's last position -> the
                                    entry values of that bucket's 64 chunks as they were at `v`, run-length encoded
                                    (`pack_summary`). Every script that changes an entry deletes them all first;
                                    one is written (SUMMARIZE) only at the version its entries were read at

All node keys share the hash tag `{n}`, so the node table is read in one round trip and the scripts that change it
touch one Redis Cluster slot. A prompt's chunks all live in the group of its first chunk's hash h_1 (tag
`{<h1 hex>}`): one lookup is one HMGET on one slot, while prompts with different first chunks spread over slots.
Fields are the first 6 bytes of a chunk hash: within one group (one tenant, one first chunk) a collision is a
2^-48 event per pair of chunks, and even then it only makes a lookup name a holder that, asked by the full hash,
does not have the chunk (the fetch is shorter, never wrong). Values are 1 + 5 bytes per holder. A group of up to
512 entries is a listpack (LISTPACK_MAX_ENTRIES): ~20 bytes per (chunk, holder) entry on Redis 7 with jemalloc,
~50 in the hash table of a larger group (bench/directory.py, P6).

Holder entries name an incarnation, never just a node. An entry is live only while its incarnation is the node's
current one and that node's lease deadline has not passed; readers drop everything else, so entries of dead or
superseded incarnations are never returned. A restarted node gets a new incarnation. A Redis that lost its data
loses its epoch too: nodes see that on their next heartbeat and re-join (new incarnation) and re-register.

Primitives:
    join(node_id, info, lease_ms) -> Lease           mutates: new incarnation, epoch created if missing
    heartbeat(lease, lease_ms[, info]) -> "ok"|"resync"|"fenced"   mutates: extends the lease when "ok"
    leave(lease)                                     mutates: removes the node if still this incarnation
    register(lease, tier, group, hashes) -> refused  mutates: adds/updates this incarnation's entries (not in an
                                                     entry that lists MAX_HOLDERS others: those hashes are returned)
    unregister(lease, group, hashes)                 mutates: removes this incarnation's entries
    expire(node_id, inc)                             mutates: ends a lease now (Ray reported the node dead)
    purge(inc) -> entries dropped                    mutates: every entry of a dead incarnation, via its own index
    entries_of(inc) -> {(group, field): tier}        read: an incarnation's entries, via its own index
    node_table() -> NodeTable                        read, one round trip: the whole table only when the
                                                     membership version moved since this Directory's last read;
                                                     else the version and the leases that lapse within
                                                     `table_horizon_ms` (O(log n) and a few bytes at any size)
    lookup(group, hashes, table) -> (holders, why)    read, one round trip: the longest live prefix (`chained`:
                                                     of a prompt's own chain, from its buckets' summaries where
                                                     they are written; else a second round trip reads every entry
                                                     and this Directory writes the summaries, off the hot path)
    holders(group, hashes, table) -> [holders]       read, one round trip: every chunk's live holders
    lookup_raw(group, hashes) -> list[bytes | None]  read, one round trip
    report_load(replica_id, node_id, pending, depth, keep_ms)   mutates: a replica's load, stamped with Redis's
                                                     clock; drops reports older than keep_ms
    lookup_with_loads(group, hashes, table) -> (holders, why, loads)   read, one round trip (pipelined; in Redis
                                                     Cluster both servers are asked before either answer is read):
                                                     `lookup` and every replica's last load report

The scripts behind the mutating primitives and `node_table` are in `kvmesh.directory.scripts`; the redis-py client
(`connect`), `probe` and `DirectoryUnavailable` are in `kvmesh.redisconn` (re-exported here).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgpack
import numpy as np
import redis

from kvmesh.directory import scripts as dirscripts
from kvmesh.redisconn import DirectoryUnavailable as DirectoryUnavailable  # re-exported: kvmesh.DirectoryUnavailable
from kvmesh.redisconn import connect, primaries_config, primaries_info
from kvmesh.redisconn import probe as probe  # re-exported
from kvmesh.wire import NodeInfo, WireError

log = logging.getLogger("kvmesh.directory")

HOLDERS_VERSION = 2  # the value's first byte
_HOLDER = struct.Struct("<IB")  # incarnation, tier
MAX_HOLDERS = 8  # per chunk; an entry that lists this many takes no other holder until one leaves

LOAD_VERSION = 1  # a load value's first element

# Redis keeps a hash of up to `hash-max-listpack-entries` fields as one listpack: ~20 bytes an entry instead of ~50 in
# a hash table (P6), but searched field by field, so an HMGET of n fields from a group of m entries costs O(n x m).
# kvmesh reads long prompts' groups so as not to pay that: a lookup reads the buckets' summaries (a few fields), and
# where it must read every entry, all of a group no larger than twice the prompt (HGETALL, O(m)). Measured on Redis
# 7.0.15 (`bench/directory.py --only listpack`). kvmesh's servers (the embedded one, Helm's, bare-metal.sh's) set
# Redis's own default, 512, explicitly; `encoding_advice` warns of a server set higher (HMGETs of a prompt's last
# chunks and of a store's check then search listpacks of thousands of entries).
LISTPACK_MAX_ENTRIES = 512

# Summaries (issue 17: a long prompt's lookup in about one GET's time). A summary copies the entries of one bucket
# of a prompt's chain, positions [64 k, 64 k + 64), run-length encoded, as they were at one version of the group;
# it is named by the field of the chain hash at the bucket's last position, which names the whole chain up to
# there. A lookup of a prompt of 512 chunks reads 8 summaries instead of 512 entries.
SUMMARY_BUCKET = 64
SUMMARY_MIN = SUMMARY_BUCKET  # a group with fewer entries has no version and no summaries (its lookups are short)
SUMMARY_VERSION = 1  # a summary's first byte; then (run length u8, value length u8, entry value) per run
MAX_SUMMARIES = 4096  # per group and version
SUMMARY_WRITE_S = 1.0  # a client writes a prompt's summaries at most this often
SUMMARY_SKIP_S = 5.0  # a group whose summaries were cleared within SUMMARY_WRITE_S of being written is read whole


def horizon_for(node_refresh_s: float) -> int:
    """`Directory.table_horizon_ms` for readers that refresh every `node_refresh_s`: a client may judge liveness
    from a table its node relayed up to 2 refreshes ago, a refresh later still."""
    return max(3000, int(4000 * node_refresh_s))


def _pairs(flat: list) -> dict:
    return dict(zip(flat[::2], flat[1::2]))


@dataclass(frozen=True, slots=True)
class Lease:
    node_id: str
    incarnation: int
    epoch: bytes
    previous: int = 0  # the incarnation this node had before joining again (0: none): its entries need a purge


@dataclass(frozen=True, slots=True)
class Holder:
    node_id: str
    incarnation: int
    tier: int


@dataclass(frozen=True, slots=True)
class LoadRecord:
    """What one serving replica last reported of its load (`Directory.report_load`)."""

    replica_id: str
    node_id: str  # the Ray node the replica runs on
    pending_prefill_tokens: int  # prompt tokens queued or being prefilled there
    queue_depth: int  # requests queued or running there
    at_ms: int  # when it was reported, ms on Redis's clock (NodeTable.now_ms is the same clock)
    prefill: tuple[float, ...] | None = None  # the replica's measured prefill model (PrefillModel's fit), if any
    # the namespace of the spec the replica serves (KVSpec.namespace); b"" in an earlier release's report
    namespace: bytes = b""


@dataclass(frozen=True, slots=True)
class NodeTable:
    """The live nodes as Redis saw them at `now_ms` (Redis's clock)."""

    epoch: bytes | None
    now_ms: int
    live: dict[int, NodeInfo]  # incarnation -> info, only for unexpired current incarnations
    dead: tuple[str, ...]  # node ids whose lease has lapsed but which have not left
    deadlines: dict[int, int]  # incarnation -> lease deadline (ms, Redis clock) of the live ones
    dead_incarnations: dict[str, int] | None = None  # node id -> the lapsed incarnation, for the janitor's purge
    read_ms: int = 0  # when it was read from Redis (Redis's clock; 0: at now_ms): a relayed table is older
    # node id -> incarnation of a node whose record this reader cannot read (a later release's format): neither live
    # (its chunks are not read from here) nor dead (never purged from here), and no reason to read the table again
    unreadable: dict[str, int] | None = None

    def by_node(self) -> dict[str, NodeInfo]:
        return {info.node_id: info for info in self.live.values()}

    def newest(self) -> int:
        """The newest incarnation this table knows (incarnations only grow: an entry naming a newer one was written
        by a node that joined after this table was read)."""
        return max([*self.live, *(self.dead_incarnations or {}).values(), *(self.unreadable or {}).values()], default=0)


FIELD_BYTES = 6
_FIELD_HEAD = np.frombuffer(b"$%d\r\n" % FIELD_BYTES, dtype=np.uint8)
_CRLF = np.frombuffer(b"\r\n", dtype=np.uint8)


def fields(hashes: list[bytes]) -> list[bytes]:
    return [h[:FIELD_BYTES] for h in hashes]


def _pack_hmget_fields(key: str, names: list[bytes], version: bool = False) -> bytes:
    """RESP of `HMGET key [v] name...` for FIELD_BYTES-long names (and a group summaries' version field first)."""
    k = key.encode()
    head = b"*%d\r\n$5\r\nHMGET\r\n$%d\r\n%s\r\n" % (len(names) + 2 + version, len(k), k)
    if version:
        head += b"$1\r\nv\r\n"
    if not names:
        return head
    return head + _ARG_HEAD + _ARG_SEP.join(names) + b"\r\n"


_ARG_HEAD = b"$%d\r\n" % FIELD_BYTES
_ARG_SEP = b"\r\n" + _ARG_HEAD


_MULTI, _EXEC = b"*1\r\n$5\r\nMULTI\r\n", b"*1\r\n$4\r\nEXEC\r\n"


def _pack_hgetall(key: str) -> bytes:
    k = key.encode()
    return b"*2\r\n$7\r\nHGETALL\r\n$%d\r\n%s\r\n" % (len(k), k)


def _entries_of_version(v: bytes | None) -> int | None:
    """The number of entries a group had at version `v` (dirscripts.CHANGED_LUA); None if it cannot be told."""
    try:
        return int(v.rsplit(b":", 1)[1]) if v else None
    except (IndexError, ValueError):
        return None


def _runs(values: list[bytes | None]) -> list[tuple[bytes | None, int]]:
    return [(v, sum(1 for _ in run)) for v, run in itertools.groupby(values)]


def pack_summary(values: list[bytes | None]) -> bytes:
    """One bucket's entry values (None: no entry), run-length encoded (SUMMARY_VERSION)."""
    parts = [bytes([SUMMARY_VERSION])]
    for v, run in itertools.groupby(values):
        n = sum(1 for _ in run)
        while n:
            take = min(n, 255)
            parts.append(bytes([take, len(v or b"")]) + (v or b""))
            n -= take
    return b"".join(parts)


def unpack_summary(s: bytes) -> list[bytes | None] | None:
    """A bucket's entry values from its summary; None if it is not one this version reads (or not whole)."""
    if not s or s[0] != SUMMARY_VERSION:
        return None
    out: list[bytes | None] = []
    i, n = 1, len(s)
    while i < n:
        if i + 2 > n:
            return None
        count, size = s[i], s[i + 1]
        i += 2
        if i + size > n:
            return None
        out.extend([s[i : i + size] if size else None] * count)
        i += size
    return out if len(out) == SUMMARY_BUCKET else None


def pack_hmget(key: str, hashes: list[bytes]) -> bytes:
    """RESP encoding of `HMGET key f1 f2 ...` with the fields of 16-byte chunk hashes, built in one numpy pass:
    packing 512 arguments one by one costs as much as the round trip itself."""
    n = len(hashes)
    k = key.encode()
    joined = b"".join(hashes)
    assert len(joined) == 16 * n, "chunk hashes are 16 bytes"
    h = len(_FIELD_HEAD)
    body = np.empty((n, h + FIELD_BYTES + 2), dtype=np.uint8)
    body[:, :h] = _FIELD_HEAD
    body[:, h : h + FIELD_BYTES] = np.frombuffer(joined, dtype=np.uint8).reshape(n, 16)[:, :FIELD_BYTES]
    body[:, h + FIELD_BYTES :] = _CRLF
    return b"*%d\r\n$5\r\nHMGET\r\n$%d\r\n%s\r\n" % (n + 2, len(k), k) + body.tobytes()


class Directory:
    def __init__(self, url: str, prefix: str = "kvmesh", timeout_s: float = 2.0) -> None:
        self.url = url
        self.prefix = prefix
        self._redis = connect(url, timeout_s)
        self.cluster = not isinstance(self._redis, redis.Redis)
        n = f"{prefix}:{{n}}"
        self._k_epoch, self._k_counter = f"{n}:epoch", f"{n}:counter"
        self._k_inc, self._k_deadline, self._k_info = f"{n}:inc", f"{n}:lease", f"{n}:info"
        self._k_stats = f"{n}:stats"  # (telemetry.Records' hash of the nodes' published stats)
        self._k_ver, self._k_clock = f"{n}:ver", f"{n}:clock"
        # node_table's rows as of membership version `_table_ver` of epoch `_table_epoch`: node id -> (inc, info)
        self._table_lock = threading.Lock()
        self._table_ver, self._table_epoch = b"", b""
        self._rows: dict[bytes, tuple[int, bytes | None]] = {}
        self._unreadable_seen: set[tuple[bytes, int]] = set()  # (node, incarnation) records logged as unreadable
        # node_table: leases further off than this are read only on a membership change; it must exceed how long a
        # reader goes between reads (horizon_for)
        self.table_horizon_ms = 3000
        self._join = self._redis.register_script(dirscripts.JOIN)
        self._heartbeat = self._redis.register_script(dirscripts.HEARTBEAT)
        self._leave = self._redis.register_script(dirscripts.LEAVE)
        self._register = self._redis.register_script(dirscripts.REGISTER)
        self._unregister = self._redis.register_script(dirscripts.UNREGISTER)
        # a script is a write unless flagged (Redis >= 7): unflagged, the table read would wait out a write pause
        # (CLIENT PAUSE WRITE, and every FAILOVER) and the readers' breakers open, though it only reads
        # (sent whole with EVAL, not by its SHA: loading a script is a write, refused during the pause too, and a
        # server that just took over has none loaded)
        if self._server_major() >= 7:
            table = dirscripts.no_writes(dirscripts.NODE_TABLE)
            self._node_table = lambda keys, args: self._redis.eval(table, len(keys), *keys, *args)
        else:
            self._node_table = self._redis.register_script(dirscripts.NODE_TABLE)
        self._expire = self._redis.register_script(dirscripts.EXPIRE)
        self._k_load, self._k_load_at = f"{n}:load", f"{n}:load_at"
        self._report_load = self._redis.register_script(dirscripts.REPORT_LOAD)
        self._owned: dict[int, set[bytes]] = {}  # incarnation -> groups already in its own index
        self._own_lock = threading.Lock()
        self._holders_cache: dict[bytes, tuple[tuple[int, int], ...]] = {}
        self._cache_lock = threading.Lock()
        self._local = threading.local()  # per-thread lookup connection: no pool round trip on the hot path
        self._thread_conns: list = []  # (its thread, by weak reference; connection): closed by close()
        self._conns_lock = threading.Lock()
        self.redirects = 0  # Redis Cluster MOVED/ASK answers followed (a resharding)
        self._summarize = self._redis.register_script(dirscripts.SUMMARIZE)
        self._summary_cache: dict[bytes, tuple[list[tuple[bytes | None, int]], bool] | None] = {}
        # (group, and summary key + a prompt's last bucket name) -> (when, version) this Directory last wrote them
        self._summarized: dict[bytes, tuple] = {}
        self._skip_summaries: dict[bytes, float] = {}  # group -> until when its lookups read every entry
        self._summary_q: queue.Queue | None = None  # summaries to write, by a thread of their own
        self._summary_lock = threading.Lock()
        self._summary_pid = 0  # the process whose thread writes them
        self.summary_counts = {"hits": 0, "misses": 0, "written": 0, "refused": 0, "dropped": 0}
        self.summary_write_s = SUMMARY_WRITE_S
        self.summaries_off = False  # (a client whose ACL user may not write them reads every entry, in one trip)
        self._touched: set[bytes] = set()  # groups stored into through this Directory since their last lookup
        self._sizes: dict[bytes, int | None] = {}  # group -> its number of entries, as its version last said

    def group_key(self, group: bytes) -> str:
        return f"{self.prefix}:g:{{{group.hex()}}}"

    def summary_key(self, group: bytes) -> str:
        return f"{self.prefix}:s:{{{group.hex()}}}"

    def group_keys(self, group: bytes) -> list[str]:
        """What a group script is given: the group's entries and its summaries (one slot)."""
        return [self.group_key(group), self.summary_key(group)]

    # -- nodes --------------------------------------------------------------------------------------------------
    def join(self, info: NodeInfo, lease_ms: int, last_incarnation: int = 0) -> Lease:
        epoch, inc, prev = self._join(
            keys=[
                self._k_epoch,
                self._k_counter,
                self._k_inc,
                self._k_deadline,
                self._k_info,
                self._k_ver,
                self._k_clock,
            ],
            args=[info.node_id, os.urandom(8).hex(), lease_ms, info.pack(), last_incarnation, os.urandom(8).hex()],
        )
        return Lease(info.node_id, int(inc), epoch, int(prev))

    def heartbeat(self, lease: Lease, lease_ms: int, info: NodeInfo | None = None) -> str:
        """ "ok", "resync" (the directory lost this incarnation: join again) or "fenced" (another process of the
        node joined since). `info`: this process's record, which tells a newer incarnation of its own (a join
        whose reply was lost) from another process's."""
        r = self._heartbeat(
            keys=[self._k_epoch, self._k_inc, self._k_deadline, self._k_clock, self._k_info],
            args=[lease.node_id, lease.incarnation, lease.epoch, lease_ms, info.pack() if info is not None else b""],
        )
        return r.decode() if isinstance(r, bytes) else str(r)

    def _server_major(self) -> int:
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

    def leave(self, lease: Lease) -> bool:
        return bool(
            self._leave(
                # (and its published stats: a node id gone for good must not stay on the live page, nor be one
                # more field of a hash every reader of it reads whole, for the cluster's life)
                keys=[self._k_inc, self._k_deadline, self._k_info, self._k_ver, self._k_stats],
                args=[lease.node_id, lease.incarnation, os.urandom(8).hex()],
            )
        )

    def node_table(self) -> NodeTable:
        """The live nodes, one round trip. The rows (incarnations and infos) come again only when the membership
        version moved since this Directory last read them; the leases, only those that lapse within
        `table_horizon_ms` (a reader refreshes well within it): every other live node's deadline reads as the
        horizon, a bound below its real one, so liveness is judged as before while a healthy cluster's refresh costs
        a few bytes instead of every node's row (docs/scale.md: 1,000 nodes x 9 clients)."""
        with self._table_lock:
            ver, epoch, rows = self._table_ver, self._table_epoch, self._rows
        sec, usec, epoch_now, ver_now, incs, leases, infos, whole = self._node_table(
            keys=[self._k_epoch, self._k_inc, self._k_deadline, self._k_info, self._k_ver],
            args=[ver, epoch, self.table_horizon_ms],
        )
        now_ms = int(sec) * 1000 + int(usec) // 1000
        deadlines = {node: int(float(ms)) for node, ms in _pairs(leases).items()}
        if whole:
            infos = _pairs(infos)
            rows = {node: (int(inc), infos.get(node)) for node, inc in _pairs(incs).items()}
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

    # -- holders ------------------------------------------------------------------------------------------------
    def own_key(self, incarnation: int) -> str:
        return f"{self.prefix}:o:{incarnation}"

    def _note_owned(self, lease: Lease, groups) -> None:
        """Add groups to the incarnation's own index (the groups it has entries in), once per group: what makes a
        purge cost the node's own entries instead of a keyspace scan."""
        with self._own_lock:
            known = self._owned.setdefault(lease.incarnation, set())
            new = [g for g in groups if g not in known]
            if new:
                self._redis.sadd(self.own_key(lease.incarnation), *new)
                known.update(new)

    def disown(self, lease: Lease, groups, still_empty) -> int:
        """Take groups the incarnation no longer has entries in out of its own index, so that the index (and a
        purge) stays the size of what it holds now. `still_empty(group)` is asked again under the index's lock:
        a register racing with this adds its group back after, never before. Returns how many were taken out."""
        with self._own_lock:
            known = self._owned.get(lease.incarnation, set())
            gone = [g for g in groups if g in known and still_empty(g)]
            if gone:
                self._redis.srem(self.own_key(lease.incarnation), *gone)
                known.difference_update(gone)
        return len(gone)

    def register(self, lease: Lease, tier: int, group: bytes, hashes: list[bytes]) -> list[bytes]:
        """Returns the hashes not registered: their entries list MAX_HOLDERS other holders already (the caller
        tries them again later)."""
        if not hashes:
            return []
        self._note_owned(lease, [group])
        refused = self._register(
            keys=self.group_keys(group), args=[lease.incarnation, tier, MAX_HOLDERS, *fields(hashes), SUMMARY_MIN]
        )
        return [hashes[int(i) - 1] for i in refused or ()]

    def unregister(self, lease: Lease, group: bytes, hashes: list[bytes]) -> None:
        if hashes:
            self._unregister(keys=self.group_keys(group), args=[lease.incarnation, *fields(hashes), SUMMARY_MIN])

    def register_many(self, lease: Lease, tier: int, groups: dict[bytes, list[bytes]]) -> dict[bytes, list[bytes]]:
        """Register several groups in one pipelined round trip per Redis server (used on resync). Returns, by group,
        the hashes not registered (as `register`)."""
        self._note_owned(lease, list(groups))
        out = self._run_scripts(
            dirscripts.REGISTER,
            [
                (self.group_keys(g), [lease.incarnation, tier, MAX_HOLDERS, *fields(hs), SUMMARY_MIN])
                for g, hs in groups.items()
            ],
        )
        return {g: [hs[int(i) - 1] for i in r] for (g, hs), r in zip(groups.items(), out) if r}

    def _run_scripts(self, script: str, calls: list[tuple[list[str], list]]) -> list:
        """`script` once per (keys, args), pipelined: one round trip per server that owns any of the keys (Redis
        Cluster does not pipeline scripts across slots, so each server gets its own pipeline; one call's keys share
        a slot)."""
        if not self.cluster:
            pipe = self._redis.pipeline(transaction=False)
            for keys, args in calls:
                pipe.eval(script, len(keys), *keys, *args)
            return pipe.execute()
        by_server: dict[str, list[int]] = {}
        nodes = {}
        for i, (keys, _) in enumerate(calls):
            node = self._redis.get_node_from_key(keys[0])
            nodes[node.name] = node
            by_server.setdefault(node.name, []).append(i)
        out: list = [None] * len(calls)
        for name, idx in by_server.items():
            pipe = self._redis.get_redis_connection(nodes[name]).pipeline(transaction=False)
            for i in idx:
                pipe.eval(script, len(calls[i][0]), *calls[i][0], *calls[i][1])
            for i, r in zip(idx, pipe.execute(raise_on_error=False)):
                if isinstance(r, Exception) and self._redirected(r):  # (a script runs whole or not at all)
                    keys, args = calls[i]
                    r = self._redis.eval(script, len(keys), *keys, *args)  # follows the redirect
                if isinstance(r, Exception):
                    raise r
                out[i] = r
        return out

    def _redirected(self, e: BaseException) -> bool:
        """Whether `e` is a Redis Cluster redirect: MOVED (the slot has a new owner: the slot map learns it, so
        that the next command goes there) or ASK (the slot is being migrated). The caller asks again through the
        cluster client, which follows redirects. (redis-py's MovedError and AskError do not start with the word.)"""
        if not (self.cluster and isinstance(e, redis.exceptions.AskError)):
            return False
        self.redirects += 1
        if isinstance(e, redis.exceptions.MovedError):
            try:
                self._redis.nodes_manager.move_slot(e)
            except Exception:  # (a redis-py without it, or a redirect without a host): the whole map again
                self._redis.nodes_manager.initialize()
        return True

    # -- liveness and purging ------------------------------------------------------------------------------------
    def expire(self, node_id: str, incarnation: int) -> bool:
        """End the lease of `node_id`'s `incarnation` now (Ray reported the node dead); False if it is not current."""
        return bool(self._expire(keys=[self._k_inc, self._k_deadline], args=[node_id, incarnation]))

    def purge(self, incarnation: int) -> int:
        """Remove every entry of a lapsed or superseded incarnation; returns how many chunk entries were dropped.
        Reads only that incarnation's own index and the groups it names: the cost is the node's own groups, never
        a scan of the keyspace. Readers already ignore such entries; this returns their memory."""
        own = self.own_key(incarnation)
        # and the groups this process registered it in: a Redis that restarted empty lost the index of what was
        # written to it before the node noticed (the node believed those groups indexed already)
        groups = list(set(self._redis.smembers(own)) | self._owned.get(incarnation, set()))
        removed = 0
        for i in range(0, len(groups), 256):
            removed += sum(
                int(n or 0)
                for n in self._run_scripts(
                    dirscripts.PURGE_GROUP,
                    [(self.group_keys(g), [incarnation, SUMMARY_MIN]) for g in groups[i : i + 256]],
                )
            )
        self._redis.delete(own)
        self._owned.pop(incarnation, None)
        return removed

    def holder_of(self, incarnation: int) -> str | None:
        """The node whose current incarnation `incarnation` is (its row may have lapsed), or None. A Redis that
        restarted empty can hand a number out again: a purge of a node's earlier incarnation must not hit another
        node's current one."""
        for node, inc in self._redis.hgetall(self._k_inc).items():
            if int(inc) == incarnation:
                return node.decode()
        return None

    def drop_own_index(self, lease: Lease) -> None:
        """Delete the incarnation's own index of groups (a node that leaves, having unregistered everything)."""
        self._redis.delete(self.own_key(lease.incarnation))
        with self._own_lock:
            self._owned.pop(lease.incarnation, None)

    def entries_of(self, incarnation: int) -> dict[tuple[bytes, bytes], int]:
        """(group, field) -> tier of every entry naming `incarnation`, found through its own index (O(its own
        groups)); for integrity checks."""
        out: dict[tuple[bytes, bytes], int] = {}
        for group in self._redis.smembers(self.own_key(incarnation)):
            for fld, value in self._redis.hgetall(self.group_key(group)).items():
                for inc, tier in self.decode_holders(value):
                    if inc == incarnation:
                        out[(group, fld)] = tier
        return out

    def claim(self, name: str, holder: str, ttl_ms: int) -> bool:
        """A short lease on a named job (the janitor's round, one incarnation's purge): True if `holder` has it."""
        key = f"{self.prefix}:{{n}}:claim:{name}"
        if self._redis.set(key, holder, nx=True, px=ttl_ms):
            return True
        if self._redis.get(key) == holder.encode():
            self._redis.pexpire(key, ttl_ms)
            return True
        return False

    def forget(self, node_id: str, incarnation: int) -> bool:
        """Remove a dead node's row from the node table once its entries are purged (if it is still that one)."""
        return self.leave(Lease(node_id, incarnation, b""))

    def lookup_raw(self, group: bytes, hashes: list[bytes]) -> list[bytes | None]:
        """One HMGET of the group's entries for `hashes`, on this thread's own connection (no pool round trip on
        the hot path)."""
        key = self.group_key(group)
        conn = self._thread_connection(key)
        try:
            conn.send_packed_command([pack_hmget(key, hashes)], check_health=False)
            return conn.read_response()
        except redis.exceptions.ResponseError as e:
            if self._redirected(e):  # a resharding moved the group's slot, or is moving it
                return self._redis.hmget(key, fields(hashes))
            raise
        except BaseException:
            conn.disconnect()  # reconnects on the next command
            raise

    def _thread_connection(self, key: str):
        """This thread's own connection to the server that holds `key` (one per server in Redis Cluster)."""
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        if self.cluster:
            node = self._redis.get_node_from_key(key)
            server, pool = node.name, self._redis.get_redis_connection(node).connection_pool
        else:
            server, pool = "", self._redis.connection_pool
        conn = conns.get(server)
        if conn is None:
            # (made outside the pool's count, which caps what it makes, 100 by default in redis-py, and never
            # lowers it for a connection disconnected: one per short-lived thread would exhaust it)
            conn = conns[server] = pool.connection_class(**pool.connection_kwargs)
            with self._conns_lock:  # the connections of threads that have ended go now: a server that runs each
                kept = []  # request on a thread of its own would otherwise hold one per request, to EMFILE
                for ref, c in self._thread_conns:
                    t = ref()
                    if t is None or not t.is_alive():
                        c.disconnect()
                    else:
                        kept.append((ref, c))
                kept.append((weakref.ref(threading.current_thread()), conn))
                self._thread_conns = kept
        return conn

    def decode_holders(self, value: bytes) -> tuple[tuple[int, int], ...]:
        """(incarnation, tier) pairs of one entry. Entries repeat across a prompt's chunks, so decode once."""
        hit = self._holders_cache.get(value)
        if hit is None:
            if not value or value[0] != HOLDERS_VERSION or (len(value) - 1) % 5:
                hit = ()  # an entry we cannot read is no holder
            else:
                hit = tuple(_HOLDER.iter_unpack(value[1:]))
            with self._cache_lock:
                if len(self._holders_cache) > 4096:
                    self._holders_cache.clear()
                self._holders_cache[value] = hit
        return hit

    def lookup(
        self,
        group: bytes,
        hashes: list[bytes],
        table: NodeTable,
        prefer: str | None = None,
        newer: Callable[[], NodeTable] | None = None,
        chained: bool = False,
    ) -> tuple[list[tuple[Holder, ...]], str | None]:
        """One round trip: the live holders of each leading chunk of `hashes` (registered in `group`) that has one,
        and why the run ends before `hashes` does ("not_cached", "holder_dead"; None if it does not). What the
        client's lookups call. `newer()`: a table read now, asked (once) when an entry names an incarnation newer
        than `table` knows, so a node that joined since `table` was read counts as a holder. `chained`: `hashes`
        is a prompt's chain from its first chunk (`lookup_chained`: its buckets' summaries are read instead)."""
        if chained:
            return self._prefix_of_runs(self._chained_runs(group, hashes), table, prefer, newer)
        return self.longest_prefix_why(self.lookup_raw(group, hashes), table, prefer, newer)

    # -- summaries: a long chained prompt's lookup without reading each chunk's entry --------------------------
    def lookup_chained(self, group: bytes, hashes: list[bytes]) -> list[bytes | None]:
        """The entries of `hashes` (as `lookup_raw` gives them, up to where the cached prefix can no longer go on),
        for a chain: `hashes[i]` is the hash of the prompt's chunk i, from its first chunk on, so that a hash names
        every chunk before it (`hashing.chunk_hashes`). One round trip (one transaction) reads the summaries of the
        prompt's whole buckets, the first chunk's entry and the entries past the last whole bucket. Where a bucket
        the prefix reaches has no summary, a second reads every entry (the lookup of old) with the group's version,
        and the summaries of the buckets read are written later, by a thread of this Directory's, if the group is
        still at that version. What is returned is what the entries said at one version of the group."""
        return [v for v, count in self._chained_runs(group, hashes) for _ in range(count)]

    def _chained_runs(self, group: bytes, hashes: list[bytes]) -> list[tuple[bytes | None, int]]:
        """`lookup_chained`'s entries as runs of one value: (value, how many chunks in a row)."""
        n, b = len(hashes), SUMMARY_BUCKET
        if n < b or self.summaries_off:
            return _runs(self.lookup_raw(group, hashes))
        gkey, skey = self.group_keys(group)
        whole = n // b
        names = [hashes[b * k + b - 1][:FIELD_BYTES] for k in range(whole)]
        now = time.monotonic()
        wrote = self._summarized.get(group)  # (when, at which version) this Directory last wrote some of them
        stored = group in self._touched  # this process stored into the group since: its summaries are gone
        self._touched.discard(group)
        if not stored and self._skip_summaries.get(group, 0.0) <= now:
            head_fields = fields([hashes[0], *hashes[whole * b :]])
            # (in one transaction: the summaries and the entries past them as of one moment, never a mix of two)
            try:
                _, _, _, (sums, head) = self._pipelined(
                    gkey,
                    [
                        _MULTI,
                        _pack_hmget_fields(skey, names, version=True),
                        _pack_hmget_fields(gkey, head_fields),
                        _EXEC,
                    ],
                    lambda: [None, None, None, self._summaries_and_head(skey, names, gkey, head_fields)],
                )
            except redis.exceptions.NoPermissionError as e:  # an ACL user without transactions: as before summaries
                self.summaries_off = True
                log.info("kvmesh: this client may not read the directory's summaries (%s): lookups read every entry", e)
                return _runs(self.lookup_raw(group, hashes))
            if head[0] is None:  # (nothing of it is cached)
                return [(None, 1)]
            runs: list[tuple[bytes | None, int]] = []
            for s in sums[1:]:
                got = self._summary(s)
                if got is None:
                    break
                if runs and runs[-1][0] == got[0][0][0]:  # (a run that goes on across buckets is one run)
                    runs[-1] = (runs[-1][0], runs[-1][1] + got[0][0][1])
                    runs.extend(got[0][1:])
                else:
                    runs.extend(got[0])
                if got[1]:  # the cached prefix ends in this bucket
                    self.summary_counts["hits"] += 1
                    return runs
            else:
                self.summary_counts["hits"] += 1
                return runs + _runs(head[1:])
            self.summary_counts["misses"] += 1
            self._note(self._sizes, group, _entries_of_version(sums[0]))
            if wrote is not None and sums[0] != wrote[1] and now - wrote[0] < self.summary_write_s:
                # (the group changed within a moment of the summaries' writing: it moves too fast for them)
                self._note(self._skip_summaries, group, now + SUMMARY_SKIP_S)
        # every entry: HGETALL of a group that is a listpack (at most LISTPACK_MAX_ENTRIES entries) and at most
        # twice the prompt (O(entries), where an HMGET searches a listpack once per field), else the HMGET of the
        # prompt's fields (a hash table's: less for the client to decode)
        size = self._sizes.get(group)  # (as of the last read of its version)
        whole_group = size is not None and size <= min(2 * n, LISTPACK_MAX_ENTRIES)
        version, got = self._pipelined(
            gkey,
            [
                _pack_hmget_fields(skey, [], version=True),
                _pack_hgetall(gkey) if whole_group else pack_hmget(gkey, hashes),
            ],
            lambda: [
                self._redis.hmget(skey, [b"v"]),
                self._redis.hgetall(gkey) if whole_group else self._redis.hmget(gkey, fields(hashes)),
            ],
        )
        if whole_group:
            entries = got if isinstance(got, dict) else _pairs(got)
            values = [entries.get(f) for f in fields(hashes)]
        else:
            values = got
        v = version[0]
        self._note(self._sizes, group, _entries_of_version(v))
        end = next((i for i, x in enumerate(values) if x is None), n)
        upto = min(whole, end // b + 1)  # the buckets the prefix reaches
        if v is not None and upto:
            # a prompt's summaries at most once per `summary_write_s`, the same version's again only if they did
            # not land (branches of one group each have their own)
            mine = self._summarized.get(skey.encode() + names[upto - 1])
            if mine is None or now - mine[0] >= (self.summary_write_s if mine[1] != v else 30.0):
                self._note(self._summarized, skey.encode() + names[upto - 1], (now, v))
                self._note(self._summarized, group, (now, v))
                self._write_later(skey, v, [(names[k], pack_summary(values[b * k : b * k + b])) for k in range(upto)])
        return _runs(values)

    def touched(self, group: bytes) -> None:
        """A store into `group` is on its way (its registration clears the group's summaries): the next lookup of
        the group reads its entries at once, without asking for summaries first (a conversation's next turn)."""
        if len(self._touched) > 4096:
            self._touched.clear()
        self._touched.add(group)

    def _summaries_and_head(self, skey: str, names: list[bytes], gkey: str, head_fields: list[bytes]) -> list:
        """The first read of `_chained_runs` through the cluster client (a resharding moved the group's slot)."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.hmget(skey, [b"v", *names]).hmget(gkey, head_fields)
        return pipe.execute()

    def _summary(self, s: bytes | None) -> tuple[list[tuple[bytes | None, int]], bool] | None:
        """A summary's entries as runs, and whether one of them is None (decoded once: prompts are looked up
        again)."""
        if s is None:
            return None
        if s in self._summary_cache:
            hit = self._summary_cache[s]
        else:
            values = unpack_summary(s)
            hit = None if values is None else (_runs(values), None in values)
            with self._cache_lock:
                if len(self._summary_cache) > 4096:
                    self._summary_cache.clear()
                self._summary_cache[s] = hit
        return hit

    @staticmethod
    def _note(d: dict, group: bytes, value) -> None:
        if len(d) > 4096:
            d.clear()
        d[group] = value

    def _pipelined(self, key: str, packed: list[bytes], fallback: Callable[[], list]) -> list:
        """Send packed commands (on `key`'s slot) on this thread's connection, one round trip; their replies."""
        conn = self._thread_connection(key)
        try:
            conn.send_packed_command([b"".join(packed)], check_health=False)  # (one write: one segment, one wake)
            return [conn.read_response() for _ in packed]
        except redis.exceptions.ResponseError as e:
            conn.disconnect()  # answers of the other commands may still be queued on it
            if self._redirected(e):  # a resharding moved the group's slot, or is moving it
                return fallback()
            raise
        except BaseException:
            conn.disconnect()  # reconnects on the next command
            raise

    def _write_later(self, skey: str, version: bytes, todo: list[tuple[bytes, bytes]]) -> None:
        with self._summary_lock:
            if self._summary_q is None or self._summary_pid != os.getpid():  # (a forked child has no such thread)
                self._summary_q, self._summary_pid = queue.Queue(maxsize=256), os.getpid()
                threading.Thread(
                    target=self._write_summaries, args=(self._summary_q,), name="kvmesh-summaries", daemon=True
                ).start()
        try:
            self._summary_q.put_nowait((skey, version, todo))
        except queue.Full:
            self.summary_counts["dropped"] += 1

    def _write_summaries(self, q: queue.Queue) -> None:
        while True:
            job = q.get()
            try:
                if job is None:
                    return
                skey, version, todo = job
                args = [version, MAX_SUMMARIES, *itertools.chain.from_iterable(todo)]
                ok = self._summarize(keys=[skey], args=args)
                self.summary_counts["written" if ok else "refused"] += 1
            except redis.exceptions.NoPermissionError as e:  # an ACL user that may only read: never again
                self.summaries_off = True
                log.info(
                    "kvmesh: this client may not write the directory's summaries (%s): long lookups read every entry", e
                )
            except Exception as e:  # a summary not written is a slower lookup, never a wrong one
                log.debug("kvmesh: writing summaries failed: %s", e)
            finally:
                q.task_done()

    def flush_summaries(self) -> None:
        """Wait until the summaries queued so far are written (tests, benchmarks)."""
        if self._summary_q is not None and self._summary_pid == os.getpid():
            self._summary_q.join()

    def holders(
        self,
        group: bytes,
        hashes: list[bytes],
        table: NodeTable,
        prefer: str | None = None,
        newer: Callable[[], NodeTable] | None = None,
    ) -> list[tuple[Holder, ...]]:
        """One round trip: the live holders of every chunk of `hashes` (an empty tuple where none), not only of the
        leading run: what a store checks to skip the chunks already cached. `newer`: as in `lookup`."""
        values = self.lookup_raw(group, hashes)
        if newer is not None and self._names_newer({v for v in values if v}, table.newest()):
            table = newer()
        return [r[0] if (r := self.longest_prefix([v], table, prefer)) else () for v in values]

    def _names_newer(self, values, newest: int) -> bool:
        """Whether an entry among `values` names an incarnation newer than `newest` (one that joined after the
        table was read)."""
        return any(inc > newest for v in values for inc, _ in self.decode_holders(v))

    def longest_prefix(
        self, values: list[bytes | None], table: NodeTable, prefer: str | None = None
    ) -> list[tuple[Holder, ...]]:
        return self.longest_prefix_why(values, table, prefer)[0]

    def longest_prefix_why(
        self,
        values: list[bytes | None],
        table: NodeTable,
        prefer: str | None = None,
        newer: Callable[[], NodeTable] | None = None,
    ) -> tuple[list[tuple[Holder, ...]], str | None]:
        """Holders of each leading chunk that has at least one live holder: the node `prefer` (the caller's own)
        first, then by tier (GPU, CPU, disk). Runs of chunks share one entry value, so each distinct value is
        decoded and filtered once per call."""
        # (C-level grouping: Python work per run, not per chunk)
        return self._prefix_of_runs(((v, len(list(run))) for v, run in itertools.groupby(values)), table, prefer, newer)

    def _prefix_of_runs(
        self,
        runs: Iterable[tuple[bytes | None, int]],
        table: NodeTable,
        prefer: str | None = None,
        newer: Callable[[], NodeTable] | None = None,
    ) -> tuple[list[tuple[Holder, ...]], str | None]:
        """`longest_prefix_why` of entries given as runs (value, how many chunks in a row)."""
        out: list[tuple[Holder, ...]] = []
        memo: dict[bytes, tuple[Holder, ...]] = {}
        why = None  # why it stopped before the end: "not_cached" (no entry) or "holder_dead" (no live holder)
        newest = table.newest() if newer is not None else 0
        for v, count in runs:
            if v is None:
                why = "not_cached"
                break
            row = memo.get(v)
            if row is None:
                if newer is not None and self._names_newer((v,), newest):
                    table, newer = newer(), None  # a node joined since `table` was read
                hs = [
                    Holder(info.node_id, inc, tier)
                    for inc, tier in self.decode_holders(v)
                    if (info := table.live.get(inc)) is not None
                ]
                row = memo[v] = tuple(sorted(hs, key=lambda h: (h.node_id != prefer, h.tier)))
            if not row:
                why = "holder_dead"
                break
            out.extend([row] * count)
        return out, why

    # -- load reports: where serving replicas stand (kvmesh.routing) ----------------------------------------------
    def report_load(
        self,
        replica_id: str,
        node_id: str,
        pending_prefill_tokens: int,
        queue_depth: int,
        keep_ms: int,
        prefill: tuple[float, ...] | None = None,
        namespace: bytes = b"",
    ) -> int:
        """Record a replica's load (and its measured prefill model's coefficients, when it has one, and the
        namespace of the spec it serves), stamped with Redis's clock (returned, ms); reports older than `keep_ms`
        go."""
        value = msgpack.packb(
            [LOAD_VERSION, node_id, int(pending_prefill_tokens), int(queue_depth)]
            + [[float(x) for x in prefill] if prefill is not None else None, bytes(namespace)],
            use_bin_type=True,
        )
        return int(self._report_load(keys=[self._k_load, self._k_load_at], args=[replica_id, value, keep_ms]))

    def lookup_with_loads(
        self,
        group: bytes,
        hashes: list[bytes],
        table: NodeTable,
        prefer: str | None = None,
        newer: Callable[[], NodeTable] | None = None,
        chained: bool = False,
    ) -> tuple[list[tuple[Holder, ...]], str | None, list[LoadRecord]]:
        """`lookup` and every replica's last load report in one round trip: the HMGET and the two HGETALLs go out
        together on this thread's connections (one in plain Redis; in Redis Cluster the group's server and the
        node keys' server are both sent to before either answer is read). `chained` (as `lookup`'s), for a prompt
        of a whole bucket or more: its summaries, then the load reports (a round trip more)."""
        if chained and len(hashes) >= SUMMARY_BUCKET:
            holders, why = self.lookup(group, hashes, table, prefer, newer, chained=True)
            raw, at = self._pipelined(
                self._k_load,
                [_pack_hgetall(self._k_load), _pack_hgetall(self._k_load_at)],
                lambda: [self._redis.hgetall(self._k_load), self._redis.hgetall(self._k_load_at)],
            )
            return holders, why, self._loads(raw, at)
        gkey = self.group_key(group)
        conn_g = self._thread_connection(gkey) if hashes else None
        conn_n = self._thread_connection(self._k_load)
        loads_cmd = conn_n.pack_commands([("HGETALL", self._k_load), ("HGETALL", self._k_load_at)])
        try:
            if conn_g is None or conn_g is conn_n:
                conn_n.send_packed_command(
                    ([pack_hmget(gkey, hashes)] if hashes else []) + loads_cmd, check_health=False
                )
                values = conn_n.read_response() if hashes else []
            else:
                conn_g.send_packed_command([pack_hmget(gkey, hashes)], check_health=False)
                conn_n.send_packed_command(loads_cmd, check_health=False)
                values = conn_g.read_response()
            raw, at = conn_n.read_response(), conn_n.read_response()
        except redis.exceptions.ResponseError as e:
            for c in (conn_g, conn_n):
                if c is not None:
                    c.disconnect()  # answers of the other commands may still be queued on it
            if not self._redirected(e):
                raise
            values = self._redis.hmget(gkey, fields(hashes)) if hashes else []  # (the cluster client follows redirects)
            raw, at = self._redis.hgetall(self._k_load), self._redis.hgetall(self._k_load_at)
        except BaseException:
            for c in (conn_g, conn_n):
                if c is not None:
                    c.disconnect()  # reconnects on the next command
            raise
        holders, why = self.longest_prefix_why(values, table, prefer, newer)
        return holders, why, self._loads(raw, at)

    @staticmethod
    def _loads(raw, at) -> list[LoadRecord]:
        """Load records from the two hashes' HGETALL replies (flat lists in RESP2, maps in RESP3); a value this
        version cannot read is no record."""
        raw = raw if isinstance(raw, dict) else _pairs(raw)
        at = at if isinstance(at, dict) else _pairs(at)
        out = []
        for rid, value in raw.items():
            try:
                fields = msgpack.unpackb(value)
                version, node_id, pending, depth = fields[:4]
                prefill = tuple(float(x) for x in fields[4]) if len(fields) > 4 and fields[4] else None
                namespace = bytes(fields[5]) if len(fields) > 5 and isinstance(fields[5], bytes) else b""
                stamp = int(at[rid])
            except (ValueError, TypeError, KeyError, msgpack.UnpackException):
                continue
            if version == LOAD_VERSION:
                out.append(
                    LoadRecord(
                        rid.decode(errors="replace"), str(node_id), int(pending), int(depth), stamp, prefill, namespace
                    )
                )
        return out

    # -- spec registry: which specs of a model exist, so a miss can say "spec mismatch" -------------------------
    def register_spec(self, model_id: str, canonical: bytes) -> None:
        self._redis.sadd(f"{self.prefix}:{{n}}:specs:{model_id}", canonical)

    def specs_of(self, model_id: str) -> set[bytes]:
        return set(self._redis.smembers(f"{self.prefix}:{{n}}:specs:{model_id}"))

    def groups_exist(self, groups: list[bytes]) -> list[bool]:
        pipe = self._redis.pipeline(transaction=False)
        for g in groups:
            pipe.exists(self.group_key(g))
        return [bool(x) for x in pipe.execute()]

    @property
    def redis(self) -> redis.Redis:
        return self._redis

    # -- maintenance --------------------------------------------------------------------------------------------
    def ping(self) -> bool:
        return bool(self._redis.ping())

    def check_integrity(self) -> None:
        """Every node with an incarnation has a deadline and a readable info record naming it."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hgetall(self._k_inc).zrange(self._k_deadline, 0, -1, withscores=True).hgetall(self._k_info)
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

    def close(self) -> None:
        if self._summary_q is not None:
            try:
                self._summary_q.put_nowait(None)
            except queue.Full:
                pass
        with self._conns_lock:
            for _, conn in self._thread_conns:
                conn.disconnect()
        self._redis.close()
