"""Eviction policy, kept apart from storage: it only orders keys.

    insert(key)          mutates: key becomes the most recently used
    touch(key)           mutates: key becomes the most recently used (no-op if unknown)
    remove(key)          mutates: forget key (no-op if unknown)
    evict(n, can_evict)  either forgets and returns exactly n keys, least recently used first, skipping keys for
                         which can_evict(key) is False, or returns None and changes nothing

    save_last_copy(Leaving, ...) -> bool   pure: whether a chunk about to leave its node for good is worth handing
                                           to a peer (cluster eviction, `lastcopy.py`)

Tiers touch a prefix's chunks last-to-first, so a prompt's first chunk is the most recent and the tail of a prefix
is evicted before its head: what stays cached is still a prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class LRUPolicy(Generic[K]):
    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()  # least recent first

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: K) -> bool:
        return key in self._order

    def insert(self, key: K) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: K) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, can_evict: Callable[[K], bool] = lambda _k: True) -> list[K] | None:
        victims: list[K] = []
        if n <= 0:
            return victims
        for key in self._order:
            if can_evict(key):
                victims.append(key)
                if len(victims) == n:
                    break
        if len(victims) < n:
            return None
        for key in victims:
            del self._order[key]
        return victims


# -- cluster eviction: the last copy of a chunk that other nodes read ---------------------------------------------
HANDOFF_LATENCY_S = 0.002  # fixed cost of one handoff (a directory check and an actor call), on top of the bytes


@dataclass(frozen=True, slots=True)
class Leaving:
    """What a node knows, under its lock and without asking anyone, of a chunk about to leave it for good."""

    nbytes: int
    reads: int  # reads of it by other nodes within the window (this node's own readers do not count)
    idle_s: float  # seconds since the last of them
    replica: bool  # this node's copy was pulled from a holder (another copy existed then: not a reason now)


def save_last_copy(c: Leaving, window_s: float, recompute_bps: float, move_bps: float) -> bool:
    """Whether a chunk leaving a node should be handed to a peer instead of dropped. Pure.

    Worth it when other nodes read it within `window_s` and the recompute its reads are expected to cost again
    (the reads in the window, fading linearly as it stays idle, each `nbytes / recompute_bps` seconds of prefill)
    outweighs moving it once (`HANDOFF_LATENCY_S + nbytes / move_bps`): big chunks read once may not be worth a
    move that small ones are, and a chunk read often is worth more than one read once. Whether it is the
    cluster's last copy is checked off the eviction path, in the directory: a replica pulled from a holder is not
    refused here, since that holder may have evicted its own copy since (skipping its handoff because the replica
    existed), which makes the replica the last one."""
    if c.reads <= 0 or window_s <= 0 or c.idle_s >= window_s or c.nbytes <= 0:
        return False
    expected_reads = c.reads * (1.0 - c.idle_s / window_s)
    return expected_reads * c.nbytes / recompute_bps > HANDOFF_LATENCY_S + c.nbytes / move_bps
