"""`KVMeshClient`: what a worker uses. Obtain one with `kvmesh.connect(spec)` in any Ray driver, task or actor (or
`connect_local(spec, node)` beside a KVNode object, without Ray).

    lookup(tokens) -> Match          pure read, one directory round trip: the longest cached prefix, whole chunks,
                                     with the live holders of each chunk and the cost model's plan
    fetch(match) -> Tensor           the matched chunks in this process (CPU, or a CUDA device), through the data
                                     plane (`kvmesh.dataplane`): same-node chunks straight from the node's
                                     shared-memory slab, peer chunks from the holders' data servers (or Ray's
                                     object store, or through this node's KVNode with `coalesce_pulls`), runs from
                                     different holders in parallel. Whatever fails, is corrupt or misses the
                                     deadline truncates the result to the intact leading part; the caller
                                     recomputes the rest. `last_fetch` says what happened; the
                                     metrics count the delivered tokens as reused (`record_request`)
    fetch_with_stats(match) -> Fetched   the same, with what happened: `Fetched(kv, stats)` (`last_fetch` holds the
                                     stats of the client's latest fetch, whichever thread made it)
    fetch_to_device(match, device)   the same onto a device, layer group by layer group, for a consumer that starts
                                     on layer i while later layers load (`movers.LayerwiseLoad`)
    store(tokens, kv) -> int         hands the full chunks not already cached to the local KVNode and returns their
                                     count; the copy into the node happens in the background (`flush` waits)
    lookup_keys / store_keys         the same for engines that name their pages themselves (SGLang; `clientkeys`)
    route(tokens, candidates)        pure read, one directory round trip: each candidate node's (or replica's)
                                     expected TTFT for the prompt, best first (`kvmesh.routing`)
    report_load(pending, depth, replica_id)   a serving replica's load, which `route` reads

The client is a facade over parts that own their state: a `NodeView` (node table + the one directory circuit
breaker), `Lookups` (what recent lookups saw, the spec-mismatch probe, the one breaker-guarded directory call),
a `LocalAttachment` (its KVNode's handle, slab, relay file, GPU reads, peers' handles), `Fetches` (the `Fetcher`
and its threads, the fetches in flight), a `StoreQueue`, and `ClientTelemetry` (counters, cost model, exporter).
`connect`/`connect_local` live in `kvmesh.connecting`, the argument checks in `kvmesh.arguments`.
Every checksum is verified when bytes cross into this process. Bad arguments raise `TypeError`/`ValueError`
naming the argument; failures of peers or Redis never raise out of these calls.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from dataclasses import replace

import redis
import torch

from kvmesh import arguments, routing
from kvmesh.arguments import MAX_DEADLINE_S
from kvmesh.attachment import LocalAttachment
from kvmesh.clientfetch import CLOSE_WAIT_S, PULL_THREADS, Fetches
from kvmesh.clientkeys import ByKeys
from kvmesh.clienttelemetry import ClientTelemetry
from kvmesh.config import KVMeshConfig
from kvmesh.cost import LoadPlan
from kvmesh.dataplane.fetcher import FetchOptions
from kvmesh.dataplane.sinks import HostSink, Sink
from kvmesh.directory import Directory, horizon_for
from kvmesh.forks import check_owner
from kvmesh.hashing import as_tokens, call_salt, chunk_hashes, client_salt
from kvmesh.lookups import MAX_MISMATCH_SPECS, MAX_SEEN, SEEN_TTL_S, Lookups, prompt_hashes
from kvmesh.match import ChunkMatch, Fetched, FetchStats, Match, StoreResult
from kvmesh.nodeview import NodeView, relayed
from kvmesh.spec import KVSpec
from kvmesh.storequeue import StoreQueue
from kvmesh.telemetry import ClientExporter, Records

__all__ = ["KVMeshClient", "Match", "ChunkMatch", "FetchStats", "Fetched", "StoreResult"]
__all__ += ["MAX_DEADLINE_S", "CLOSE_WAIT_S", "PULL_THREADS", "SEEN_TTL_S", "MAX_SEEN", "MAX_MISMATCH_SPECS"]
log = logging.getLogger("kvmesh.client")
DIRECTORY_RETRY_S = 5.0  # after a directory call failed, calls fail fast this long (or until a node-table read works)

# Slab and object-store buffers are read-only; torch warns when wrapping them. We only ever read them.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class KVMeshClient(ByKeys):
    def __init__(
        self,
        spec: KVSpec,
        config: KVMeshConfig,
        node_id: str | None,
        local=None,
        local_slab: tuple[str, int, int] | None = None,
        cache_salt: str | bytes | None = None,
        peers=None,
        gpu_exports: tuple[bytes, ...] = (),
        count_fetches: bool = True,
    ) -> None:
        """`local`: a handle of this node's KVNode (`handle.NodeHandle`, or `LocalHandle` without Ray);
        `local_slab`: its slab (path, bytes, slot bytes); `peers`: node id -> handle of another node's KVNode
        (default: found through Ray); `gpu_exports`: its GPU tier's pools, read device to device where CUDA IPC
        works here; `count_fetches`: see `record_request`."""
        self.spec = spec
        self.config = config
        self.node_id = node_id
        self._pid = os.getpid()  # the process the client belongs to (its threads, Ray handles, sockets)
        self.cache_salt = client_salt(cache_salt)
        self.count_fetches = count_fetches  # whether a fetch counts its tokens as reused (record_request says why)
        self.last_fetch = FetchStats(0, 0, 0.0)
        self.last_store = StoreResult(0)
        self.directory = Directory(config.redis_url, config.key_prefix, timeout_s=config.lookup_timeout_s)
        self.directory.table_horizon_ms = horizon_for(config.node_refresh_s)
        exporter = ClientExporter(Records(self.directory.redis, config.key_prefix), node_id or "")
        self.telemetry = ClientTelemetry(exporter, spec, node_id, count_fetches)
        self.attachment = att = LocalAttachment(node_id, local, local_slab, peers, gpu_exports, self.telemetry)
        # the node table as this node's KVNode relays it (one reader of Redis per node), else from Redis
        self.view = NodeView(
            relayed(lambda: att.table_file, self.directory.node_table, 2 * config.node_refresh_s),
            DIRECTORY_RETRY_S,
            config.node_refresh_s,
            direct=self.directory.node_table,
        )
        att.view = self.view
        self.lookups = Lookups(spec, self.directory, self.view, node_id, self.telemetry)
        self._closed = threading.Event()
        self.fetches = Fetches(spec, config, att, self.view, self._closed)
        # stores of GPU KV go device to device into the node's GPU tier through the pools mapped for reads
        self.stores = StoreQueue(spec, local, self.telemetry, gpu=lambda: att.gpu) if local is not None else None
        if self.stores is not None:
            att.on_replaced = self.stores.attach
        try:
            self.directory.register_spec(spec.model_id, spec.canonical_bytes())
        except redis.RedisError:
            pass
        self.view.refresh(direct=True)  # (the relay may predate a node that joined a moment ago)
        self._refresher = threading.Thread(target=self._refresh_loop, name="kvmesh-client-nodes", daemon=True)
        self._refresher.start()

    # the parts' state, read where it was read before the parts were
    counts = property(lambda self: self.telemetry.counts, doc="the client's counters (shared with `share`)")
    cost = property(lambda self: self.telemetry.cost, doc="the cost model, learned from this client's fetches")
    fetcher = property(lambda self: self.fetches.fetcher, doc="the data plane's `Fetcher` of this client")
    _slab_path = property(lambda self: self.attachment.slab_path)
    # (bench/gpu_vllm.py times device fetches with other checksum threads)
    _verify_pool = property(
        lambda self: self.fetches.verify_pool, lambda self, p: setattr(self.fetches, "verify_pool", p)
    )

    # -- lookup -------------------------------------------------------------------------------------------------
    def _salt(self, cache_salt) -> bytes:
        """The salt of one call: the client's with the call's own behind it (`hashing.call_salt`)."""
        return call_salt(self.cache_salt, cache_salt)

    def hashes(self, tokens, cache_salt: str | bytes | None = None) -> list[bytes]:
        """Chunk hashes of the full chunks of `tokens` under this client's spec and salt."""
        return chunk_hashes(self.spec.namespace, as_tokens(tokens), self.spec.chunk_tokens, self._salt(cache_salt))

    def lookup(
        self,
        tokens,
        cache_salt: str | bytes | None = None,
        *,
        max_chunks: int | None = None,
        allow_split: bool = True,
        cost_model: bool = True,
        count: bool = True,
    ) -> Match:
        """`max_chunks` caps the chunks looked up (an engine must compute at least the prompt's last token);
        the plan still prices the whole prompt. `allow_split=False` plans only load-or-recompute, for engines
        that cannot compute a front part while the rest loads. `cost_model=False`: the caller loads whatever is
        cached (no plan; a cached prefix counts as a hit, never as the cost model's miss). `count=False`: not
        counted as a lookup, hit, miss or plan (an engine asking again about a request it already looked up)."""
        self._check_open("lookup")
        for name, value in (("allow_split", allow_split), ("cost_model", cost_model), ("count", count)):
            arguments.flag(name, value)
        toks, salt, hashes = prompt_hashes(self.spec, tokens, lambda: self._salt(cache_salt), max_chunks)
        match = self.lookups.lookup(toks, hashes, salt, count)
        if cost_model:
            match = replace(match, plan=self.plan(match, len(toks), allow_split=allow_split, count=count))
        if match.chunks and count:
            self.counts["miss_cost_model" if match.plan is not None and match.plan.end == 0 else "hits"] += 1
        return match

    def record_request(self, reused_local: int, reused_peer: int, recomputed: int) -> None:
        """Integrations report each request's prompt tokens by where their KV came from (for the metrics).

        Reused tokens are counted in one place per client, never twice. By default (`count_fetches`) a fetch counts
        the tokens it delivered, local or peer, whoever called it (the raw API, hf, SGLang), and the reuse given
        here is not added again: only `recomputed` is. A client made with `count_fetches=False` (vLLM's: its
        workers fetch per TP rank and per KV group, and the scheduler knows the request) counts reuse here."""
        for name, n in (("reused_local", reused_local), ("reused_peer", reused_peer), ("recomputed", recomputed)):
            arguments.non_negative_int(name, n, " (tokens)")
        self.telemetry.record_request(reused_local, reused_peer, recomputed)

    def plan(self, match: Match, prompt_tokens: int, allow_split: bool = True, count: bool = True) -> LoadPlan:
        """The cost model's plan for using `match` in a prompt of `prompt_tokens` tokens."""
        if not isinstance(match, Match):
            raise TypeError(f"match must be a kvmesh Match from lookup(), got {type(match).__name__}")
        arguments.non_negative_int("prompt_tokens", prompt_tokens)
        arguments.flag("allow_split", allow_split)
        arguments.flag("count", count)
        return self.telemetry.plan(match, prompt_tokens, allow_split, count)

    # -- fetch --------------------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether `close()` was called: every call that reads or writes the cache then raises ValueError."""
        return self._closed.is_set()

    def _check_open(self, what: str) -> None:
        """Every call that reads or writes the cache refuses a closed client (its fetch threads are gone, and a
        call would reopen directory connections that nothing closes)."""
        if self._closed.is_set():
            raise ValueError(f"{what} on a closed KVMeshClient")
        self._check_process(what)

    def _check_process(self, what: str) -> None:
        check_owner(self._pid, what)  # (a client belongs to the process that made it: `forks.check_owner` says why)

    def _begin(self, match: Match, deadline_s, min_copy_bytes: int = 0) -> FetchOptions:
        self._check_open("fetch")
        arguments.match(self.spec, match)
        arguments.non_negative_int("min_copy_bytes", min_copy_bytes)
        arguments.deadline(deadline_s)
        return self.fetches.options(match, deadline_s)

    def fetch(
        self,
        match: Match,
        device: str | torch.device = "cpu",
        deadline_s: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """KV of the matched prefix, `[num_layers, 2, tokens, num_kv_heads, head_dim]`; `tokens` is
        `match.num_tokens` or, if part of the pull failed, the whole chunks before the first failure.

        `out`, a contiguous CPU tensor of the spec's dtype and shape `[num_layers, 2, >= match.num_tokens,
        num_kv_heads, head_dim]`, receives the chunks (an engine's preallocated buffer); the result is then a
        view of it. Without it a new tensor is allocated, whose first touch costs as much as the copy. Only the
        returned part of `out` is meaningful: bytes after it may have been written by a run that came too late."""
        return self.fetch_with_stats(match, device, deadline_s, out).kv

    def fetch_with_stats(
        self,
        match: Match,
        device: str | torch.device = "cpu",
        deadline_s: float | None = None,
        out: torch.Tensor | None = None,
    ) -> Fetched:
        """`fetch`, returning `Fetched(kv, stats)`: this fetch's own `FetchStats` with its result, where
        `last_fetch` is the latest fetch's of any thread that shares the client."""
        opts = self._begin(match, deadline_s)
        device = arguments.device(device)
        if out is not None:
            arguments.out(self.spec, out, match.num_tokens)
        if device.type == "cuda" and out is None:  # DMA straight from the slab; verified before it is returned
            (load, n), st = self._run(match, self.fetches.device_sink(device), opts, device)
            return Fetched(self.fetches.verified_tensor(load, n, device), st)
        if out is None:
            out = torch.empty(self.spec.kv_shape(match.num_tokens), dtype=self.spec.torch_dtype)
        kv, st = self._run(match, HostSink(self.spec, out), opts, device)
        return Fetched(kv if device.type == "cpu" else kv.to(device, non_blocking=True), st)

    def fetch_to_device(
        self, match: Match, device: str | torch.device, deadline_s: float | None = None, min_copy_bytes: int = 8 << 20
    ):
        """Land the matched chunks on a device, layer group by layer group (`movers.LayerwiseLoad`): same-node
        chunks are copied by DMA straight from the node's page-locked slab, peer chunks first into page-locked
        staging that belongs to this fetch. Checksums of the slab chunks are verified by CPU threads while the DMA
        runs (`load.verified()`; a consumer must not use what it computed from a load that fails it). Returns
        (load or None, chunks in it); call `load.release()` when done (it unpins the slab chunks), or use the load
        as a context manager; `close()` releases those still held."""
        opts = self._begin(match, deadline_s, min_copy_bytes)
        device = arguments.device(device)
        (load, n), _ = self._run(match, self.fetches.device_sink(device, min_copy_bytes), opts, device)
        self.fetches.keep(load)
        return load, n

    def _run(self, match: Match, sink: Sink, opts: FetchOptions, device: torch.device):
        result, stats = self.fetches.run(match, sink, opts)
        self.last_fetch = stats
        self.telemetry.record_fetch(match, stats, device)
        if stats.chunks < match.num_chunks:
            self.lookups.forget(match.chunks[stats.chunks :])
        return result, stats

    def scratch(self, num_tokens: int) -> torch.Tensor:
        """A reusable, already-touched CPU buffer for `fetch(..., out=)`, valid until the next call: for callers
        that copy the fetched KV elsewhere at once (a fresh allocation's page faults cost as much as the copy)."""
        arguments.non_negative_int("num_tokens", num_tokens)
        return self.fetches.scratch(num_tokens)  # shape[2] >= num_tokens; fetch fills the front

    # -- store --------------------------------------------------------------------------------------------------
    def store(self, tokens, kv: torch.Tensor, cache_salt: str | bytes | None = None, *, handover: bool = False) -> int:
        """Store the full chunks of `tokens` not already cached; `kv` is `[num_layers, 2, n, num_kv_heads,
        head_dim]` with `n >= len(tokens)`. Returns the number of chunks handed to the local node (`last_store`
        says what became of the others). The KV is read as it is now (on a GPU: copied on the current stream before
        this returns, without waiting for it): the caller may overwrite or free it at once. `handover=True`: the
        caller will never write `kv` again (a tensor made for this store), so a GPU store reads it as it is,
        without that copy (and its device memory)."""
        self._check_open("store")
        arguments.flag("handover", handover)
        toks = as_tokens(tokens)
        kv = arguments.kv(self.spec, kv, len(toks))
        hashes = chunk_hashes(self.spec.namespace, toks, self.spec.chunk_tokens, self._salt(cache_salt))
        c = self.spec.chunk_tokens
        return self._store(
            hashes[0] if hashes else b"", hashes, lambda i: kv[:, :, i * c : (i + 1) * c], True, not handover
        ).handed

    def _store(
        self, group: bytes, keys: list[bytes], chunk, seen: bool, snapshot: bool = True, mine: list | None = None
    ) -> StoreResult:
        if not keys:
            self.last_store = StoreResult(0)
        elif self.stores is None:
            self.counts["store_no_local_node"] += 1
            self.last_store = StoreResult(0, 0, len(keys), "no_local_node")
        else:
            self.last_store = self.stores.store(
                group, keys, chunk, self.lookups.held(group, keys, seen), snapshot, mine
            )
            if self.last_store.handed:
                self.directory.touched(group)
        return self.last_store

    def flush(self, timeout_s: float = 30.0) -> int:
        """Wait until every store handed over so far (by any thread) is in the node's tier and registered; returns
        how many chunks the node actually stored of the stores no earlier flush counted (with several threads
        flushing at once, each store is counted by the first flush that reads its reply)."""
        arguments.seconds("timeout_s", timeout_s)
        self._check_process("flush")
        return self.stores.flush(timeout_s) if self.stores is not None else 0

    # -- placement (kvmesh.routing) -------------------------------------------------------------------------------
    def route(
        self, tokens, candidates, cache_salt: str | bytes | None = None, *, prefill_tokens_per_s: float | None = None
    ) -> list[routing.RouteEstimate]:
        """Each candidate's expected time to first token for `tokens`, best first; `candidates` are Ray node ids
        or replicas with a `node_id`. A directory failure gives `known=False` estimates, never an exception."""
        self._check_open("route")
        return routing.route(self, tokens, candidates, cache_salt, prefill_tokens_per_s=prefill_tokens_per_s)

    def report_load(self, pending_prefill_tokens: int, queue_depth: int, replica_id: str) -> bool:
        """Publish this replica's load for `route` (False: the directory did not take it)."""
        self._check_open("report_load")
        return routing.report_load(self, pending_prefill_tokens, queue_depth, replica_id)

    # -- background ---------------------------------------------------------------------------------------------
    def _refresh_loop(self) -> None:
        while not self._closed.wait(self.config.node_refresh_s):
            try:
                self.view.refresh()
                self.attachment.follow_nodes()
                if len(self.attachment.orphans):
                    self.attachment.orphans.reap()
                self._flush_telemetry()
            except Exception as e:  # never let the refresher die: the node table would freeze with it
                log.exception("kvmesh client: background refresh failed: %s", e)

    def share(self, other: KVMeshClient, cost: bool = False) -> None:
        """Count into `other`'s counters from now on (an engine's clients, one per LoRA adapter or KV cache group,
        report as one), stores included, each change exported once (`ClientTelemetry.share`); `cost`: learn into
        `other`'s cost model too."""
        self.telemetry.share(other.telemetry, cost)

    def share_counts(self, other: KVMeshClient) -> None:
        """`share(other)` (its earlier name)."""
        self.share(other)

    def _flush_telemetry(self) -> None:
        self.telemetry.flush(self.view.errors)

    def close(self) -> None:
        if os.getpid() != self._pid:  # a forked child's copy: only what this process holds goes (no Ray call, which
            self._close_copy()  # would never be answered, no telemetry, which the parent exports)
            return
        if self.stores is not None:
            self.stores.close()
        self.fetches.close_and_wait()  # (fetches in flight end first: their threads and slab stay until then)
        self._refresher.join(timeout=2)
        if len(self.attachment.orphans):  # pins of this client that came too late: released now, not at their TTL
            self.attachment.orphans.reap(timeout=2.0)
        self._flush_telemetry()
        self.attachment.close()
        self.fetches.close()
        self.directory.close()

    def _close_copy(self) -> None:
        """close() in a process forked from the client's: marks it closed and nothing else. Its mapping and sockets
        here are this process's copies, released when it exits; closing them would take locks that a thread of the
        parent may have held at the fork (a child that waits on one for good)."""
        self._closed.set()

    def __enter__(self) -> KVMeshClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
