"""Generation counters: one number per (spec, salt) root that a cache-wide clear raises. An engine that clears a
spec's cache (SGLang's `clear()`) starts a new generation, and the generation names the directory group its pages
register in, so the old generation's entries are never read again.

    Generations(conn, keys)
      key(root) -> str                         the counter's key (`P:sglang:{<root hex>}:gen`)
      read(root) -> int | None                 reads: the counter, None where it is missing
      raise_to(root, at_least, step, start)    mutates: at least `at_least` (a missing counter starts at `start`),
                                               then `step` more, in one atomic step; returns the new value
    generation_group(root, generation)         the directory group of one generation
    fresh_start()                              a random start for a counter nobody can vouch for

The policy (who may put back a lost counter, when a clear raises it) is the engine's
(`kvmesh.integrations.sglang_generation`); this module is the counter's storage.
"""

from __future__ import annotations

import hashlib
import secrets

import redis

from kvmesh.hashing import HASH_BYTES

# raised to at least ARGV[1] (what the caller knows), then by ARGV[2]: one atomic step. A counter that is not there
# starts at ARGV[3], a random number (GEN_START): a Redis that lost the counter (its data) while every engine that
# knew it restarted must not send them back to a generation the nodes still hold pages of from before a clear
# (they re-register everything they hold after such a loss). So a generation is never 0 either.
RAISE_TO = """
local v = tonumber(redis.call('GET', KEYS[1]) or ARGV[3])
if v < tonumber(ARGV[1]) then v = tonumber(ARGV[1]) end
v = v + tonumber(ARGV[2])
redis.call('SET', KEYS[1], v)
return v
"""
GEN_START = 1 << 40  # a missing counter starts at a random number in [1, GEN_START] (exact in Lua's doubles and in
# every number-to-string conversion Redis's Lua makes; a clash with one earlier generation: 2^-40)


def fresh_start() -> int:
    return 1 + secrets.randbelow(GEN_START)


def generation_key(key_prefix: str, root: bytes) -> str:
    """The Redis key of the generation counter of (spec, salt) `root`."""
    return f"{key_prefix}:sglang:{{{root.hex()}}}:gen"


def generation_group(root: bytes, generation: int) -> bytes:
    return hashlib.blake2b(
        root + generation.to_bytes(8, "little"), digest_size=HASH_BYTES, person=b"kvmesh.sglgrp"
    ).digest()


class Generations:
    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self._redis, self.prefix = client, prefix

    def key(self, root: bytes) -> str:
        return generation_key(self.prefix, root)

    def read(self, root: bytes) -> int | None:
        raw = self._redis.get(self.key(root))
        return None if raw is None else int(raw)

    def raise_to(self, root: bytes, at_least: int, step: int, start: int) -> int:
        return int(self._redis.eval(RAISE_TO, 1, self.key(root), at_least, step, start))
