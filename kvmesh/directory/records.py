"""What the directory's keys hold, as Python sees it: the records (Lease, Holder, LoadRecord, NodeTable), the key
names (`Keys`), the holders value's encoding and the constants every part of the directory shares. No Redis here.

A holders value (one chunk's entry, in its group's hash) is HOLDERS_VERSION, then (incarnation u32 LE, tier u8) per
holder: 1 + 5 bytes a holder, at most MAX_HOLDERS of them. Its field is the first FIELD_BYTES bytes of the chunk
hash (`fields`). The Lua scripts (`kvmesh.directory.scripts`) read and write the same layout.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

from kvmesh.wire import NodeInfo

HOLDERS_VERSION = 2  # the value's first byte
HOLDER = struct.Struct("<IB")  # incarnation, tier
MAX_HOLDERS = 8  # per chunk; an entry that lists this many takes no other holder until one leaves

LOAD_VERSION = 1  # a load value's first element

FIELD_BYTES = 6

# Redis keeps a hash of up to `hash-max-listpack-entries` fields as one listpack: ~20 bytes an entry instead of ~50 in
# a hash table (P6), but searched field by field, so an HMGET of n fields from a group of m entries costs O(n x m).
# kvmesh reads long prompts' groups so as not to pay that: a lookup reads the buckets' summaries (a few fields), and
# where it must read every entry, all of a group no larger than twice the prompt (HGETALL, O(m)). Measured on Redis
# 7.0.15 (`bench/directory.py --only listpack`). kvmesh's servers (the embedded one, Helm's, bare-metal.sh's) set
# Redis's own default, 512, explicitly; `encoding_advice` warns of a server set higher (HMGETs of a prompt's last
# chunks and of a store's check then search listpacks of thousands of entries).
LISTPACK_MAX_ENTRIES = 512

# Summaries (issue 17: a long prompt's lookup in about one GET's time; `kvmesh.directory.summaries`). A summary
# copies the entries of one bucket of a prompt's chain, positions [64 k, 64 k + 64), run-length encoded, as they were
# at one version of the group; it is named by the field of the chain hash at the bucket's last position, which names
# the whole chain up to there. A lookup of a prompt of 512 chunks reads 8 summaries instead of 512 entries.
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


def pairs(flat: list) -> dict:
    """A flat [k1, v1, k2, v2, ...] reply (RESP2's HGETALL) as a dict."""
    return dict(zip(flat[::2], flat[1::2]))


def fields(hashes: list[bytes]) -> list[bytes]:
    """The group fields of chunk hashes (their first FIELD_BYTES bytes)."""
    return [h[:FIELD_BYTES] for h in hashes]


def decode_holders(value: bytes | None) -> tuple[tuple[int, int], ...]:
    """(incarnation, tier) pairs of one holders value; none of a value this version cannot read (no holder)."""
    if not value or value[0] != HOLDERS_VERSION or (len(value) - 1) % 5:
        return ()
    return tuple(HOLDER.iter_unpack(value[1:]))


def encode_holders(holders: list[tuple[int, int]]) -> bytes:
    """A holders value of (incarnation, tier) pairs, as the scripts write it (tests build entries with it)."""
    return bytes([HOLDERS_VERSION]) + b"".join(HOLDER.pack(inc, tier) for inc, tier in holders)


class HolderDecoder:
    """`decode_holders`, each distinct value decoded once: entries repeat across a prompt's chunks and lookups."""

    def __init__(self) -> None:
        self._cache: dict[bytes, tuple[tuple[int, int], ...]] = {}
        self._lock = threading.Lock()

    def __call__(self, value: bytes) -> tuple[tuple[int, int], ...]:
        hit = self._cache.get(value)
        if hit is None:
            hit = decode_holders(value)
            with self._lock:
                if len(self._cache) > 4096:
                    self._cache.clear()
                self._cache[value] = hit
        return hit


class Keys:
    """The Redis keys of one directory (key prefix `prefix`): the table is `kvmesh.directory`'s docstring."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        n = f"{prefix}:{{n}}"
        self.epoch, self.counter = f"{n}:epoch", f"{n}:counter"
        self.inc, self.deadline, self.info = f"{n}:inc", f"{n}:lease", f"{n}:info"
        self.stats = f"{n}:stats"  # (telemetry.Records' hash of the nodes' published stats)
        self.ver, self.clock = f"{n}:ver", f"{n}:clock"
        self.load, self.load_at = f"{n}:load", f"{n}:load_at"

    def claim(self, name: str) -> str:
        return f"{self.prefix}:{{n}}:claim:{name}"

    def specs(self, model_id: str) -> str:
        return f"{self.prefix}:{{n}}:specs:{model_id}"

    def group(self, group: bytes) -> str:
        return f"{self.prefix}:g:{{{group.hex()}}}"

    def summary(self, group: bytes) -> str:
        return f"{self.prefix}:s:{{{group.hex()}}}"

    def group_pair(self, group: bytes) -> list[str]:
        """What a group script is given: the group's entries and its summaries (one slot)."""
        return [self.group(group), self.summary(group)]

    def own(self, incarnation: int) -> str:
        return f"{self.prefix}:o:{incarnation}"


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
