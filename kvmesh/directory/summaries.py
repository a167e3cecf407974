"""Summaries: a long chained prompt's lookup without reading each chunk's entry (issue 17).

A summary (`P:s:{<h1 hex>}`, beside its group's entries on one slot) copies the entry values of one bucket of a
prompt's chain, positions [64 k, 64 k + 64), run-length encoded (`pack_summary`), as they were at one version `v`
of the group. It is named by the field of the chain hash at the bucket's last position: a chain hash names every
chunk before it (`hashing.chunk_hashes`), so that name names the whole chain up to there, and a lookup of a prompt
of 512 chunks reads 8 summaries instead of 512 entries.

Why a summary is never wrong: every script that changes an entry deletes the group's summaries first and gives it a
new version (scripts.CHANGED_LUA), and one is written (SUMMARIZE) only if the group is still at the version its
entries were read at. A lookup reads the summaries of the prompt's whole buckets, the first chunk's entry and the
entries past the last whole bucket in one transaction: what it returns is what the entries said at one version of
the group. Liveness is judged afterwards, from the node table, as for entries read one by one
(`kvmesh.directory.prefix`). Where a bucket the prefix reaches has no summary, a second round trip reads every
entry with the group's version, and this Directory's own thread writes the summaries later, off the hot path.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time

import redis

from kvmesh.directory.conn import EXEC, MULTI, Conn, pack_hgetall, pack_hmget, pack_hmget_fields
from kvmesh.directory.entries import Entries
from kvmesh.directory.prefix import runs
from kvmesh.directory.records import (
    FIELD_BYTES,
    LISTPACK_MAX_ENTRIES,
    MAX_SUMMARIES,
    SUMMARY_BUCKET,
    SUMMARY_SKIP_S,
    SUMMARY_VERSION,
    SUMMARY_WRITE_S,
    Keys,
    fields,
    pairs,
)
from kvmesh.directory.scripts import SUMMARIZE

log = logging.getLogger("kvmesh.directory")

Runs = list[tuple[bytes | None, int]]


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


def entries_of_version(v: bytes | None) -> int | None:
    """The number of entries a group had at version `v` (scripts.CHANGED_LUA); None if it cannot be told."""
    try:
        return int(v.rsplit(b":", 1)[1]) if v else None
    except (IndexError, ValueError):
        return None


def _note(d: dict, group: bytes, value) -> None:
    if len(d) > 4096:
        d.clear()
    d[group] = value


class Summaries:
    def __init__(self, conn: Conn, keys: Keys, entries: Entries) -> None:
        self.conn, self.keys, self.entries = conn, keys, entries
        self._redis = conn.redis
        self.summarize_script = self._redis.register_script(SUMMARIZE)
        self._cache: dict[bytes, tuple[Runs, bool] | None] = {}
        self._cache_lock = threading.Lock()
        # (group, and summary key + a prompt's last bucket name) -> (when, version) this Directory last wrote them
        self._summarized: dict[bytes, tuple] = {}
        self._skip: dict[bytes, float] = {}  # group -> until when its lookups read every entry
        self._q: queue.Queue | None = None  # summaries to write, by a thread of their own
        self._lock = threading.Lock()
        self._pid = 0  # the process whose thread writes them
        self.counts = {"hits": 0, "misses": 0, "written": 0, "refused": 0, "dropped": 0}
        self.write_s = SUMMARY_WRITE_S
        self.off = False  # (a client whose ACL user may not write them reads every entry, in one trip)
        self._touched: set[bytes] = set()  # groups stored into through this Directory since their last lookup
        self._sizes: dict[bytes, int | None] = {}  # group -> its number of entries, as its version last said

    def chained_runs(self, group: bytes, hashes: list[bytes]) -> Runs:
        """`Directory.lookup_chained`'s entries as runs of one value: (value, how many chunks in a row)."""
        n, b = len(hashes), SUMMARY_BUCKET
        if n < b or self.off:
            return runs(self.entries.lookup_raw(group, hashes))
        gkey, skey = self.keys.group_pair(group)
        whole = n // b
        names = [hashes[b * k + b - 1][:FIELD_BYTES] for k in range(whole)]
        now = time.monotonic()
        wrote = self._summarized.get(group)  # (when, at which version) this Directory last wrote some of them
        stored = group in self._touched  # this process stored into the group since: its summaries are gone
        self._touched.discard(group)
        if not stored and self._skip.get(group, 0.0) <= now:
            head_fields = fields([hashes[0], *hashes[whole * b :]])
            # (in one transaction: the summaries and the entries past them as of one moment, never a mix of two)
            try:
                _, _, _, (sums, head) = self.conn.send(
                    [(gkey, [MULTI, pack_hmget_fields(skey, names, True), pack_hmget_fields(gkey, head_fields), EXEC])],
                    lambda: [None, None, None, self._summaries_and_head(skey, names, gkey, head_fields)],
                )
            except redis.exceptions.NoPermissionError as e:  # an ACL user without transactions: as before summaries
                self.off = True
                log.info("kvmesh: this client may not read the directory's summaries (%s): lookups read every entry", e)
                return runs(self.entries.lookup_raw(group, hashes))
            if head[0] is None:  # (nothing of it is cached)
                return [(None, 1)]
            out: Runs = []
            for s in sums[1:]:
                got = self._summary(s)
                if got is None:
                    break
                if out and out[-1][0] == got[0][0][0]:  # (a run that goes on across buckets is one run)
                    out[-1] = (out[-1][0], out[-1][1] + got[0][0][1])
                    out.extend(got[0][1:])
                else:
                    out.extend(got[0])
                if got[1]:  # the cached prefix ends in this bucket
                    self.counts["hits"] += 1
                    return out
            else:
                self.counts["hits"] += 1
                return out + runs(head[1:])
            self.counts["misses"] += 1
            _note(self._sizes, group, entries_of_version(sums[0]))
            if wrote is not None and sums[0] != wrote[1] and now - wrote[0] < self.write_s:
                # (the group changed within a moment of the summaries' writing: it moves too fast for them)
                _note(self._skip, group, now + SUMMARY_SKIP_S)
        # every entry: HGETALL of a group that is a listpack (at most LISTPACK_MAX_ENTRIES entries) and at most
        # twice the prompt (O(entries), where an HMGET searches a listpack once per field), else the HMGET of the
        # prompt's fields (a hash table's: less for the client to decode)
        size = self._sizes.get(group)  # (as of the last read of its version)
        whole_group = size is not None and size <= min(2 * n, LISTPACK_MAX_ENTRIES)
        version, got = self.conn.send(
            [
                (
                    gkey,
                    [
                        pack_hmget_fields(skey, [], True),
                        pack_hgetall(gkey) if whole_group else pack_hmget(gkey, hashes),
                    ],
                )
            ],
            lambda: [
                self._redis.hmget(skey, [b"v"]),
                self._redis.hgetall(gkey) if whole_group else self._redis.hmget(gkey, fields(hashes)),
            ],
        )
        if whole_group:
            entries = got if isinstance(got, dict) else pairs(got)
            values = [entries.get(f) for f in fields(hashes)]
        else:
            values = got
        v = version[0]
        _note(self._sizes, group, entries_of_version(v))
        end = next((i for i, x in enumerate(values) if x is None), n)
        upto = min(whole, end // b + 1)  # the buckets the prefix reaches
        if v is not None and upto:
            # a prompt's summaries at most once per `write_s`, the same version's again only if they did not land
            # (branches of one group each have their own)
            mine = self._summarized.get(skey.encode() + names[upto - 1])
            if mine is None or now - mine[0] >= (self.write_s if mine[1] != v else 30.0):
                _note(self._summarized, skey.encode() + names[upto - 1], (now, v))
                _note(self._summarized, group, (now, v))
                self.write_later(skey, v, [(names[k], pack_summary(values[b * k : b * k + b])) for k in range(upto)])
        return runs(values)

    def touched(self, group: bytes) -> None:
        """A store into `group` is on its way (its registration clears the group's summaries): the next lookup of
        the group reads its entries at once, without asking for summaries first (a conversation's next turn)."""
        if len(self._touched) > 4096:
            self._touched.clear()
        self._touched.add(group)

    def _summaries_and_head(self, skey: str, names: list[bytes], gkey: str, head_fields: list[bytes]) -> list:
        """The first read of `chained_runs` through the cluster client (a resharding moved the group's slot)."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.hmget(skey, [b"v", *names]).hmget(gkey, head_fields)
        return pipe.execute()

    def _summary(self, s: bytes | None) -> tuple[Runs, bool] | None:
        """A summary's entries as runs, and whether one of them is None (decoded once: prompts are looked up
        again)."""
        if s is None:
            return None
        if s in self._cache:
            hit = self._cache[s]
        else:
            values = unpack_summary(s)
            hit = None if values is None else (runs(values), None in values)
            with self._cache_lock:
                if len(self._cache) > 4096:
                    self._cache.clear()
                self._cache[s] = hit
        return hit

    # -- the writer: a thread of this Directory's, off the hot path ---------------------------------------------
    def write_later(self, skey: str, version: bytes, todo: list[tuple[bytes, bytes]]) -> None:
        with self._lock:
            if self._q is None or self._pid != os.getpid():  # (a forked child has no such thread)
                self._q, self._pid = queue.Queue(maxsize=256), os.getpid()
                threading.Thread(target=self._write, args=(self._q,), name="kvmesh-summaries", daemon=True).start()
        try:
            self._q.put_nowait((skey, version, todo))
        except queue.Full:
            self.counts["dropped"] += 1

    def _write(self, q: queue.Queue) -> None:
        while True:
            job = q.get()
            try:
                if job is None:
                    return
                skey, version, todo = job
                args = [version, MAX_SUMMARIES, *itertools.chain.from_iterable(todo)]
                ok = self.summarize_script(keys=[skey], args=args)
                self.counts["written" if ok else "refused"] += 1
            except redis.exceptions.NoPermissionError as e:  # an ACL user that may only read: never again
                self.off = True
                log.info(
                    "kvmesh: this client may not write the directory's summaries (%s): long lookups read every entry", e
                )
            except Exception as e:  # a summary not written is a slower lookup, never a wrong one
                log.debug("kvmesh: writing summaries failed: %s", e)
            finally:
                q.task_done()

    def flush(self) -> None:
        """Wait until the summaries queued so far are written (tests, benchmarks)."""
        if self._q is not None and self._pid == os.getpid():
            self._q.join()

    def close(self) -> None:
        if self._q is not None:
            try:
                self._q.put_nowait(None)
            except queue.Full:
                pass
