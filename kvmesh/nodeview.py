"""`NodeView`: the live nodes as one process sees them, and its one directory circuit breaker. A client and a KVNode
each own one (a KVNode's pull-throughs need peers' addresses too).

    table() -> NodeTable       reads: the last node table read, with leases judged now (Redis's clock, advanced by
                               the time elapsed here since the read)
    info(node_id[, inc]) -> NodeInfo   reads: a live node's record; the table is read again first if it is
                               older than `max_age_s`, or does not know incarnation `inc` of the node
    refresh() -> bool          mutates: reads the node table (closes the breaker when the directory answered)
    allow() -> bool            reads: False while the breaker is open (a directory call failed within `retry_s`
                               and no refresh has reached the directory since): callers skip the directory
    failed() / succeeded()     mutates: what the caller's directory call did

A directory that failed moments ago is not asked again on the request path (a fast miss instead of a timeout per
call); the background refresh keeps probing it and closes the breaker as soon as it answers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import redis

from kvmesh.directory import NodeTable
from kvmesh.wire import NodeInfo

EMPTY = NodeTable(None, 0, {}, (), {})


class NodeView:
    def __init__(self, read: Callable[[], NodeTable], retry_s: float = 5.0, max_age_s: float = 0.5) -> None:
        self._read = read
        self.retry_s = retry_s
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._table, self._at = EMPTY, -1e9  # guarded by _lock: the last table read and when (monotonic)
        self._open_until = 0.0  # the breaker is open until then
        self.errors = 0  # directory calls that failed (refreshes included)

    def table(self) -> NodeTable:
        with self._lock:
            t, at = self._table, self._at
        now_ms = t.now_ms + int((time.monotonic() - at) * 1000)
        live = {inc: info for inc, info in t.live.items() if t.deadlines.get(inc, 0) > now_ms}
        return NodeTable(t.epoch, now_ms, live, t.dead, t.deadlines, t.dead_incarnations)

    @property
    def age_s(self) -> float:
        return time.monotonic() - self._at

    def info(self, node_id: str, incarnation: int = 0) -> NodeInfo | None:
        """`incarnation`: the one a lookup named; a table that knows another one (or none) is read again first."""
        found = self.table().by_node().get(node_id) if self.age_s <= self.max_age_s else None
        if found is None or (incarnation and found.incarnation != incarnation):  # (a restarted node moved)
            self.refresh()
            found = self.table().by_node().get(node_id)
        return found

    def refresh(self) -> bool:
        try:
            table = self._read()
        except redis.RedisError:
            self.failed()
            return False
        with self._lock:
            self._table, self._at = table, time.monotonic()
            self._open_until = 0.0  # it answers again
        return True

    def allow(self) -> bool:
        return time.monotonic() >= self._open_until

    def failed(self) -> None:
        self.errors += 1
        self._open_until = time.monotonic() + self.retry_s

    def succeeded(self) -> None:
        self._open_until = 0.0
