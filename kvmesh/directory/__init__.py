"""The directory: which live node incarnations hold which chunks. Redis holds metadata only, never KV bytes.

Key layout (`P` is the configured key prefix; `records.Keys` names them):

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
    P:{n}:specs:<model>    set      the canonical spec of each client of the model (a miss can say "spec_mismatch")
    P:{n}:load             hash     replica id -> msgpack [1, node_id, pending prefill tokens, queue depth]: the
                                    load each serving replica last reported (`report_load`)
    P:{n}:load_at          hash     replica id -> when it reported, ms on Redis's own clock (the leases' clock)
    P:g:{<h1 hex>}         hash     chunk hash, first 6 bytes -> 0x02 then (inc u32 LE, tier u8) per holder
    P:o:<inc>              set      the groups incarnation <inc> has entries in: its purge reads only these (a
                                    group leaves it when the node's last chunk of that group does)
    P:sglang:{<root>}:gen  string   the generation of one (spec, salt) root: a clear raises it, and it names the
                                    group the root's SGLang pages register in (`generations`)
    P:s:{<h1 hex>}         hash     the group's summaries, in a group of at least SUMMARY_MIN entries: `v` -> the
                                    group's version (a new one at every change of an entry: Redis's clock, us), and
                                    per summary the field of the chain hash at a bucket's last position -> the
                                    entry values of that bucket's 64 chunks as they were at `v`, run-length encoded
                                    (`pack_summary`). Every script that changes an entry deletes them all first;
                                    one is written (SUMMARIZE) only at the version its entries were read at
and beside the directory, in the same database (the modules named own them):
    P:{n}:stats            hash     node_id -> msgpack of the node's published stats (telemetry.Records; `leave`
                                    drops the node's field)
    P:{n}:totals           hash     cluster-wide counters the nodes add to (telemetry.Records)
    P:{n}:events           list     the latest EVENTS_KEPT events, newest first (telemetry.Records)
    P:r:{<h1 hex>}         zset     node_id scored by when it last pulled from the group: its distinct readers
                                    within a window, which decide whether a pulled chunk is kept (replication.py)

All node keys share the hash tag `{n}`, so the node table is read in one round trip and the scripts that change it
touch one Redis Cluster slot. A prompt's chunks all live in the group of its first chunk's hash h_1 (tag
`{<h1 hex>}`): one lookup is one HMGET on one slot, while prompts with different first chunks spread over slots.
Fields are the first 6 bytes of a chunk hash: within one group (one tenant, one first chunk) a collision is a
2^-48 event per pair of chunks, and even then it only makes a lookup name a holder that, asked by the full hash,
does not have the chunk (the fetch is shorter, never wrong). Values are 1 + 5 bytes per holder. A group of up to
512 entries is a listpack (LISTPACK_MAX_ENTRIES): ~20 bytes per (chunk, holder) entry on Redis 7 with jemalloc,
~50 in the hash table of a larger group (bench/directory.py, P6).

Holder entries name an incarnation, never just a node. An entry is live only while its incarnation is the node's
current one and that node's lease deadline has not passed; readers drop everything else (`prefix.live_prefix`), so
entries of dead or superseded incarnations are never returned.

The parts (`Directory` composes them; each module's docstring lists what it owns): `records` (the records, key
names, value encoding, constants), `prefix` (the live prefix over a NodeTable: pure), `conn` (connections; the one
packed send, redirect and fallback), `membership` (nodes, leases, the node table), `entries` (holder entries, own
indexes, purge), `summaries` (long chained lookups), `loads` (load reports), `generations` (clear counters),
`scripts` (the Lua). `connect`, `probe` and `DirectoryUnavailable` are `kvmesh.redisconn`'s (re-exported here).
"""

from __future__ import annotations

from collections.abc import Callable

import redis

from kvmesh.directory.conn import Conn, pack_hmget  # noqa: F401 (the names a caller imports from here)
from kvmesh.directory.entries import Entries
from kvmesh.directory.generations import Generations
from kvmesh.directory.loads import Loads
from kvmesh.directory.membership import Membership
from kvmesh.directory.prefix import live_prefix, longest_prefix
from kvmesh.directory.records import (  # noqa: F401 (re-exported, as the rest)
    FIELD_BYTES,
    HOLDERS_VERSION,
    LISTPACK_MAX_ENTRIES,
    LOAD_VERSION,
    MAX_HOLDERS,
    MAX_SUMMARIES,
    SUMMARY_BUCKET,
    SUMMARY_MIN,
    SUMMARY_SKIP_S,
    SUMMARY_VERSION,
    SUMMARY_WRITE_S,
    Holder,
    HolderDecoder,
    Keys,
    Lease,
    LoadRecord,
    NodeTable,
    fields,
    horizon_for,
)
from kvmesh.directory.summaries import Summaries, pack_summary, unpack_summary  # noqa: F401
from kvmesh.redisconn import DirectoryUnavailable, connect, probe  # noqa: F401 (kvmesh.DirectoryUnavailable)
from kvmesh.wire import NodeInfo

NewerTable = Callable[[], NodeTable] | None
Prefix = tuple[list[tuple[Holder, ...]], str | None]


class Directory:
    """A process's client of the directory at `url`: its parts (`members`, `entries`, `summaries`, `loads`, over
    `conn`), whose methods these are; `lookup` and `lookup_with_loads` judge what they read by the live prefix."""

    def __init__(self, url: str, prefix: str = "kvmesh", timeout_s: float = 2.0) -> None:
        self.url, self.prefix = url, prefix
        self.conn = Conn(connect(url, timeout_s))
        self.cluster = self.conn.cluster
        self.keys = k = Keys(prefix)
        self.group_key, self.summary_key, self.group_keys, self.own_key = k.group, k.summary, k.group_pair, k.own
        self.decode_holders = HolderDecoder()  # (incarnation, tier) pairs of one entry, each value decoded once
        self.members = Membership(self.conn.redis, self.keys)
        self.entries = Entries(self.conn, self.keys, self.decode_holders)
        self.summaries = Summaries(self.conn, self.keys, self.entries)
        self.loads = Loads(self.conn, self.keys)
        self.generations = Generations(self.conn.redis, prefix)
        self.summary_counts = self.summaries.counts

    @property
    def redis(self) -> redis.Redis:
        return self.conn.redis

    @property
    def redirects(self) -> int:
        return self.conn.redirects  # Redis Cluster MOVED/ASK answers followed (a resharding)

    @property
    def table_horizon_ms(self) -> int:
        """`node_table`: leases further off than this are read only on a membership change (`horizon_for`)."""
        return self.members.table_horizon_ms

    @table_horizon_ms.setter
    def table_horizon_ms(self, ms: int) -> None:
        self.members.table_horizon_ms = ms

    @property
    def summary_write_s(self) -> float:
        """A client writes a prompt's summaries at most this often."""
        return self.summaries.write_s

    @summary_write_s.setter
    def summary_write_s(self, s: float) -> None:
        self.summaries.write_s = s

    @property
    def summaries_off(self) -> bool:
        """Whether long lookups read every entry (a client whose ACL user may not read or write summaries)."""
        return self.summaries.off

    # -- nodes (membership.py) ----------------------------------------------------------------------------------
    def join(self, info: NodeInfo, lease_ms: int, last_incarnation: int = 0) -> Lease:
        return self.members.join(info, lease_ms, last_incarnation)

    def heartbeat(self, lease: Lease, lease_ms: int, info: NodeInfo | None = None) -> str:
        return self.members.heartbeat(lease, lease_ms, info)

    def leave(self, lease: Lease) -> bool:
        return self.members.leave(lease)

    def node_table(self) -> NodeTable:
        return self.members.node_table()

    def expire(self, node_id: str, incarnation: int) -> bool:
        return self.members.expire(node_id, incarnation)

    def forget(self, node_id: str, incarnation: int) -> bool:
        return self.members.forget(node_id, incarnation)

    def holder_of(self, incarnation: int) -> str | None:
        return self.members.holder_of(incarnation)

    def claim(self, name: str, holder: str, ttl_ms: int) -> bool:
        return self.members.claim(name, holder, ttl_ms)

    def server_identity(self) -> str:
        return self.members.server_identity()

    def encoding_advice(self) -> str | None:
        return self.members.encoding_advice()

    def check_integrity(self) -> None:
        self.members.check_integrity()

    # -- holders (entries.py) -----------------------------------------------------------------------------------
    def register(self, lease: Lease, tier: int, group: bytes, hashes: list[bytes]) -> list[bytes]:
        return self.entries.register(lease, tier, group, hashes)

    def unregister(self, lease: Lease, group: bytes, hashes: list[bytes]) -> None:
        self.entries.unregister(lease, group, hashes)

    def register_many(self, lease: Lease, tier: int, groups: dict[bytes, list[bytes]]) -> dict[bytes, list[bytes]]:
        return self.entries.register_many(lease, tier, groups)

    def disown(self, lease: Lease, groups, still_empty) -> int:
        return self.entries.disown(lease, groups, still_empty)

    def purge(self, incarnation: int) -> int:
        return self.entries.purge(incarnation)

    def drop_own_index(self, lease: Lease) -> None:
        self.entries.drop_own_index(lease)

    def entries_of(self, incarnation: int) -> dict[tuple[bytes, bytes], int]:
        return self.entries.entries_of(incarnation)

    def lookup_raw(self, group: bytes, hashes: list[bytes]) -> list[bytes | None]:
        return self.entries.lookup_raw(group, hashes)

    def holders(
        self, group: bytes, hashes: list[bytes], table: NodeTable, prefer: str | None = None, newer: NewerTable = None
    ) -> list[tuple[Holder, ...]]:
        return self.entries.holders(group, hashes, table, prefer, newer)

    def groups_exist(self, groups: list[bytes]) -> list[bool]:
        return self.entries.groups_exist(groups)

    def register_spec(self, model_id: str, canonical: bytes) -> None:
        self.entries.register_spec(model_id, canonical)

    def specs_of(self, model_id: str) -> set[bytes]:
        return self.entries.specs_of(model_id)

    # -- lookups: the live prefix (prefix.py) of what entries.py or summaries.py read ----------------------------
    def lookup(
        self,
        group: bytes,
        hashes: list[bytes],
        table: NodeTable,
        prefer: str | None = None,
        newer: NewerTable = None,
        chained: bool = False,
    ) -> Prefix:
        """One round trip: the live holders of each leading chunk of `hashes` (registered in `group`) that has one,
        and why the run ends before `hashes` does ("not_cached", "holder_dead"; None if it does not). What the
        client's lookups call. `newer()`: a table read now, asked (once) when an entry names an incarnation newer
        than `table` knows, so a node that joined since `table` was read counts as a holder. `chained`: `hashes`
        is a prompt's chain from its first chunk (`lookup_chained`: its buckets' summaries are read instead)."""
        if chained:
            return live_prefix(self.summaries.chained_runs(group, hashes), table, prefer, newer, self.decode_holders)
        return self.longest_prefix_why(self.lookup_raw(group, hashes), table, prefer, newer)

    def lookup_chained(self, group: bytes, hashes: list[bytes]) -> list[bytes | None]:
        """The entries of `hashes` (as `lookup_raw` gives them, up to where the cached prefix can no longer go on),
        for a chain: `hashes[i]` is the hash of the prompt's chunk i, from its first chunk on (summaries.py)."""
        return [v for v, count in self.summaries.chained_runs(group, hashes) for _ in range(count)]

    def lookup_with_loads(
        self,
        group: bytes,
        hashes: list[bytes],
        table: NodeTable,
        prefer: str | None = None,
        newer: NewerTable = None,
        chained: bool = False,
    ) -> tuple[list[tuple[Holder, ...]], str | None, list[LoadRecord]]:
        """`lookup` and every replica's last load report in one round trip (`Loads.read_with`). `chained` (as
        `lookup`'s), for a prompt of a whole bucket or more: its summaries, then the load reports (a round trip
        more)."""
        if chained and len(hashes) >= SUMMARY_BUCKET:
            holders, why = self.lookup(group, hashes, table, prefer, newer, chained=True)
            return holders, why, self.loads.read()
        values, loads = self.loads.read_with(self.keys.group(group), hashes)
        holders, why = self.longest_prefix_why(values, table, prefer, newer)
        return holders, why, loads

    def longest_prefix(self, values: list[bytes | None], table: NodeTable, prefer: str | None = None) -> list:
        return self.longest_prefix_why(values, table, prefer)[0]

    def longest_prefix_why(
        self, values: list[bytes | None], table: NodeTable, prefer: str | None = None, newer: NewerTable = None
    ) -> Prefix:
        """`prefix.longest_prefix` of entry values (one per chunk), decoded through this Directory's cache."""
        return longest_prefix(values, table, prefer, newer, self.decode_holders)

    def touched(self, group: bytes) -> None:
        self.summaries.touched(group)

    def flush_summaries(self) -> None:
        self.summaries.flush()

    # -- load reports (loads.py) --------------------------------------------------------------------------------
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
        return self.loads.report(replica_id, node_id, pending_prefill_tokens, queue_depth, keep_ms, prefill, namespace)

    # -- maintenance --------------------------------------------------------------------------------------------
    def ping(self) -> bool:
        return bool(self.conn.redis.ping())

    def close(self) -> None:
        self.summaries.close()
        self.conn.close()
