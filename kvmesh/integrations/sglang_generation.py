"""The generation counter of the SGLang backend: `clear()` starts a new generation of a (spec, salt), cluster-wide
(see kvmesh.integrations.sglang for the key layout).

    GenerationCounter                            KVMeshStorage's part that reads, puts back and raises the counter
                                                 (stored by the directory: `Directory.generations`)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from kvmesh.directory.generations import fresh_start, generation_group

if TYPE_CHECKING:
    from kvmesh.client import KVMeshClient

log = logging.getLogger("kvmesh.sglang")
# Only an engine that read the counter lately (`_trust_s`) puts back what it knows: one idle since then may have
# missed a clear, and putting back the generation that clear left would bring its pages back for everyone. The
# counter itself (its key, the atomic raise, why a missing one starts at a random number) is the directory's
# (`kvmesh.directory.generations`).


class GenerationCounter:
    """The generation state of a KVMeshStorage, which sets these attributes (in `__init__`, and anew whenever it
    registers a host pool of another spec) and holds `_gen_lock` around every change of them."""

    client: KVMeshClient | None
    options: dict
    counts: Counter[str]
    _gen_lock: threading.Lock
    _root: bytes  # the (spec, salt) root hash
    _generation: int  # the generation this engine knows (0: none yet)
    _group: bytes  # its directory group; b"" while the generation is unknown
    _gen_at: float  # when the counter was last asked for
    _gen_seen_at: float  # when it was last read (or put back) by this engine
    _gen_lost_at: float  # when this engine, too long idle to put it back, first found it missing

    def generation_key(self) -> str:
        """The Redis key of this engine's (spec, salt) counter (`Directory.generations`)."""
        assert self.client is not None, "registered"
        return self.client.directory.generations.key(self._root)

    def _trust_s(self) -> float:
        """How lately this engine must have read the counter to put back, when it is missing, the generation it
        knows (a clear reaches every engine within `generation_refresh_s`; this allows ten of those)."""
        return max(10 * self.options.get("generation_refresh_s", 1.0), 10.0)

    def _refresh_generation(self, force: bool = False) -> bytes:
        """The directory group of the current generation, re-read at most every `generation_refresh_s`; b"" while
        the generation is unknown (the counter is missing and this engine cannot vouch for the one it knew)."""
        now = time.monotonic()
        due = force or now - self._gen_at > self.options.get("generation_refresh_s", 1.0)
        # (not while the client's breaker is open: the directory failed moments ago, and a read would wait out
        # Redis's socket timeout on SGLang's prefetch thread, at every refresh, for nothing)
        client = self.client
        if due and (client is None or force or client.view.allow()):
            with self._gen_lock:
                self._gen_at = now
                client = self.client  # (the one of `_root` now: a re-registration may have switched both)
                try:
                    assert client is not None, "registered"
                    gen = self._read_generation(client.directory.generations, now)
                except Exception as e:  # Redis away: keep the last generation
                    self.counts["sglang_generation_errors"] += 1
                    log.debug("kvmesh: generation read failed: %s", e)
                    if client is not None:
                        client.view.failed()
                    gen = self._generation
                if gen is None:
                    self._group = b""
                elif gen != self._generation or not self._group:
                    self._generation, self._group = gen, generation_group(self._root, gen)
        return self._group

    def _read_generation(self, g, now: float) -> int | None:
        """The counter's value, put back first where it is missing or lower than what this engine knows and may
        vouch for (it read the counter within `_trust_s`); None: missing, and this engine may not put it back yet."""
        raw = g.read(self._root)
        vouch = bool(self._generation) and now - self._gen_seen_at <= self._trust_s()
        if raw is None:  # a new spec and salt, or a directory that lost the counter (its data, an older snapshot)
            if vouch:  # put back the generation this engine knows
                raw = g.raise_to(self._root, self._generation, 0, self._generation)
            elif not self._generation or now - (self._gen_lost_at or now) >= self._trust_s():
                # a first engine of this spec, or nobody who could vouch put it back in time: a random start
                raw = g.raise_to(self._root, 0, 0, fresh_start())
            else:  # an engine idle since its last read may have missed a clear: wait for one that has not
                if not self._gen_lost_at:
                    self._gen_lost_at = now
                    self.counts["sglang_generation_unknown"] += 1
                    log.warning(
                        "kvmesh: the generation counter is missing; waiting up to %.0f s for an engine that "
                        "knows the current generation to put it back (misses meanwhile)",
                        self._trust_s(),
                    )
                return None
        gen = int(raw)
        if gen < self._generation:  # the directory forgot it (lost its data, or went back to an older snapshot):
            # put back what this engine knows, or a later clear would reuse a generation whose pages the nodes
            # still hold (and re-register after such a loss): cleared pages back. One that cannot vouch for it
            # knows only that neither number is safe: a fresh one, above both
            at_least = self._generation if vouch else self._generation + fresh_start()
            gen = g.raise_to(self._root, at_least, 0, fresh_start())
        self._gen_seen_at, self._gen_lost_at = now, 0.0
        return gen

    def clear(self) -> None:
        """Forget every page of this spec and salt, cluster-wide: a new generation (engines of this spec see it
        within `generation_refresh_s`); the old directory group is deleted and nodes evict its bytes in time."""
        if self.client is None:
            return
        try:
            directory = self.client.directory
            old = self._refresh_generation(force=True)
            # (never a generation seen before: above what this engine knows, and where the counter is missing and
            # that may be out of date (`_read_generation`), above anything it could have been since)
            at_least = self._generation if old else self._generation + fresh_start()
            gen = directory.generations.raise_to(self._root, at_least, 1, fresh_start())
            if old:
                directory.redis.delete(*directory.group_keys(old))  # (its entries and its summaries: one slot)
            with self._gen_lock:  # (it wrote the counter: it knows the current generation)
                self._generation, self._group = gen, generation_group(self._root, gen)
                self._gen_seen_at, self._gen_lost_at = time.monotonic(), 0.0
            self.counts["sglang_clears"] += 1
        except Exception as e:
            self.counts["sglang_errors_clear"] += 1
            log.warning("kvmesh: clear failed: %s", e)
