"""`NodeView`: the live nodes as one process sees them, and its one directory circuit breaker. A client and a KVNode
each own one (a KVNode's pull-throughs need peers' addresses too).

    table() -> NodeTable       reads: the last node table read, with leases judged now (Redis's clock, advanced by
                               the time elapsed here since the read)
    info(node_id[, inc]) -> NodeInfo   reads: a live node's record; the table is read again first if it is
                               older than `max_age_s`, or does not know incarnation `inc` of the node
    refresh(direct=False) -> bool   mutates: reads the node table (closes the breaker when the directory answered);
                               `direct`: from the directory itself, never a relay
    refreshes                  reads: how many refreshes read a table, however they read it (tests wait on it)
    current() -> NodeTable     mutates: reads the table from the directory now and returns it (an entry named an
                               incarnation newer than the view knows: a node joined since)
    allow() -> bool            reads: False while the breaker is open (a directory call failed within `retry_s`
                               and no refresh has reached the directory since): callers skip the directory
    failed() / succeeded()     mutates: what the caller's directory call did

A directory that failed moments ago is not asked again on the request path (a fast miss instead of a timeout per
call); the background refresh keeps probing it and closes the breaker as soon as it answers.

    TableFile(path)            the node table a KVNode relays to the clients on its node: a small file beside its
                               slab, replaced whole (`os.replace`) after each of the node's refreshes
    relayed(file, read, max_age_s)   a client's read: the relayed table while it is fresh (the node read Redis
                               within `max_age_s`), else the directory itself

So Redis serves one node-table reader per node, not one per client (docs/scale.md: 1,000 nodes x 9 clients), and a
client still sees a dead directory: the node's refreshes fail, its file goes stale, the client asks Redis.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import msgpack
import redis

from kvmesh.directory import NodeTable
from kvmesh.wire import NodeInfo

TABLE_FILE_VERSION = 1

EMPTY = NodeTable(None, 0, {}, (), {})


class NodeView:
    def __init__(
        self,
        read: Callable[[], NodeTable],
        retry_s: float = 5.0,
        max_age_s: float = 0.5,
        publish: TableFile | None = None,
        direct: Callable[[], NodeTable] | None = None,
    ) -> None:
        """`publish`: where each table read is relayed to this node's clients (a KVNode's view); `direct`: the
        directory's own read where `read` may answer from a relay (a client's view)."""
        self._read = read
        self._direct = direct or read
        self.publish = publish
        self.retry_s = retry_s
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._table, self._at = EMPTY, -1e9  # guarded by _lock: the last table read and when (monotonic)
        self._open_until = 0.0  # the breaker is open until then
        self.errors = 0  # directory calls that failed (refreshes included)
        self.refreshes = 0  # refreshes that read a table (from the directory or a relay), guarded by _lock

    def table(self) -> NodeTable:
        with self._lock:
            t, at = self._table, self._at
        now_ms = t.now_ms + int((time.monotonic() - at) * 1000)
        live = {inc: info for inc, info in t.live.items() if t.deadlines.get(inc, 0) > now_ms}
        return NodeTable(t.epoch, now_ms, live, t.dead, t.deadlines, t.dead_incarnations, read_at(t), t.unreadable)

    @property
    def age_s(self) -> float:
        return time.monotonic() - self._at

    def info(self, node_id: str, incarnation: int = 0) -> NodeInfo | None:
        """`incarnation`: the one a lookup named; a table that knows another one (or none) is read again first,
        unless the directory failed moments ago (the breaker is open). A table that only aged is not: its leases
        are judged on this clock (`table`), and the background refresh keeps it; a fetch never waits on a directory
        that does not answer, once per run, past its deadline."""
        found = self.table().by_node().get(node_id)
        if (found is None or (incarnation and found.incarnation != incarnation)) and self.allow():
            if self.refresh():  # (a restarted node moved, or one joined since)
                found = self.table().by_node().get(node_id)
        return found

    def refresh(self, direct: bool = False) -> bool:
        try:
            table = (self._direct if direct else self._read)()
            if not direct and self._direct is not self._read and read_at(table) < read_at(self._table):
                table = self._direct()  # the relay is older than what this view has: never go back in time
        except redis.RedisError:
            self.failed()
            return False
        with self._lock:
            self._table, self._at = table, time.monotonic()
            self._open_until = 0.0  # it answers again
        if self.publish is not None:
            self.publish.write(table, self._at)
        with self._lock:  # (counted once relayed too: a waiter on it sees the relay written)
            self.refreshes += 1
        return True

    def current(self) -> NodeTable:
        self.refresh(direct=True)
        return self.table()

    def allow(self) -> bool:
        return time.monotonic() >= self._open_until

    def failed(self) -> None:
        self.errors += 1
        self._open_until = time.monotonic() + self.retry_s

    def succeeded(self) -> None:
        self._open_until = 0.0


def read_at(table: NodeTable) -> int:
    """When `table` was read from Redis, on Redis's clock."""
    return table.read_ms or table.now_ms


class TableFile:
    def __init__(self, path: str) -> None:
        self.path = path

    @staticmethod
    def beside(slab_path: str) -> TableFile:
        return TableFile(slab_path + ".nodes")

    def write(self, table: NodeTable, at: float) -> None:
        """`at`: when `table` was read (time.monotonic(), one clock for every process of the machine)."""
        data = msgpack.packb(
            [
                TABLE_FILE_VERSION,
                at,
                table.epoch,
                table.now_ms,
                [[inc, info.pack()] for inc, info in table.live.items()],
                list(table.dead),
                list(table.deadlines.items()),
                list((table.dead_incarnations or {}).items()),
                read_at(table),
                list((table.unreadable or {}).items()),
            ],
            use_bin_type=True,
        )
        tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
        except OSError:  # a full or read-only /dev/shm: the clients read Redis themselves
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def read(self, max_age_s: float) -> NodeTable | None:
        """The relayed table with its clock advanced to now, or None: no file, another format, or older than
        `max_age_s` (the node's refreshes stopped or fail)."""
        try:
            with open(self.path, "rb") as f:
                o = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
            if o[0] != TABLE_FILE_VERSION:
                return None
            age = time.monotonic() - float(o[1])
            if not -1.0 <= age <= max_age_s:
                return None
            live = {int(inc): NodeInfo.unpack(raw, incarnation=int(inc)) for inc, raw in o[4]}
            return NodeTable(
                o[2],
                int(o[3]) + int(age * 1000),
                live,
                tuple(o[5]),
                {int(i): int(d) for i, d in o[6]},
                {str(n): int(i) for n, i in o[7]},
                int(o[8]),
                {str(n): int(i) for n, i in o[9]} if len(o) > 9 else None,
            )
        except (OSError, ValueError, TypeError, IndexError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            return None

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass


def relayed(
    file: Callable[[], TableFile | None], read: Callable[[], NodeTable], max_age_s: float
) -> Callable[[], NodeTable]:
    """A client's node-table read: its node's relayed table while fresh, else `read` (the directory)."""

    def read_table() -> NodeTable:
        f = file()
        table = f.read(max_age_s) if f is not None else None
        return table if table is not None else read()

    return read_table
