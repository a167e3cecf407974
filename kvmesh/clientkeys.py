"""The client's calls by explicit chunk keys (`ByKeys`, a part of `KVMeshClient`'s API), for engines that name their
pages themselves (SGLang's HiCache hands out page hashes, never token ids): the caller derives each key under the
client's spec namespace and salt (`root_hash`), so keys of different specs never meet, and names the directory
group they are registered in. They go through the client's own parts: its `Lookups` and its store path."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from kvmesh import arguments
from kvmesh.match import StoreResult

if TYPE_CHECKING:
    from kvmesh.lookups import Lookups
    from kvmesh.match import Match
    from kvmesh.spec import KVSpec
    from kvmesh.storequeue import StoreQueue


class ByKeys:
    spec: KVSpec
    lookups: Lookups
    stores: StoreQueue | None

    def _check_open(self, what: str) -> None:
        raise NotImplementedError

    def _store(
        self, group: bytes, keys: list[bytes], chunk, seen: bool, snapshot: bool = True, mine=None
    ) -> StoreResult:
        raise NotImplementedError

    def lookup_keys(self, group: bytes, keys: list[bytes], count: bool = True) -> Match:
        """`lookup` for caller-made keys: the longest run of `keys`, from the first, with a live holder in
        directory group `group`. Pure read, one round trip; no cost-model plan (the engine decides). `count=False`:
        not counted as a lookup, hit or miss (an engine asking again about keys it already looked up)."""
        self._check_open("lookup_keys")
        arguments.flag("count", count)
        arguments.keys(group, keys)
        return self.lookups.lookup_keys(group, keys, count)

    def held_keys(self, group: bytes, keys: list[bytes], count: bool = True) -> list[bool]:
        """Whether each of `keys` has a live holder in directory group `group`, each key for itself (`lookup_keys`
        answers only the leading run): for engines that ask about keys in another order than the prompt's, e.g.
        vLLM's sliding-window lookups, from the prompt's end backwards. One round trip; a directory that fails
        says "none" (counted, like a lookup's)."""
        self._check_open("held_keys")
        arguments.flag("count", count)
        arguments.keys(group, keys)
        return self.lookups.held_each(group, keys, count)

    def store_keys(self, group: bytes, keys: list[bytes], chunks, *, handover: bool = False) -> StoreResult:
        """`store` for caller-made keys: `chunks[i]` (a tensor of the spec's dtype and `chunk_shape`, any
        strides, e.g. a view into an engine's host pool; all on one device) is chunk `keys[i]`, registered in
        directory group `group`. Those not already cached are copied out before this returns (on a GPU: on the
        current stream) and handed to the local node. The result says how many were handed over, already cached,
        or dropped and why (`StoreResult.ok`: none dropped). `handover=True`: the caller never writes the chunks
        again (tensors made for this store), so a GPU store reads them as they are, without a snapshot copy."""
        arguments.flag("handover", handover)
        return self._store_keys(group, keys, chunks, snapshot=not handover)

    def _store_keys(
        self, group: bytes, keys: list[bytes], chunks, mine: list | None = None, snapshot: bool = True
    ) -> StoreResult:
        self._check_open("store_keys")
        arguments.keys(group, keys)
        arguments.chunks(self.spec, chunks, len(keys))
        return self._store(group, list(keys), lambda i: chunks[i], False, snapshot, mine)

    def store_keys_waited(self, group: bytes, keys: list[bytes], chunks, timeout_s: float) -> StoreResult:
        """`store_keys`, then wait at most `timeout_s` for this store alone: the result's `stored` is how many of the
        chunks handed to the node it stored and registered by then (a chunk it refused after receiving it, or one
        not done in time, is not; `ok` is False then). Other stores in flight (an earlier one whose wait ran out
        and whose reply comes now) are not counted: `flush` counts them all."""
        arguments.seconds("timeout_s", timeout_s)
        mine: list = []
        res = self._store_keys(group, keys, chunks, mine)
        if not res.handed or self.stores is None:
            return replace(res, stored=0)
        if len(chunks) and chunks[0].is_cuda:  # (handed over by the background thread: not collected)
            return replace(res, stored=self.stores.flush(timeout_s))
        return replace(res, stored=self.stores.flush_own(mine, timeout_s))
