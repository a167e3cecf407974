"""Eviction policy, kept apart from storage: it only orders keys.

    insert(key)          mutates: key becomes the most recently used
    touch(key)           mutates: key becomes the most recently used (no-op if unknown)
    remove(key)          mutates: forget key (no-op if unknown)
    evict(n, can_evict)  either forgets and returns exactly n keys, least recently used first, skipping keys for
                         which can_evict(key) is False, or returns None and changes nothing

Tiers touch a prefix's chunks last-to-first, so a prompt's first chunk is the most recent and the tail of a prefix
is evicted before its head: what stays cached is still a prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
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
