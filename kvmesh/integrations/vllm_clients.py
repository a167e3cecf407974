"""`EngineClients`: one side's (scheduler's or worker's) KVMeshClients, one per (LoRA adapter, KV cache group).

EngineClients(specs, connect, share_cost=False)
.base                         the client of (no adapter, group 0), made at once
.get(lora_id, group) -> client   made on first use, once (the engine's thread, the loader and the saver ask at
                              once), counting into the base client's counters (one engine reports as one)
.all() -> list                every client made so far
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any


class EngineClients:
    def __init__(self, specs, connect, share_cost: bool = False) -> None:
        self.specs = tuple(specs)
        self._connect = connect  # spec -> KVMeshClient (tests give their own stand-ins)
        self._share_cost = share_cost  # an adapter barely changes the prefill and not the links
        self.base = connect(self.specs[0])
        self._made: dict[tuple[str | None, int], Any] = {(None, 0): self.base}
        self._lock = threading.Lock()

    def get(self, lora_id: str | None, group: int = 0):
        c = self._made.get((lora_id, group))
        if c is None:
            with self._lock:
                c = self._made.get((lora_id, group))
                if c is None:
                    c = self._connect(replace(self.specs[group], lora_id=lora_id))
                    _share(c, self.base, self._share_cost)
                    self._made[(lora_id, group)] = c
        return c

    def all(self) -> list:
        with self._lock:
            return list(self._made.values())


def _share(client, base, cost: bool) -> None:
    """`client` counts into `base`'s counters (and learns into its cost model: `cost`)."""
    client.share(base, cost=cost)
