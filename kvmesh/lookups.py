"""`Lookups`: a client's reads of the directory. It owns what recent lookups saw (`seen`: a store that follows its
lookup is spared the round trip), the spec-mismatch probe of a miss, and the one call that asks the directory
behind the view's circuit breaker (`ask`), which the prefix lookups, a store's check and `held_keys` all go
through: a directory that failed moments ago is not asked (a fast miss instead of a timeout per call), and a
failure is counted and opens the breaker."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import redis

from kvmesh import arguments
from kvmesh.clienttelemetry import ClientTelemetry
from kvmesh.directory import Directory, Holder
from kvmesh.hashing import as_tokens, chunk_hashes
from kvmesh.match import ChunkMatch, Match
from kvmesh.nodeview import NodeView
from kvmesh.spec import KVSpec

log = logging.getLogger("kvmesh.client")
SEEN_TTL_S = 30.0  # what a lookup saw of a prompt's chunks spares its store the directory round trip this long
MAX_SEEN = 4096  # hashes remembered per client (a store follows its lookup closely): ~1 MiB at most
MAX_MISMATCH_SPECS = 64  # other specs of the model a miss asks about (an extra hash and EXISTS each)
T = TypeVar("T")


def prompt_hashes(
    spec: KVSpec, tokens, salt: Callable[[], bytes], max_chunks=None
) -> tuple[np.ndarray, bytes, list[bytes]]:
    """What a lookup does before its round trip: the prompt's tokens (checked), its salt (`salt()`, checked after
    the tokens and `max_chunks`) and the hashes of its full chunks, the first `max_chunks` of them at most.
    (bench/directory.py's lookup_list_131k_client_ms times this.)"""
    toks = as_tokens(tokens)
    if max_chunks is not None:
        arguments.non_negative_int("max_chunks", max_chunks)
    s = salt()
    limit = len(toks) if max_chunks is None else min(len(toks), int(max_chunks) * spec.chunk_tokens)
    return toks, s, chunk_hashes(spec.namespace, toks[:limit], spec.chunk_tokens, s)


def _spec_or_none(data: bytes) -> KVSpec | None:
    try:
        return KVSpec.from_canonical_bytes(data)
    except (ValueError, TypeError):
        return None


class Lookups:
    def __init__(
        self, spec: KVSpec, directory: Directory, view: NodeView, node_id: str | None, telemetry: ClientTelemetry
    ) -> None:
        self.spec, self.directory, self.view, self.node_id = spec, directory, view, node_id
        self.telemetry = telemetry
        self.seen: dict[bytes, tuple[bool, float]] = {}  # chunk hash -> (cached, when) as a recent lookup saw it
        self._other_specs: list[KVSpec] = []
        self._specs_at = -1e9

    def ask(self, call: Callable[[], T], quiet: bool = False) -> T | None:
        """`call()` (a directory read), behind the breaker: None where the breaker is open or the call failed
        (counted, and the breaker told). `quiet`: a store's check, neither counted as skipped nor timed."""
        counts = self.telemetry.counts
        if not self.view.allow():
            if not quiet:
                counts["directory_skipped"] += 1
            return None
        t0 = time.monotonic()
        try:
            out = call()
        except redis.RedisError as e:
            log.debug("lookup failed: %s", e)
            self.telemetry.counts["directory_errors"] += 1
            self.view.failed()
            return None
        if not quiet:
            self.telemetry.samples.append(("rtt", "", time.monotonic() - t0))
        return out

    def _holders(self, group: bytes, hashes: list[bytes]) -> Callable[[], list[tuple[Holder, ...]]]:
        v = self.view
        return lambda: self.directory.holders(group, hashes, v.table(), prefer=self.node_id, newer=v.current)

    def prefix(
        self, group: bytes, hashes: list[bytes], chained: bool = False
    ) -> tuple[list[tuple[Holder, ...]], str | None]:
        """The directory's longest live prefix of `hashes`, and why it ends there. `chained`: `hashes` are this
        client's own chain of a prompt (`chunk_hashes`), whose buckets have summaries; keys an engine names may
        not chain."""
        if not hashes:
            return [], None
        v = self.view
        out = self.ask(
            lambda: self.directory.lookup(
                group, hashes, v.table(), prefer=self.node_id, newer=v.current, chained=chained
            )
        )
        return out if out is not None else ([], "directory_error")

    def lookup(self, toks: np.ndarray, hashes: list[bytes], salt: bytes, count: bool) -> Match:
        """The match of a prompt's chunk hashes (no plan), counted as a lookup and, when empty, as a miss by why.
        `count=False`: nothing counted."""
        counts = self.telemetry.counts if count else Counter()
        counts["lookups"] += bool(hashes)  # (no full chunk: nothing could be cached, nothing is asked)
        holders, why = self.prefix(hashes[0] if hashes else b"", hashes, chained=True)
        chunks = tuple(ChunkMatch(h, hs) for h, hs in zip(hashes, holders))
        if why != "directory_error":
            self.remember(hashes, len(chunks))
        if not chunks and hashes:
            if why == "not_cached" and self.cached_elsewhere(toks, salt):
                why = "spec_mismatch"
            counts[f"miss_{why}"] += 1
        s = self.spec
        return Match(s.namespace, s.chunk_tokens, chunks, why=why or "", group=hashes[0] if hashes else b"")

    def lookup_keys(self, group: bytes, keys: list[bytes], count: bool) -> Match:
        holders, why = self.prefix(group, keys)
        chunks = tuple(ChunkMatch(k, hs) for k, hs in zip(keys, holders))
        if keys and count:
            self.telemetry.counts["lookups"] += 1
            self.telemetry.counts["hits" if chunks else f"miss_{why}"] += 1
        return Match(self.spec.namespace, self.spec.chunk_tokens, chunks, why=why or "", group=group)

    def held_each(self, group: bytes, keys: list[bytes], count: bool) -> list[bool]:
        """Whether each of `keys` has a live holder (`held_keys`): "none" where the directory fails (counted)."""
        if not keys:
            return []
        holders = self.ask(self._holders(group, list(keys)))
        held = [bool(hs) for hs in holders] if holders is not None else [False] * len(keys)
        if count:
            self.telemetry.counts["lookups"] += 1
            why = "not_cached" if holders is not None else "directory_error"
            self.telemetry.counts["hits" if any(held) else f"miss_{why}"] += 1
        return held

    def held(self, group: bytes, hashes: list[bytes], seen: bool) -> list[bool]:
        """Whether each of `hashes` is cached somewhere (a store skips those). A directory that does not answer
        says "none": the node stores what it does not hold, nothing is lost. `seen`: what a recent lookup saw
        may answer instead of the directory."""
        held = self.recently_seen(hashes) if seen else None  # usually: the store's own lookup saw them all
        if held is not None:
            self.telemetry.counts["store_checked_by_lookup"] += 1
            return held
        holders = self.ask(self._holders(group, hashes), quiet=True)
        return [bool(hs) for hs in holders] if holders is not None else [False] * len(hashes)

    def cached_elsewhere(self, toks, salt: bytes) -> bool:
        """On a miss: does another spec of the same model hold this prompt's first chunk? (One extra round trip,
        misses only, with the list of specs cached for a while.) Turns a silent 0 % hit rate from a dtype, TP or
        layout difference into a counted "spec_mismatch". Specs that differ from this one only in their LoRA
        adapter do not count, and at most MAX_MISMATCH_SPECS others are asked."""
        now = time.monotonic()
        if now - self._specs_at > 10.0:
            try:
                # (another LoRA adapter's KV is another KV, not a setting gone wrong: and with hundreds of
                # adapters of one model, hashing the prompt for each made every miss milliseconds long)
                self._other_specs = [
                    x
                    for x in map(_spec_or_none, self.directory.specs_of(self.spec.model_id))
                    if x is not None and x != self.spec and x.lora_id == self.spec.lora_id
                ][:MAX_MISMATCH_SPECS]
            except redis.RedisError:
                self._other_specs = []
            self._specs_at = now
        if not self._other_specs or len(toks) < self.spec.chunk_tokens:
            return False
        firsts = []
        for other in self._other_specs:
            h = chunk_hashes(other.namespace, toks[: other.chunk_tokens], other.chunk_tokens, salt)
            if h:
                firsts.append(h[0])
        try:
            return any(self.directory.groups_exist(firsts))
        except redis.RedisError:
            return False

    def remember(self, hashes: list[bytes], cached: int) -> None:
        """A lookup saw the first `cached` of `hashes` cached and the rest not: what `store` needs to know."""
        if len(self.seen) + len(hashes) > MAX_SEEN:
            self.seen = {}
        now = time.monotonic()
        for i, h in enumerate(hashes):
            self.seen[h] = (i < cached, now)

    def forget(self, chunks) -> None:
        """What did not arrive is not cached for this worker's store: it recomputes and stores it (a holder that
        failed may stay listed until its lease lapses)."""
        now = time.monotonic()
        for c in chunks:
            if c.hash in self.seen:
                self.seen[c.hash] = (False, now)

    def recently_seen(self, hashes: list[bytes]) -> list[bool] | None:
        """Whether each of `hashes` was cached, if a lookup in the last SEEN_TTL_S saw all of them."""
        now = time.monotonic()
        out = []
        for h in hashes:
            hit = self.seen.get(h)
            if hit is None or now - hit[1] > SEEN_TTL_S:
                return None
            out.append(hit[0])
        return out
