"""`InflightPulls`: the chunks a KVNode is pulling from peers for its readers right now, so that concurrent readers
on one node share one transfer per chunk instead of each pulling its own copy.

    claim(keys, held) -> (mine, theirs)   mutates: of `keys` neither `held` here nor being pulled, those that now
                                          become the caller's to pull (`mine`, in order); `theirs` maps each key
                                          another caller is pulling to the event its pull sets when it ends
    release(keys) -> [Event]              mutates: the caller's pull of `keys` ended, landed or not; returns the
                                          events to set (after the owner's lock is dropped)

The owner (the KVNode) calls both under its own lock, the same lock its tiers are changed under: `claim` then sees
"held" and "in flight" as one state, so a chunk is never pulled twice by readers who overlap. A waiter is not told
whether the pull it waited for succeeded; it looks in the tier afterwards (the tier is the truth), so a failed or
partial transfer only makes its read shorter.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class InflightPulls:
    def __init__(self) -> None:
        self._events: dict[bytes, threading.Event] = {}  # key -> set when the pull that claimed it ends

    def __len__(self) -> int:
        return len(self._events)

    def claim(
        self, keys: list[bytes], held: Callable[[bytes], bool]
    ) -> tuple[list[bytes], dict[bytes, threading.Event]]:
        mine: list[bytes] = []
        theirs: dict[bytes, threading.Event] = {}
        for key in dict.fromkeys(keys):  # a key named twice is claimed once (waiting on oneself would deadlock)
            ev = self._events.get(key)
            if ev is not None:
                theirs[key] = ev
            elif not held(key):
                self._events[key] = threading.Event()
                mine.append(key)
        return mine, theirs

    def release(self, keys: list[bytes]) -> list[threading.Event]:
        return [ev for key in keys if (ev := self._events.pop(key, None)) is not None]
