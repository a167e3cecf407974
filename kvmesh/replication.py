"""Hot-prefix replication: which chunks a KVNode's pull-throughs keep as registered replicas.

A pull-through (`pullthrough.py`) brings a holder's chunks into this node's slab for its readers. Whether they stay
once those readers are done is decided here, per pull, for the pulled prompt group:

    readers(group) -> int              mutates (Redis; blocking, without the node's lock): counts this node as a
                                       reader of `group` now; returns the distinct readers within `window_s`
    admit(readers, nbytes, n) -> int   mutates: how many leading chunks of a pull of n to keep: all n when the
                                       group had at least `min_readers` readers and the byte bound has room, fewer
                                       where the bound is reached, else 0 (their bytes are reserved until settle)
    settle(keys, nbytes, keep, landed, held)   mutates: after the pull: the kept chunks that landed count as
                                       replicated bytes; the reservation is given back
    is_transient(key)                  reads: the chunk was pulled for readers but not kept (not registered; the
                                       node drops it once its last reader unpins it)
    mark_transient(keys, group)        mutates
    drop_unpinned(keys, cascade) -> int   mutates: forget the transient chunks among keys that no reader pins,
                                       here and in the cascade's tiers
    left(key)                          mutates: a chunk left this node; a replica's bytes come off the bound
    filter_changes(changes)            mutates `changes` (the cascade's directory changes): transient chunks are
                                       never registered
    replicated_chunks / replicated_bytes / transient_chunks     reads

All but `readers` run under the node's lock.

Where the decision lives, and why: the distinct readers of a group are counted in Redis, by the pullers, in one
sorted set per group next to the group's directory entries (the same Cluster slot), scored on Redis's own clock
(as leases are), and the puller decides. The holder does see its readers (it accounts the bytes it serves per
reader), but (1) a group often has more than one holder (stored on two nodes, or already replicated), so no one
holder sees every reader; (2) its verdict would have to reach the puller inside the pull reply, a wire change for
one bit that arrives once the bytes are already in the puller's slots; and (3) the bytes bound is the puller's
own. Counting at the puller costs one Redis round trip per pull-through (not per chunk, not per lookup), gives an
exact distinct-node count over the window whichever holders served the pulls, and fails safe: a directory that
does not answer admits nothing (the pulled chunks serve their readers and are dropped, as a plain peer fetch).

The node that makes a group hot keeps its copy at once; nodes that pulled it earlier (below the threshold) keep
theirs at their next pull of the group, which then counts them again. With `min_readers` 1 every pull-through
keeps what it pulls (kvmesh's behaviour before replication had a threshold).
"""

from __future__ import annotations

import logging

import redis

log = logging.getLogger("kvmesh.replication")

# KEYS[1] the group's readers set; ARGV: node id, window (ms). Returns the distinct readers within the window,
# this one included. Redis's clock, so nodes' clocks never disagree about the window.
_COUNT_READER = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
redis.call('PEXPIRE', KEYS[1], window)
return redis.call('ZCARD', KEYS[1])
"""


class Replicas:
    def __init__(
        self, r: redis.Redis, prefix: str, node_id: str, min_readers: int, window_s: float, max_bytes: int
    ) -> None:
        self._redis, self._prefix, self.node_id = r, prefix, node_id
        self.min_readers, self.window_ms, self.max_bytes = min_readers, max(1, int(window_s * 1000)), max_bytes
        self._count = r.register_script(_COUNT_READER)
        self._kept: dict[bytes, int] = {}  # key -> nbytes of each replica this node keeps (registered)
        self._reserved = 0  # bytes admitted for pulls still under way
        self._transient: dict[bytes, tuple[bytes, int]] = {}  # key -> (group, nbytes): pulled, not kept

    def readers_key(self, group: bytes) -> str:
        return f"{self._prefix}:r:{{{group.hex()}}}"

    @property
    def replicated_bytes(self) -> int:
        return sum(self._kept.values())

    @property
    def replicated_chunks(self) -> int:
        return len(self._kept)

    @property
    def transient_chunks(self) -> int:
        return len(self._transient)

    def readers(self, group: bytes) -> int:
        """This node counted as a reader of `group` now; the distinct readers within the window (0: unknown).
        Blocking (one Redis round trip): call without the node's lock."""
        if self.min_readers <= 1:
            return 1  # every pull is kept: nothing to count
        try:
            return int(self._count(keys=[self.readers_key(group)], args=[self.node_id, self.window_ms]))
        except redis.RedisError as e:
            log.debug("counting the readers of a group failed: %s", e)
            return 0

    def admit(self, readers: int, nbytes: int, n: int) -> int:
        """Caller holds the node's lock. Of a pull of `n` chunks of `nbytes` whose group had `readers` distinct
        readers, how many leading ones to keep (their bytes are reserved until `settle`)."""
        if readers < self.min_readers or n <= 0:
            return 0
        keep = n
        if self.max_bytes:
            room = self.max_bytes - self.replicated_bytes - self._reserved
            keep = max(0, min(n, room // nbytes))
        self._reserved += keep * nbytes
        return keep

    def settle(self, keys: list[bytes], nbytes: int, keep: int, landed: int, held) -> None:
        """Caller holds the node's lock. `keys[:keep]` were admitted, `keys[:landed]` arrived; `held(key)`: the
        node holds it now. Transient keys that never landed are forgotten."""
        self._reserved -= keep * nbytes
        for key in keys[: min(keep, landed)]:
            if held(key):
                self._kept[key] = nbytes
        for key in keys[keep:]:
            if key in self._transient and not held(key):
                del self._transient[key]

    def mark_transient(self, keys: list[bytes], group: bytes, nbytes: int) -> None:
        for key in keys:
            self._transient[key] = (group, nbytes)

    def is_transient(self, key: bytes) -> bool:
        return key in self._transient

    def drop_unpinned(self, keys, cascade) -> int:
        """Forget (here and in `cascade`'s tiers) the transient chunks among `keys` that no reader pins; returns
        how many. Their discards go to the directory as any chunk's that leaves (an unregister of what was never
        registered changes nothing): were one registered after all, its entry would otherwise outlive it."""
        dropped = 0
        for key in keys:
            entry = self._transient.get(key)
            if entry is None or cascade.pinned(key):
                continue
            del self._transient[key]
            cascade.discard(key)
            dropped += 1
        return dropped

    def is_replica(self, key: bytes) -> bool:
        return key in self._kept

    def left(self, key: bytes) -> None:
        self._kept.pop(key, None)
        self._transient.pop(key, None)

    def filter_changes(self, changes: dict) -> dict:
        """The cascade's changes ((group, key) -> best tier or None), less those of transient chunks (never
        registered); a chunk that left the node is forgotten here."""
        for gk in list(changes):
            key = gk[1]
            if changes[gk] is None:
                if key in self._transient:
                    del changes[gk]  # (it was never registered)
                self.left(key)
            elif key in self._transient:
                del changes[gk]
        return changes
