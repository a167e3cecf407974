"""`Janitor`: purges what dead and superseded incarnations left in the directory. Runs on the KVNode's maintenance
thread, one round per heartbeat.

    purge_later(incs)     mutates (no I/O): this node's own earlier incarnations, purged on the next round
    round()               mutates the directory: purges those; and, on the one node that holds the janitor claim,
                          ends the leases of nodes Ray reports dead and purges incarnations whose lease lapsed
    rounds                reads: how many rounds ended (one that raised does not count): tests wait on it

Readers never see such entries anyway (they check incarnations and leases); purging gives back their memory, and
Ray's word ends a dead node's lease before it would lapse. Purges write other incarnations' entries only, never
this node's current ones, so they need not go through the registrar's single writer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvmesh.directory import Directory


class Janitor:
    def __init__(
        self,
        directory: Directory,
        node_id: str,
        lease_s: float,
        lease: Callable,
        count: Callable[..., None],
        event: Callable[..., None],
    ) -> None:
        """`lease()`: this node's current lease (the registrar's; it changes on a re-join)."""
        self.directory = directory
        self.node_id = node_id
        self.lease_s = lease_s
        self._lease, self._count, self._event = lease, count, event
        self._lock = threading.Lock()
        self._to_purge: list[int] = []  # this node's own earlier incarnations, guarded by _lock
        self._dead_since: dict[int, float] = {}  # lapsed incarnation -> when first seen (maintenance thread only)
        self.rounds = 0  # rounds done, whether they purged anything or not (one writer: the maintenance thread)

    def purge_later(self, incarnations: list[int]) -> None:
        with self._lock:
            self._to_purge.extend(i for i in incarnations if i)

    def round(self) -> None:
        self._round()
        self.rounds += 1

    def _round(self) -> None:
        d = self.directory
        while True:
            with self._lock:
                if not self._to_purge:
                    break
                inc = self._to_purge[0]
            owner = d.holder_of(inc)
            if owner is None or (owner == self.node_id and inc != self._lease().incarnation):
                self._count("purged_entries", d.purge(inc))
            else:  # a Redis that restarted empty gave the number to a node again: its entries are that node's now
                self._count("purge_skipped_reissued")
            with self._lock:
                self._to_purge.pop(0)
        lease = self._lease()
        if not d.claim("janitor", f"{self.node_id}:{lease.incarnation}", int(self.lease_s * 1000)):
            return
        table = d.node_table()
        for node_id in self._ray_dead_nodes(table):
            info = table.by_node()[node_id]
            if d.expire(node_id, info.incarnation):
                self._count("ray_reported_dead")
                self._event("node_dead", "ray", node_id[:12])
                self._purge(node_id, info.incarnation)
        now = time.monotonic()
        dead = table.dead_incarnations or {}
        for node_id, inc in dead.items():
            first = self._dead_since.setdefault(inc, now)
            # A short grace for a heartbeat that is merely late, so that the purge lands within 2 lease periods of
            # the node's death (lapse <= 1 lease, first seen <= 1 heartbeat later, then this). Purging a node that
            # was alive after all is safe: its next heartbeat finds its row gone, and it re-joins and re-registers.
            if now - first >= self.lease_s / 4:
                self._purge(node_id, inc)
        self._dead_since = {i: t for i, t in self._dead_since.items() if i in dead.values()}

    def _purge(self, node_id: str, inc: int) -> None:
        if self.directory.claim(f"purge:{inc}", self.node_id, 60_000):
            self._count("purged_entries", self.directory.purge(inc))
            self.directory.forget(node_id, inc)
            self._count("purged_incarnations")

    def _ray_dead_nodes(self, table) -> list[str]:
        """Live directory nodes that Ray's GCS says are dead (only inside a Ray cluster)."""
        try:
            import ray

            if not ray.is_initialized():
                return []
            dead = {n["NodeID"] for n in ray.nodes() if not n.get("Alive", True)}
        except Exception:  # no Ray here, or its GCS did not answer: the leases still decide
            return []
        return [node_id for node_id in table.by_node() if node_id in dead and node_id != self.node_id]
