"""Holder entries (`P:g:{<h1 hex>}`), each incarnation's own index of the groups it has entries in (`P:o:<inc>`),
and purging a dead incarnation's entries through that index.

    register(lease, tier, group, hashes) -> refused  mutates: adds/updates this incarnation's entries (not in an
                                                     entry that lists MAX_HOLDERS others: those hashes are returned)
    unregister(lease, group, hashes)                 mutates: removes this incarnation's entries
    register_many(lease, tier, {group: hashes})      mutates: `register` of several groups, one round trip a server
    purge(inc) -> entries dropped                    mutates: every entry of a dead incarnation, via its own index
    entries_of(inc) -> {(group, field): tier}        read: an incarnation's entries, via its own index
    lookup_raw(group, hashes) -> list[bytes | None]  read, one round trip
    holders(group, hashes, table) -> [holders]       read, one round trip: every chunk's live holders

Holder entries name an incarnation, never just a node; readers drop every entry whose incarnation the node table
does not list live (`kvmesh.directory.prefix`), so a purge only gives their memory back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvmesh.directory.conn import Conn, pack_hmget
from kvmesh.directory.prefix import Decode, live_prefix, names_newer
from kvmesh.directory.records import MAX_HOLDERS, SUMMARY_MIN, Holder, Keys, Lease, NodeTable, fields
from kvmesh.directory.scripts import PURGE_GROUP, REGISTER, UNREGISTER


class Entries:
    def __init__(self, conn: Conn, keys: Keys, decode: Decode) -> None:
        self.conn, self.keys, self.decode = conn, keys, decode
        self._redis = conn.redis
        self.register_script = self._redis.register_script(REGISTER)
        self.unregister_script = self._redis.register_script(UNREGISTER)
        self._owned: dict[int, set[bytes]] = {}  # incarnation -> groups already in its own index
        self._own_lock = threading.Lock()

    def _note_owned(self, lease: Lease, groups) -> None:
        """Add groups to the incarnation's own index (the groups it has entries in), once per group: what makes a
        purge cost the node's own entries instead of a keyspace scan."""
        with self._own_lock:
            known = self._owned.setdefault(lease.incarnation, set())
            new = [g for g in groups if g not in known]
            if new:
                self._redis.sadd(self.keys.own(lease.incarnation), *new)
                known.update(new)

    def disown(self, lease: Lease, groups, still_empty) -> int:
        """Take groups the incarnation no longer has entries in out of its own index, so that the index (and a
        purge) stays the size of what it holds now. `still_empty(group)` is asked again under the index's lock:
        a register racing with this adds its group back after, never before. Returns how many were taken out."""
        with self._own_lock:
            known = self._owned.get(lease.incarnation, set())
            gone = [g for g in groups if g in known and still_empty(g)]
            if gone:
                self._redis.srem(self.keys.own(lease.incarnation), *gone)
                known.difference_update(gone)
        return len(gone)

    def register(self, lease: Lease, tier: int, group: bytes, hashes: list[bytes]) -> list[bytes]:
        """Returns the hashes not registered: their entries list MAX_HOLDERS other holders already (the caller
        tries them again later)."""
        if not hashes:
            return []
        self._note_owned(lease, [group])
        refused = self.register_script(
            keys=self.keys.group_pair(group), args=[lease.incarnation, tier, MAX_HOLDERS, *fields(hashes), SUMMARY_MIN]
        )
        return [hashes[int(i) - 1] for i in refused or ()]

    def unregister(self, lease: Lease, group: bytes, hashes: list[bytes]) -> None:
        if hashes:
            self.unregister_script(
                keys=self.keys.group_pair(group), args=[lease.incarnation, *fields(hashes), SUMMARY_MIN]
            )

    def register_many(self, lease: Lease, tier: int, groups: dict[bytes, list[bytes]]) -> dict[bytes, list[bytes]]:
        """Register several groups in one pipelined round trip per Redis server (used on resync). Returns, by group,
        the hashes not registered (as `register`)."""
        self._note_owned(lease, list(groups))
        out = self.conn.run_scripts(
            REGISTER,
            [
                (self.keys.group_pair(g), [lease.incarnation, tier, MAX_HOLDERS, *fields(hs), SUMMARY_MIN])
                for g, hs in groups.items()
            ],
        )
        return {g: [hs[int(i) - 1] for i in r] for (g, hs), r in zip(groups.items(), out) if r}

    def purge(self, incarnation: int) -> int:
        """Remove every entry of a lapsed or superseded incarnation; returns how many chunk entries were dropped.
        Reads only that incarnation's own index and the groups it names: the cost is the node's own groups, never
        a scan of the keyspace. Readers already ignore such entries; this returns their memory."""
        own = self.keys.own(incarnation)
        # and the groups this process registered it in: a Redis that restarted empty lost the index of what was
        # written to it before the node noticed (the node believed those groups indexed already)
        groups = list(set(self._redis.smembers(own)) | self._owned.get(incarnation, set()))
        removed = 0
        for i in range(0, len(groups), 256):
            removed += sum(
                int(n or 0)
                for n in self.conn.run_scripts(
                    PURGE_GROUP, [(self.keys.group_pair(g), [incarnation, SUMMARY_MIN]) for g in groups[i : i + 256]]
                )
            )
        self._redis.delete(own)
        self._owned.pop(incarnation, None)
        return removed

    def drop_own_index(self, lease: Lease) -> None:
        """Delete the incarnation's own index of groups (a node that leaves, having unregistered everything)."""
        self._redis.delete(self.keys.own(lease.incarnation))
        with self._own_lock:
            self._owned.pop(lease.incarnation, None)

    def entries_of(self, incarnation: int) -> dict[tuple[bytes, bytes], int]:
        """(group, field) -> tier of every entry naming `incarnation`, found through its own index (O(its own
        groups)); for integrity checks."""
        out: dict[tuple[bytes, bytes], int] = {}
        for group in self._redis.smembers(self.keys.own(incarnation)):
            for fld, value in self._redis.hgetall(self.keys.group(group)).items():
                for inc, tier in self.decode(value):
                    if inc == incarnation:
                        out[(group, fld)] = tier
        return out

    def lookup_raw(self, group: bytes, hashes: list[bytes]) -> list[bytes | None]:
        """One HMGET of the group's entries for `hashes`, on this thread's own connection (no pool round trip on
        the hot path)."""
        key = self.keys.group(group)
        return self.conn.send([(key, [pack_hmget(key, hashes)])], lambda: [self._redis.hmget(key, fields(hashes))])[0]

    def holders(
        self,
        group: bytes,
        hashes: list[bytes],
        table: NodeTable,
        prefer: str | None = None,
        newer: Callable[[], NodeTable] | None = None,
    ) -> list[tuple[Holder, ...]]:
        """One round trip: the live holders of every chunk of `hashes` (an empty tuple where none), not only of the
        leading run: what a store checks to skip the chunks already cached. `newer`: as in `Directory.lookup`."""
        values = self.lookup_raw(group, hashes)
        if newer is not None and names_newer({v for v in values if v}, table.newest(), self.decode):
            table = newer()
        return [r[0] if (r := live_prefix([(v, 1)], table, prefer, decode=self.decode)[0]) else () for v in values]

    # -- groups and specs: which exist, so a miss can say "spec mismatch" -----------------------------------------
    def groups_exist(self, groups: list[bytes]) -> list[bool]:
        pipe = self._redis.pipeline(transaction=False)
        for g in groups:
            pipe.exists(self.keys.group(g))
        return [bool(x) for x in pipe.execute()]

    def register_spec(self, model_id: str, canonical: bytes) -> None:
        self._redis.sadd(self.keys.specs(model_id), canonical)

    def specs_of(self, model_id: str) -> set[bytes]:
        return set(self._redis.smembers(self.keys.specs(model_id)))
