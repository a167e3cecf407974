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
    fetch_to_device(match, device)   the same onto a device, layer group by layer group, for a consumer that starts
                                     on layer i while later layers load (`movers.LayerwiseLoad`)
    store(tokens, kv) -> int         hands the full chunks not already cached to the local KVNode and returns their
                                     count; the copy into the node happens in the background (`flush` waits)
    lookup_keys / store_keys         the same for engines that name their pages themselves (SGLang)
    route(tokens, candidates)        pure read, one directory round trip: each candidate node's (or replica's)
                                     expected TTFT for the prompt, best first (`kvmesh.routing`)
    report_load(pending, depth, replica_id)   a serving replica's load, which `route` reads

The client is a facade over parts that own their state: a `NodeView` (node table + the one directory circuit
breaker), a `Fetcher` (the pipeline), a `StoreQueue`, and typed handles of the KVNodes (`kvmesh.handle`).
Every checksum is verified when bytes cross into this process. Bad arguments raise `TypeError`/`ValueError`
naming the argument; failures of peers or Redis never raise out of these calls.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import redis
import torch

from kvmesh import routing
from kvmesh.config import KVMeshConfig, redact_url
from kvmesh.cost import CostModel, LinkModel, LoadPlan, measure_memcpy_bps
from kvmesh.dataplane.fetcher import Fetcher, FetchOptions
from kvmesh.dataplane.gpureads import GpuReads
from kvmesh.dataplane.sinks import DeviceSink, HostSink
from kvmesh.dataplane.sources import Env
from kvmesh.directory import Directory, Holder, horizon_for, probe
from kvmesh.forks import ForkedProcessError
from kvmesh.handle import LocalHandle, NodeHandle, NodeUnavailable, Orphans
from kvmesh.hashing import HASH_BYTES, as_tokens, chunk_hashes, client_salt, salt_bytes
from kvmesh.match import ChunkMatch, FetchStats, Match, StoreResult, link_observations
from kvmesh.nodeview import NodeView, TableFile, relayed
from kvmesh.spec import KVSpec
from kvmesh.storequeue import StoreQueue
from kvmesh.telemetry import ClientExporter, Records
from kvmesh.tiers import TIER_DISK, TIER_NAMES
from kvmesh.tiers.cpu import SlabReader
from kvmesh.transport import DataClient

__all__ = ["KVMeshClient", "Match", "ChunkMatch", "FetchStats", "StoreResult", "connect", "connect_local"]
log = logging.getLogger("kvmesh.client")
DIRECTORY_RETRY_S = 5.0  # after a directory call failed, calls fail fast this long (or until a node-table read works)
SEEN_TTL_S = 30.0  # what a lookup saw of a prompt's chunks spares its store the directory round trip this long
CLOSE_WAIT_S = 5.0  # close() waits at most this long for the fetches in flight to end
MAX_SEEN = 4096  # hashes remembered per client (a store follows its lookup closely): ~1 MiB at most
MAX_DEADLINE_S = 86400.0  # a fetch deadline longer than a day is a mistake (threading waits overflow near 1e10 s)
PULL_THREADS = 8  # concurrent peer receives of one client (runs from different holders, batches of one)
MAX_MISMATCH_SPECS = 64  # other specs of the model a miss asks about (an extra hash and EXISTS each)

# Slab and object-store buffers are read-only; torch warns when wrapping them. We only ever read them.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class KVMeshClient:
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
        self.counts: Counter[str] = Counter()
        self.last_fetch = FetchStats(0, 0, 0.0)
        self.last_store = StoreResult(0)
        # sources: "local" = this node's slab (calibrated here), "peer" = another node (learned from pulls)
        self.cost = CostModel(
            {
                "local": LinkModel(measure_memcpy_bps() / 2, 1e-3),
                "peer": LinkModel(1e9, 2e-3),
                "local-disk": LinkModel(5e8, 5e-3),
                "peer-disk": LinkModel(4e8, 6e-3),
            }
        )
        self.directory = Directory(config.redis_url, config.key_prefix, timeout_s=config.lookup_timeout_s)
        self.directory.table_horizon_ms = horizon_for(config.node_refresh_s)
        # the node table as this node's KVNode relays it (one reader of Redis per node), else from Redis
        self._table_file = TableFile.beside(local_slab[0]) if local_slab else None
        self.view = NodeView(
            relayed(lambda: self._table_file, self.directory.node_table, 2 * config.node_refresh_s),
            DIRECTORY_RETRY_S,
            config.node_refresh_s,
            direct=self.directory.node_table,
        )
        orphans = getattr(local, "orphans", None)  # replies of this client's calls that came too late
        self._orphans: Orphans = orphans if orphans is not None else Orphans()
        self._local = local
        self._peers_given = peers
        self._peers: dict[str, object] = {}
        self._peer_incs: dict[str, int] = {}  # node id -> its incarnation when its handle was looked up
        self._slab = SlabReader.open(*local_slab[:2]) if local_slab else None
        self._slab_path = local_slab[0] if local_slab else ""
        self._errors_counted = 0  # of view.errors, added to counts["directory_errors_total"] so far
        self._reattach_lock = threading.Lock()  # a fetch's stale slab and the refresher may both find the restart
        self._pool = ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="kvmesh-pull")
        self._verify_pool = ThreadPoolExecutor(4, thread_name_prefix="kvmesh-verify")
        self._data = DataClient()
        self.fetcher = Fetcher(
            Env(
                node_id or "",
                local,
                self._slab,
                local_slab[2] if local_slab else 0,
                self._peer,
                self.view,
                self._data,
                self._pool,
                self._reattach_local,
                GpuReads.open(gpu_exports),
                verify=self._verify_pool,
            )
        )
        # stores of GPU KV go device to device into the node's GPU tier through the pools mapped for reads
        self.stores = (
            StoreQueue(spec, local, self.counts, gpu=lambda: self.fetcher.env.gpu) if local is not None else None
        )
        self._scratch: torch.Tensor | None = None
        self._seen: dict[bytes, tuple[bool, float]] = {}  # chunk hash -> (cached, when) as a recent lookup saw it
        self._samples: list = []  # (kind, source, seconds) for the latency histograms, drained by the exporter
        self._events: list = []  # (kind, reason, detail) failures for the live page, drained by the exporter
        self._other_specs: list[KVSpec] = []
        self._specs_at = -1e9
        self._exporter = ClientExporter(Records(self.directory.redis, config.key_prefix), node_id or "")
        try:
            self.directory.register_spec(spec.model_id, spec.canonical_bytes())
        except redis.RedisError:
            pass
        self._closed = threading.Event()
        self._running = threading.Condition()  # guards `_fetches`: deadlines of the fetches in flight, by token
        self._fetches: dict[object, float] = {}
        self._loads: list[weakref.ref] = []  # fetch_to_device's loads, released by close() unless they were
        self.view.refresh(direct=True)  # (the relay may predate a node that joined a moment ago)
        self._refresher = threading.Thread(target=self._refresh_loop, name="kvmesh-client-nodes", daemon=True)
        self._refresher.start()

    # -- lookup -------------------------------------------------------------------------------------------------
    def _salt(self, cache_salt) -> bytes:
        """The salt of one call: the client's (the tenant's), with the call's own behind it, "<client>\\0<call>",
        as vLLM's connector puts a request's salt behind its engine's. A call's salt never replaces the client's:
        a client salted for one tenant cannot name its way into another tenant's or the unsalted chunks. An empty
        call salt is none. (Salts keep apart tenants that do not know each other's salt: they are names, not access
        control; an unsalted client that passes a tenant's salt per call reads that tenant's chunks.)"""
        call = salt_bytes(cache_salt)
        if not call:
            return self.cache_salt
        return self.cache_salt + b"\0" + call if self.cache_salt else call

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
        _check_flag("allow_split", allow_split)
        _check_flag("cost_model", cost_model)
        _check_flag("count", count)
        toks = as_tokens(tokens)
        if max_chunks is not None and (
            isinstance(max_chunks, bool) or not isinstance(max_chunks, (int, np.integer)) or max_chunks < 0
        ):
            raise ValueError(f"max_chunks must be a non-negative int, got {max_chunks!r}")
        salt = self._salt(cache_salt)
        limit = len(toks) if max_chunks is None else min(len(toks), int(max_chunks) * self.spec.chunk_tokens)
        hashes = chunk_hashes(self.spec.namespace, toks[:limit], self.spec.chunk_tokens, salt)
        counts = self.counts if count else Counter()
        counts["lookups"] += bool(hashes)  # (no full chunk: nothing could be cached, nothing is asked)
        holders, why = self._prefix(hashes[0] if hashes else b"", hashes, chained=True)
        chunks = tuple(ChunkMatch(h, hs) for h, hs in zip(hashes, holders))
        if why != "directory_error":
            self._remember(hashes, len(chunks))
        if not chunks and hashes:
            if why == "not_cached" and self._cached_elsewhere(toks, salt):
                why = "spec_mismatch"
            counts[f"miss_{why}"] += 1
        match = Match(
            self.spec.namespace, self.spec.chunk_tokens, chunks, why=why or "", group=hashes[0] if hashes else b""
        )
        if cost_model:
            match = replace(match, plan=self.plan(match, len(toks), allow_split=allow_split, count=count))
        if chunks and match.plan is not None and match.plan.end == 0:
            counts["miss_cost_model"] += 1
        elif chunks:
            counts["hits"] += 1
        return match

    def _prefix(
        self, group: bytes, hashes: list[bytes], chained: bool = False
    ) -> tuple[list[tuple[Holder, ...]], str | None]:
        """The directory's longest live prefix of `hashes`, timed; a directory that failed moments ago is not asked
        (the view's breaker: a fast miss instead of a timeout per call). `chained`: `hashes` are this client's own
        chain of a prompt (`chunk_hashes`), whose buckets have summaries; keys an engine names may not chain."""
        if not hashes:
            return [], None
        if not self.view.allow():
            self.counts["directory_skipped"] += 1
            return [], "directory_error"
        t0 = time.monotonic()
        try:
            out = self.directory.lookup(
                group, hashes, self.view.table(), prefer=self.node_id, newer=self.view.current, chained=chained
            )
        except redis.RedisError as e:
            log.debug("lookup failed: %s", e)
            self.counts["directory_errors"] += 1
            self.view.failed()
            return [], "directory_error"
        self._samples.append(("rtt", "", time.monotonic() - t0))
        return out

    def _held(self, group: bytes, hashes: list[bytes], seen: bool) -> list[bool]:
        """Whether each of `hashes` is cached somewhere (a store skips those). A directory that does not answer
        says "none": the node stores what it does not hold, nothing is lost. `seen`: what a recent lookup saw
        may answer instead of the directory."""
        held = self._recently_seen(hashes) if seen else None  # usually: the store's own lookup saw them all
        if held is not None:
            self.counts["store_checked_by_lookup"] += 1
            return held
        if not self.view.allow():
            return [False] * len(hashes)
        try:
            return [
                bool(hs)
                for hs in self.directory.holders(
                    group, hashes, self.view.table(), prefer=self.node_id, newer=self.view.current
                )
            ]
        except redis.RedisError:
            self.counts["directory_errors"] += 1
            self.view.failed()
            return [False] * len(hashes)

    def _cached_elsewhere(self, toks, salt: bytes) -> bool:
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

    def record_request(self, reused_local: int, reused_peer: int, recomputed: int) -> None:
        """Integrations report each request's prompt tokens by where their KV came from (for the metrics).

        Reused tokens are counted in one place per client, never twice. By default (`count_fetches`) a fetch counts
        the tokens it delivered, local or peer, whoever called it (the raw API, hf, SGLang), and the reuse given
        here is not added again: only `recomputed` is. A client made with `count_fetches=False` (vLLM's: its
        workers fetch per TP rank and per KV group, and the scheduler knows the request) counts reuse here."""
        for name, n in (("reused_local", reused_local), ("reused_peer", reused_peer), ("recomputed", recomputed)):
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                raise ValueError(f"{name} must be a non-negative int (tokens), got {n!r}")
        if not self.count_fetches:
            self.counts["reused_tokens_local"] += reused_local
            self.counts["reused_tokens_peer"] += reused_peer
        self.counts["recomputed_tokens"] += recomputed

    def _link(self, holder: Holder) -> str:
        """The link a chunk comes over, for the cost model: this node or a peer (each its own: one slow peer does
        not make the plan recompute what a fast one holds), and whether from its disk."""
        if holder.node_id == self.node_id:
            return "local-disk" if holder.tier == TIER_DISK else "local"
        return f"{'peer-disk' if holder.tier == TIER_DISK else 'peer'}:{holder.node_id}"

    def plan(self, match: Match, prompt_tokens: int, allow_split: bool = True, count: bool = True) -> LoadPlan:
        """The cost model's plan for using `match` in a prompt of `prompt_tokens` tokens."""
        if not isinstance(match, Match):
            raise TypeError(f"match must be a kvmesh Match from lookup(), got {type(match).__name__}")
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, (int, np.integer)) or prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be a non-negative int, got {prompt_tokens!r}")
        _check_flag("allow_split", allow_split)
        _check_flag("count", count)
        links = [self._link(ch.holders[0]) for ch in match.chunks]
        plan = self.cost.plan(
            prompt_tokens, self.spec.chunk_tokens, self.spec.chunk_bytes, links, allow_split=allow_split
        )
        if count:
            self.counts[f"plan_{plan.reason.replace(' ', '_')}"] += 1
        return plan

    def _remember(self, hashes: list[bytes], cached: int) -> None:
        """A lookup saw the first `cached` of `hashes` cached and the rest not: what `store` needs to know."""
        if len(self._seen) + len(hashes) > MAX_SEEN:
            self._seen = {}
        now = time.monotonic()
        for i, h in enumerate(hashes):
            self._seen[h] = (i < cached, now)

    def _recently_seen(self, hashes: list[bytes]) -> list[bool] | None:
        """Whether each of `hashes` was cached, if a lookup in the last SEEN_TTL_S saw all of them."""
        now = time.monotonic()
        out = []
        for h in hashes:
            hit = self._seen.get(h)
            if hit is None or now - hit[1] > SEEN_TTL_S:
                return None
            out.append(hit[0])
        return out

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
        """A client belongs to the process that made it. In a child forked from that process its threads are gone
        and its Ray calls are never answered (a fetch waited out its deadline and counted a miss, a store was
        counted as handed over and never made), and its kept peer connections are its parent's too (two processes
        reading replies off one socket can take each other's chunks)."""
        if os.getpid() != self._pid:
            raise ForkedProcessError(
                f"{what} on a KVMeshClient made in process {self._pid}, from which this process ({os.getpid()}) "
                "was forked: a client belongs to the process that made it; call kvmesh.connect in a process "
                "started otherwise (multiprocessing's 'spawn' start method, a Ray task or actor)"
            )

    def _check_match(self, match) -> None:
        self._check_open("fetch")
        if not isinstance(match, Match):
            raise TypeError(f"match must be a kvmesh Match from lookup(), got {type(match).__name__}")
        if match.namespace != self.spec.namespace or match.chunk_tokens != self.spec.chunk_tokens:
            raise ValueError("match was made for a different KVSpec than this client's")

    def _options(self, match: Match, deadline_s) -> FetchOptions:
        if deadline_s is not None and (
            isinstance(deadline_s, bool)
            or not isinstance(deadline_s, (int, float))
            or not 0 < deadline_s <= MAX_DEADLINE_S  # (nan and inf too: no wait takes them)
        ):
            raise ValueError(f"deadline_s must be a number of seconds in (0, {MAX_DEADLINE_S:g}], got {deadline_s!r}")
        c = self.config
        return FetchOptions(
            self.spec.chunk_bytes,
            time.monotonic() + (deadline_s or c.fetch_timeout_s),
            c.peer_transport,
            c.coalesce_pulls,
            match.group or (match.chunks[0].hash if match.start == 0 and match.chunks else b""),
            max(1, c.pull_batch_bytes // self.spec.chunk_bytes),
        )

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
        self._check_match(match)
        opts = self._options(match, deadline_s)
        device = _device(device)
        if out is not None:
            self._check_out(out, match.num_tokens)
        if device.type == "cuda" and out is None:  # DMA straight from the slab; verified before it is returned
            load, n = self._run(match, self._device_sink(device), opts, device)
            if load is None:
                return torch.empty(self.spec.kv_shape(0), dtype=self.spec.torch_dtype, device=device)
            load.synchronize()
            n = min(n, load.first_unverified())
            s = self.spec
            result = load.staging[:n].permute(1, 2, 0, 3, 4, 5).reshape(s.kv_shape(n * s.chunk_tokens))
            load.release()
            return result
        if out is None:
            out = torch.empty(self.spec.kv_shape(match.num_tokens), dtype=self.spec.torch_dtype)
        result = self._run(match, HostSink(self.spec, out), opts, device)
        return result if device.type == "cpu" else result.to(device, non_blocking=True)

    def fetch_to_device(
        self, match: Match, device: str | torch.device, deadline_s: float | None = None, min_copy_bytes: int = 8 << 20
    ):
        """Land the matched chunks on a device, layer group by layer group (`movers.LayerwiseLoad`): same-node
        chunks are copied by DMA straight from the node's page-locked slab, peer chunks first into page-locked
        staging that belongs to this fetch. Checksums of the slab chunks are verified by CPU threads while the DMA
        runs (`load.verified()`; a consumer must not use what it computed from a load that fails it). Returns
        (load or None, chunks in it); call `load.release()` when done (it unpins the slab chunks), or use the load
        as a context manager; `close()` releases those still held."""
        self._check_match(match)
        if isinstance(min_copy_bytes, bool) or not isinstance(min_copy_bytes, (int, np.integer)) or min_copy_bytes < 0:
            raise ValueError(f"min_copy_bytes must be a non-negative int, got {min_copy_bytes!r}")
        opts = self._options(match, deadline_s)
        device = _device(device)
        load, n = self._run(match, self._device_sink(device, min_copy_bytes), opts, device)
        if load is not None and load.on_release:
            with self._running:
                self._loads = [r for r in self._loads if (held := r()) is not None and held.on_release]
                self._loads.append(weakref.ref(load))
        return load, n

    def _device_sink(self, device: torch.device, min_copy_bytes: int = 8 << 20) -> DeviceSink:
        return DeviceSink(self.spec, device, self._verify_pool, min_copy_bytes)

    def _run(self, match: Match, sink, opts: FetchOptions, device: torch.device):
        token = object()
        with self._running:
            if self._closed.is_set():
                raise ValueError("fetch on a closed KVMeshClient")
            self._fetches[token] = opts.deadline
        try:
            result, stats = self.fetcher.fetch(match.chunks, sink, opts)
        except RuntimeError as e:  # a close() that gave up waiting shut the pools down under this fetch
            if self._closed.is_set():
                raise ValueError("KVMeshClient closed while this fetch ran") from e
            raise
        finally:
            with self._running:
                del self._fetches[token]
                self._running.notify_all()
        self.last_fetch = stats
        self._record(match, stats, device)
        return result

    def _record(self, match: Match, st: FetchStats, device: torch.device) -> None:
        """Metrics at the edge: counters, the live page's events, the cost model's link observations."""
        cb, got, n = self.spec.chunk_bytes, st.chunks, match.num_chunks
        self.counts["fetched_chunks_local"] += st.local_chunks
        self.counts["fetched_chunks_gpu_tier_d2d"] += st.gpu_chunks
        self.counts["fetched_chunks_peer"] += st.peer_chunks
        self.counts["fetched_bytes_local"] += st.local_chunks * cb
        self.counts["fetched_bytes_peer"] += st.peer_chunks * cb
        if device.type != "cpu":
            self.counts["fetched_chunks_to_device"] += got
        if self.count_fetches and self.spec.tp_rank == 0:  # (every TP rank fetches its shard of the same tokens)
            self.counts["reused_tokens_local"] += st.local_chunks * self.spec.chunk_tokens
            self.counts["reused_tokens_peer"] += st.peer_chunks * self.spec.chunk_tokens
        for c in match.chunks[:got]:  # by the holder the lookup named first (the one a fetch tries first)
            h = c.holders[0]
            source = "local" if h.node_id == self.node_id else "peer"
            self.counts[f"fetched_bytes:{source}:{TIER_NAMES[h.tier]}:{device.type}"] += cb
        for link, nbytes, seconds in link_observations(st.runs, cb):
            self.cost.observe_transfer(link, nbytes, seconds)
            self._samples.append(("transfer", link.split(":")[0], seconds))  # (metrics: by kind of link)
        if st.corrupt:
            self.counts["fetch_checksum_failures"] += st.corrupt
        if got < n:
            now = time.monotonic()  # what did not arrive is not cached for this worker's store: it recomputes and
            for c in match.chunks[got:]:  # stores it (a holder that failed may stay listed until its lease lapses)
                if c.hash in self._seen:
                    self._seen[c.hash] = (False, now)
            self.counts["fetch_truncated"] += 1
            self.counts[f"miss_{st.error}"] += 1
            self.counts[f"pull_failure_{st.error}"] += 1
            self._events.append(("fetch_truncated", st.error, f"{got} of {n} chunks"))

    def scratch(self, num_tokens: int) -> torch.Tensor:
        """A reusable, already-touched CPU buffer for `fetch(..., out=)`, valid until the next call: for callers
        that copy the fetched KV elsewhere at once (a fresh allocation's page faults cost as much as the copy)."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        buf = self._scratch
        if buf is None or buf.shape[2] < num_tokens:
            grown = max(num_tokens, 2 * buf.shape[2] if buf is not None else 0)
            buf = self._scratch = torch.zeros(self.spec.kv_shape(grown), dtype=self.spec.torch_dtype)
        return buf  # shape[2] >= num_tokens; fetch fills the front

    def _check_out(self, out, num_tokens: int) -> None:
        s = self.spec
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.dtype != s.torch_dtype or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous CPU tensor of dtype {s.dtype}")
        if (
            out.dim() != 5
            or out.shape[0] != s.num_layers
            or out.shape[1] != 2
            or out.shape[2] < num_tokens
            or out.shape[3] != s.num_kv_heads
            or out.shape[4] != s.head_dim
        ):
            raise ValueError(
                f"out must have shape [{s.num_layers}, 2, >= {num_tokens}, {s.num_kv_heads}, "
                f"{s.head_dim}], got {list(out.shape)}"
            )

    def _peer(self, node_id: str):
        """The handle of `node_id`'s KVNode (this node's own included), or None."""
        if node_id == self.node_id and self._local is not None:
            return self._local
        h = self._peers.get(node_id)
        if h is None:
            if self._peers_given is not None:
                h = self._peers_given(node_id)
            else:
                h = NodeHandle.find(node_id, self.node_id or "", self._orphans)
            if h is None:
                self.counts["fetch_node_unknown"] += 1
                return None
            self._peers[node_id] = h
            if self._peers_given is None:
                info = self.view.table().by_node().get(node_id)
                self._peer_incs[node_id] = info.incarnation if info is not None else 0
        return h

    def _follow_nodes(self) -> None:
        """(The refresher, with Ray.) A KVNode that Ray restarted keeps its actor handle but not its slab; one
        replaced by a new actor (`kvmesh.stop` and `start`, the keeper putting one back, a restart that failed)
        leaves this client's handle dead for good. The node table says when either happened: a node whose
        incarnation changed. This node's KVNode is then attached again (handle, slab, GPU pools) and a peer's
        handle looked up again when next needed."""
        if self._peers_given is not None or self._local is None:
            return
        nodes = self.view.table().by_node()
        for node_id, inc in list(self._peer_incs.items()):
            info = nodes.get(node_id)
            if info is None or info.incarnation != inc:
                self._peers.pop(node_id, None)
                self._peer_incs.pop(node_id, None)
        me = nodes.get(self.node_id or "")
        if me is not None and self._slab is not None and me.slab_path != self._slab_path:
            self._reattach_local(stale=False)

    def _reattach_local(self, stale: bool = True) -> None:
        """The local KVNode restarted or was replaced (a new slab): attach to it again and map its new slab."""
        if stale:
            self.counts["fetch_stale_slab"] += 1
        with self._reattach_lock:  # (once: two at once mapped the new slab twice and closed the old one twice)
            self._reattach_local_once()

    def _reattach_local_once(self) -> None:
        try:
            hello = self._local.hello(timeout=5)
        except Exception:  # the actor is gone: a new one may run under the same name
            me = self.node_id or ""
            found = NodeHandle.find(me, me, self._orphans) if self._peers_given is None and me else None
            if found is None:
                return
            try:
                hello = found.hello(timeout=5)
            except Exception:
                return
            self._local = self.fetcher.env.local = found
            if self.stores is not None:
                self.stores.node = found
            self.counts["local_node_reattached"] += 1
        if self._slab is not None and hello.info.slab_path == self._slab_path:
            return
        old, env = self._slab, self.fetcher.env
        self._slab = SlabReader.open(hello.info.slab_path, hello.info.slab_bytes)
        self._slab_path = hello.info.slab_path
        self._table_file = TableFile.beside(hello.info.slab_path)
        env.slab, env.slot_bytes = self._slab, hello.info.slot_bytes
        if old is not None:
            old.close()
        if env.gpu is not None:
            env.gpu.close()
        env.gpu = GpuReads.open(hello.gpu_exports)  # a restarted node has new pools

    # -- store --------------------------------------------------------------------------------------------------
    def store(self, tokens, kv: torch.Tensor, cache_salt: str | bytes | None = None, *, handover: bool = False) -> int:
        """Store the full chunks of `tokens` not already cached; `kv` is `[num_layers, 2, n, num_kv_heads,
        head_dim]` with `n >= len(tokens)`. Returns the number of chunks handed to the local node (`last_store`
        says what became of the others). The KV is read as it is now (on a GPU: copied on the current stream before
        this returns, without waiting for it): the caller may overwrite or free it at once. `handover=True`: the
        caller will never write `kv` again (a tensor made for this store), so a GPU store reads it as it is,
        without that copy (and its device memory)."""
        self._check_open("store")
        _check_flag("handover", handover)
        toks = as_tokens(tokens)
        kv = self._check_kv(kv, len(toks))
        hashes = chunk_hashes(self.spec.namespace, toks, self.spec.chunk_tokens, self._salt(cache_salt))
        c = self.spec.chunk_tokens
        return self._store(
            hashes[0] if hashes else b"", hashes, lambda i: kv[:, :, i * c : (i + 1) * c], True, not handover
        )

    def _store(
        self, group: bytes, keys: list[bytes], chunk, seen: bool, snapshot: bool = True, mine: list | None = None
    ) -> int:
        if not keys:
            self.last_store = StoreResult(0)
            return 0
        if self.stores is None:
            self.counts["store_no_local_node"] += 1
            self.last_store = StoreResult(0, 0, len(keys), "no_local_node")
            return 0
        held = self._held(group, keys, seen)
        todo = [i for i in range(len(keys)) if not held[i]]
        handed = self.stores.submit(group, [keys[i] for i in todo], [chunk(i) for i in todo], snapshot, mine)
        if handed:
            self.directory.touched(group)
        self.last_store = StoreResult(
            handed, len(keys) - len(todo), len(todo) - handed, self.stores.refused if handed < len(todo) else ""
        )
        return handed

    def _check_kv(self, kv, num_tokens: int) -> torch.Tensor:
        s = self.spec
        if not isinstance(kv, torch.Tensor):
            raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
        if kv.layout != torch.strided or kv.device.type not in ("cpu", "cuda"):
            raise ValueError(f"kv must be a dense CPU or CUDA tensor, got a {kv.layout} one on {kv.device}")
        if kv.dtype != s.torch_dtype:
            raise ValueError(f"kv has dtype {kv.dtype}, but the spec says {s.dtype}")
        if (
            kv.dim() != 5
            or kv.shape[0] != s.num_layers
            or kv.shape[1] != 2
            or kv.shape[3] != s.num_kv_heads
            or kv.shape[4] != s.head_dim
        ):
            raise ValueError(
                f"kv must have shape [{s.num_layers}, 2, n, {s.num_kv_heads}, {s.head_dim}], got {list(kv.shape)}"
            )
        if kv.shape[2] < num_tokens:
            raise ValueError(f"kv holds {kv.shape[2]} tokens, fewer than the {num_tokens} in tokens")
        kv = kv.detach()
        return kv if kv.stride(-1) == 1 else kv.contiguous()

    def flush(self, timeout_s: float = 30.0) -> int:
        """Wait until every store handed over so far (by any thread) is in the node's tier and registered; returns
        how many chunks the node actually stored of the stores no earlier flush counted (with several threads
        flushing at once, each store is counted by the first flush that reads its reply)."""
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s >= 0:
            raise ValueError(f"timeout_s must be a number of seconds >= 0, got {timeout_s!r}")
        self._check_process("flush")
        return self.stores.flush(timeout_s) if self.stores is not None else 0

    # -- by explicit chunk keys -----------------------------------------------------------------------------------
    # For engines that name their pages themselves (SGLang's HiCache hands out page hashes, never token ids): the
    # caller derives each key under this client's spec namespace and salt (`root_hash`), so keys of different
    # specs never meet, and names the directory group they are registered in.
    def lookup_keys(self, group: bytes, keys: list[bytes], count: bool = True) -> Match:
        """`lookup` for caller-made keys: the longest run of `keys`, from the first, with a live holder in
        directory group `group`. Pure read, one round trip; no cost-model plan (the engine decides). `count=False`:
        not counted as a lookup, hit or miss (an engine asking again about keys it already looked up)."""
        self._check_open("lookup_keys")
        _check_flag("count", count)
        self._check_keys(group, keys)
        holders, why = self._prefix(group, keys)
        chunks = tuple(ChunkMatch(k, hs) for k, hs in zip(keys, holders))
        if keys and count:
            self.counts["lookups"] += 1
            self.counts["hits" if chunks else f"miss_{why}"] += 1
        return Match(self.spec.namespace, self.spec.chunk_tokens, chunks, why=why or "", group=group)

    def held_keys(self, group: bytes, keys: list[bytes], count: bool = True) -> list[bool]:
        """Whether each of `keys` has a live holder in directory group `group`, each key for itself (`lookup_keys`
        answers only the leading run): for engines that ask about keys in another order than the prompt's, e.g.
        vLLM's sliding-window lookups, from the prompt's end backwards. One round trip; a directory that fails
        says "none" (counted, like a lookup's)."""
        self._check_open("held_keys")
        _check_flag("count", count)
        self._check_keys(group, keys)
        if not keys:
            return []
        held, why = [False] * len(keys), "not_cached"
        if not self.view.allow():
            self.counts["directory_skipped"] += 1
            why = "directory_error"
        else:
            t0 = time.monotonic()
            try:
                holders = self.directory.holders(
                    group, list(keys), self.view.table(), prefer=self.node_id, newer=self.view.current
                )
                held = [bool(hs) for hs in holders]
                self._samples.append(("rtt", "", time.monotonic() - t0))
            except redis.RedisError as e:
                log.debug("lookup failed: %s", e)
                self.counts["directory_errors"] += 1
                self.view.failed()
                why = "directory_error"
        if count:
            self.counts["lookups"] += 1
            self.counts["hits" if any(held) else f"miss_{why}"] += 1
        return held

    def store_keys(self, group: bytes, keys: list[bytes], chunks) -> int:
        """`store` for caller-made keys: `chunks[i]` (a tensor of the spec's dtype and `chunk_shape`, any
        strides, e.g. a view into an engine's host pool; all on one device) is chunk `keys[i]`, registered in
        directory group `group`. Those not already cached are copied out before this returns (on a GPU: on the
        current stream) and handed to the local node; returns their count."""
        return self._store_keys(group, keys, chunks)

    def _store_keys(self, group: bytes, keys: list[bytes], chunks, mine: list | None = None) -> int:
        self._check_open("store_keys")
        self._check_keys(group, keys)
        s = self.spec
        if not isinstance(chunks, (list, tuple)) and not (isinstance(chunks, torch.Tensor) and chunks.dim() >= 1):
            raise TypeError(f"chunks must be a list or tuple of tensors (one per key), got {type(chunks).__name__}")
        if len(chunks) != len(keys):
            raise ValueError(f"chunks has {len(chunks)} entries for {len(keys)} keys")
        for c in chunks:
            if not isinstance(c, torch.Tensor) or c.dtype != s.torch_dtype or tuple(c.shape) != s.chunk_shape:
                raise ValueError(f"each chunk must be a {s.dtype} tensor of shape {list(s.chunk_shape)}")
            if c.layout != torch.strided or c.device.type not in ("cpu", "cuda"):
                raise ValueError(f"each chunk must be a dense CPU or CUDA tensor, got a {c.layout} one on {c.device}")
            if c.device != chunks[0].device:
                raise ValueError(f"all chunks must be on one device, got {chunks[0].device} and {c.device}")
        return self._store(group, list(keys), lambda i: chunks[i], False, mine=mine)

    def store_keys_waited(self, group: bytes, keys: list[bytes], chunks, timeout_s: float) -> tuple[int, int]:
        """`store_keys`, then wait at most `timeout_s` for this store alone: (chunks handed to the node, of those
        the ones it stored and registered by then). Other stores in flight (an earlier one whose wait ran out and
        whose reply comes now) are not counted: `flush` counts them all."""
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s >= 0:
            raise ValueError(f"timeout_s must be a number of seconds >= 0, got {timeout_s!r}")
        mine: list = []
        sent = self._store_keys(group, keys, chunks, mine)
        if not sent or self.stores is None:
            return sent, 0
        if len(chunks) and chunks[0].is_cuda:  # (handed over by the background thread: not collected)
            return sent, self.stores.flush(timeout_s)
        return sent, self.stores.flush_own(mine, timeout_s)

    @staticmethod
    def _check_keys(group, keys) -> None:
        if not isinstance(group, bytes) or len(group) != HASH_BYTES:
            raise ValueError(f"group must be {HASH_BYTES} bytes")
        if not isinstance(keys, (list, tuple)) or not all(isinstance(k, bytes) and len(k) == HASH_BYTES for k in keys):
            raise ValueError(f"keys must be a list of {HASH_BYTES}-byte chunk keys")

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
                self._follow_nodes()
                if len(self._orphans):
                    self._orphans.reap()
                self._flush_telemetry()
            except Exception as e:  # never let the refresher die: the node table would freeze with it
                log.exception("kvmesh client: background refresh failed: %s", e)

    def share_counts(self, other: KVMeshClient) -> None:
        """Count into `other`'s counters from now on (an engine's clients, one per LoRA adapter or KV cache group,
        report as one): its stores' counts too, and through its exporter, so that each change is exported once
        (each client exported every change of the shared counters, its own and the others')."""
        self.counts = other.counts
        if self.stores is not None:
            self.stores.counts = other.counts
        self._exporter = other._exporter

    def _flush_telemetry(self) -> None:
        samples, self._samples = self._samples, []
        events, self._events = self._events, []
        # (a delta: clients that share counts (`share_counts`) each have their own view and its own error count)
        errors = self.view.errors
        self.counts["directory_errors_total"] += errors - self._errors_counted
        self._errors_counted = errors
        self._exporter.flush(self.counts, samples, events)

    def close(self) -> None:
        if os.getpid() != self._pid:  # a forked child's copy: only what this process holds goes (no Ray call, which
            self._close_copy()  # would never be answered, no telemetry, which the parent exports)
            return
        if self.stores is not None:
            self.stores.close()
        with self._running:  # fetches in flight end first (by their deadlines, CLOSE_WAIT_S at most): their
            self._closed.set()  # threads and slab stay until then; one still waiting on a peer after it ends short
            until = min(max(self._fetches.values(), default=0.0) + 1.0, time.monotonic() + CLOSE_WAIT_S)
            while self._fetches and (left := until - time.monotonic()) > 0:
                self._running.wait(left)
        for ref in self._loads:  # loads to a device never released: their slab chunks would stay pinned till the
            load = ref()  # pins' TTL otherwise
            if load is None:
                continue
            try:
                load.release()
            except Exception as e:  # (a device error: the pins still lapse at their TTL)
                log.warning("kvmesh client: releasing a load at close failed: %s", e)
        self._refresher.join(timeout=2)
        if len(self._orphans):  # pins of this client that came too late: released now, not at their TTL
            self._orphans.reap(timeout=2.0)
        self._flush_telemetry()
        if self._slab is not None:
            self._slab.close()
            self._slab = None
        self._data.close()
        if self.fetcher.env.gpu is not None:
            self.fetcher.env.gpu.close()
        self._pool.shutdown(wait=False)
        self._verify_pool.shutdown(wait=False)
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


def _device(device) -> torch.device:
    """`device` as a torch.device: the CPU, or a CUDA device that this process can use."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, UnicodeError):  # torch's words for a bad name or type (a name given as bytes
        # that are not UTF-8: a bare UnicodeDecodeError that named nothing)
        raise ValueError(f"device must be 'cpu', a CUDA device or a torch.device, got {device!r}") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device is {device!r}, but CUDA is not available in this process")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise ValueError(f"device is {device!r}, but this process sees {torch.cuda.device_count()} CUDA device(s)")
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be the CPU or a CUDA device, got {device!r}")
    return d


def _spec_or_none(data: bytes) -> KVSpec | None:
    try:
        return KVSpec.from_canonical_bytes(data)
    except (ValueError, TypeError):
        return None


def _resolve(
    spec: KVSpec, cfg: KVMeshConfig, redis_url, config, options, node_slot_bytes: int | None = None
) -> KVMeshConfig:
    """The client's config. `node_slot_bytes`: the slot size of the node this client attaches to, which is what a
    chunk must fit (a `slot_bytes` option changes only this client's copy of the config, not the node's slots)."""
    cfg = config or cfg
    if redis_url is not None:
        cfg = cfg.replace(redis_url=redis_url)
    cfg = cfg.replace(**options)
    slot_bytes = cfg.slot_bytes if node_slot_bytes is None else min(cfg.slot_bytes, node_slot_bytes)
    if spec.chunk_bytes > slot_bytes:
        where = "the nodes'" if node_slot_bytes is None or slot_bytes < node_slot_bytes else "this KVNode's"
        raise ValueError(
            f"spec.chunk_tokens={spec.chunk_tokens} makes {spec.chunk_bytes}-byte chunks, larger than "
            f"{where} slot_bytes={slot_bytes}; use fewer chunk_tokens, or start the KVNodes with bigger slots"
        )
    return cfg


def _check_directory(cfg: KVMeshConfig, node_cfg: KVMeshConfig) -> None:
    """A client attached to a node must use the node's directory: the node registers what the client stores, and
    lookups under another database or key prefix would never find it (a silent 0 % hit rate). Two spellings of the
    node's own (a host name and its address, another master of its Redis Cluster, another ACL user) are the same
    directory: the servers are asked where the text differs. Where the node's server cannot be asked, the client
    goes on (its own URL answered the probe), with a warning."""
    from kvmesh.redisconn import same_server

    same = (
        same_server(cfg.redis_url, node_cfg.redis_url, min(2.0, cfg.lease_s))
        if cfg.key_prefix == node_cfg.key_prefix
        else False
    )
    if same is None:
        log.warning(
            "kvmesh: could not tell whether %s is the directory of this client's KVNode (%s)",
            redact_url(cfg.redis_url),
            redact_url(node_cfg.redis_url),
        )
    elif not same:
        raise ValueError(
            f"this client's directory ({redact_url(cfg.redis_url)}, key_prefix {cfg.key_prefix!r}) is not the "
            f"one its KVNode registers in ({redact_url(node_cfg.redis_url)}, key_prefix {node_cfg.key_prefix!r}): "
            "what it stores would never be found; leave redis_url and key_prefix out"
        )


def _check_flag(name: str, value) -> None:
    """A flag argument is True or False: a string such as "no" is truthy, and would turn the option on."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def connect(
    spec: KVSpec,
    redis_url: str | None = None,
    *,
    cache_salt: str | bytes | None = None,
    config: KVMeshConfig | None = None,
    node_id: str | None = None,
    count_fetches: bool = True,
    **options,
) -> KVMeshClient:
    """A client for `spec` in this process. Finds the KVNode on this process's Ray node (or on `node_id`: for an
    engine whose Ray connection lands elsewhere, e.g. a child process of an actor) and takes its config (directory
    URL included) unless `redis_url`/`config`/`options` say otherwise. Raises `kvmesh.DirectoryUnavailable` (a
    `ConnectionError` naming the URL, password redacted, and the cause) within about 2 x `lease_s` when the
    directory does not answer, refuses AUTH or is not Redis; once connected, directory failures are misses.
    `count_fetches=False`: the caller reports each request's reuse itself (`KVMeshClient.record_request`)."""
    if not isinstance(spec, KVSpec):
        raise TypeError(f"spec must be a kvmesh.KVSpec, got {type(spec).__name__}")
    if node_id is not None and (not isinstance(node_id, str) or not node_id):
        raise ValueError(f"node_id must be a Ray node id (hex string), got {node_id!r}")
    if not isinstance(count_fetches, bool):
        raise TypeError(f"count_fetches must be True or False, got {count_fetches!r}")
    if config is not None and not isinstance(config, KVMeshConfig):  # (a dict of options goes in **options)
        raise TypeError(f"config must be a kvmesh.KVMeshConfig, got {type(config).__name__}")
    client_salt(cache_salt)
    from kvmesh.mesh import _require_ray

    ray = _require_ray()
    named = node_id is not None
    node_id = node_id or ray.get_runtime_context().get_node_id()
    orphans = Orphans()
    local = NodeHandle.find(node_id, node_id, orphans)
    hello = None
    if local is not None:
        try:
            hello = _hello(local, time.monotonic() + 30)
        except (ConnectionError, TimeoutError) as e:
            if named:
                raise RuntimeError(f"no KVNode answers on Ray node {node_id}: {e}") from None
            local = None
    elif named:
        raise RuntimeError(f"no KVNode runs on Ray node {node_id} (call kvmesh.start first)")
    if hello is None and redis_url is None and config is None:
        raise RuntimeError("no KVNode runs on this Ray node (call kvmesh.start first) and no redis_url was given")
    cfg = _resolve(
        spec,
        hello.config if hello else KVMeshConfig(),
        redis_url,
        config,
        options,
        hello.info.slot_bytes if hello else None,
    )
    # the one time a directory failure raises: a wrong URL would otherwise read as a miss on every lookup, forever
    probe(cfg.redis_url, cfg.lease_s)
    if hello is not None:  # (after the probe: a directory that cannot be used is said as such first)
        _check_directory(cfg, hello.config)
    slab = (hello.info.slab_path, hello.info.slab_bytes, hello.info.slot_bytes) if hello else None
    return KVMeshClient(
        spec,
        cfg,
        node_id,
        local,
        slab,
        cache_salt,
        gpu_exports=hello.gpu_exports if hello else (),
        count_fetches=count_fetches,
    )


def _hello(local, deadline: float):
    """The local KVNode's hello by `deadline`, asked again while Ray cannot reach its process for a moment (a
    KVNode that Ray is restarting answers `ActorUnavailableError` until its new process is up: it runs, and is no
    "no KVNode")."""
    while True:
        try:
            return local.hello(timeout=max(0.1, deadline - time.monotonic()))
        except NodeUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def connect_local(
    spec: KVSpec, node, *, peers=(), cache_salt: str | bytes | None = None, count_fetches: bool = True, **options
) -> KVMeshClient:
    """A client for `spec` beside a `KVNode` object of this process, without Ray (tests, a GPU machine without a Ray
    cluster). `peers`: other KVNode objects, reachable through their data servers (peer transport "tcp")."""
    if not isinstance(spec, KVSpec):
        raise TypeError(f"spec must be a kvmesh.KVSpec, got {type(spec).__name__}")
    cfg = _resolve(spec, node.config, None, None, options, node.info.slot_bytes)
    _check_directory(cfg, node.config)
    local = LocalHandle(node, node.node_id)
    others = {p.node_id: LocalHandle(p, node.node_id) for p in peers}
    info = node.info
    return KVMeshClient(
        spec,
        cfg,
        node.node_id,
        local,
        (info.slab_path, info.slab_bytes, info.slot_bytes),
        cache_salt,
        peers=others.get,
        gpu_exports=node.hello().gpu_exports,
        count_fetches=count_fetches,
    )
