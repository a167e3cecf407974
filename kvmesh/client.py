"""`KVMeshClient`: what a worker uses. Obtain one with `kvmesh.connect(spec)` in any Ray driver, task or actor.

    lookup(tokens) -> Match       pure read, one directory round trip: the longest cached prefix, whole chunks,
                                  with the live holders of each chunk
    fetch(match) -> Tensor        brings matched chunks into this process: same-node chunks straight from the node's
                                  shared-memory slab (an actor call only pins), peer chunks streamed from the
                                  holder's DataServer over TCP (or through Ray's object store) in batches, or
                                  (`coalesce_pulls`) through this node's KVNode, which pulls each chunk once for
                                  all its concurrent readers and keeps it. Whatever fails, is corrupt or misses
                                  the deadline truncates the result to the intact leading part; the caller
                                  recomputes the rest
    store(tokens, kv) -> int      hands the full chunks not already cached to the local KVNode and returns their
                                  count; the copy into the node happens in the background (`flush` waits for it)

Every checksum is verified when bytes cross into this process. Bad arguments raise `TypeError`/`ValueError`
naming the argument; failures of peers or Redis never raise out of these calls.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
import redis
import torch

from kvmesh.config import KVMeshConfig
from kvmesh.cost import CostModel, LinkModel, LoadPlan, measure_memcpy_bps
from kvmesh.directory import Directory, Holder, NodeTable
from kvmesh.hashing import HASH_BYTES, as_tokens, chunk_hashes, salt_bytes
from kvmesh.spec import KVSpec
from kvmesh.telemetry import ClientExporter, Records
from kvmesh.tiers import TIER_DISK, TIER_NAMES, checksum
from kvmesh.tiers.cpu import SlabReader
from kvmesh.transport import ChecksumError, DataClient
from kvmesh.wire import (MAX_DEADLINE_MS, PullThrough, StoreItem, WireError, pack_keys, pack_pull_through, pack_store,
                         unpack_chunk_header, unpack_pin_reply)

log = logging.getLogger("kvmesh.client")
DIRECTORY_RETRY_S = 5.0  # after a directory call failed, calls fail fast this long (or until a node-table read works)
SEEN_TTL_S = 30.0  # what a lookup saw of a prompt's chunks spares its store the directory round trip this long
MAX_SEEN = 4096  # hashes remembered per client (a store follows its lookup closely): ~1 MiB at most
MAX_INFLIGHT_STORES = 16  # more pending stores than this and new ones are dropped (counted), never waited for

# Slab and object-store buffers are read-only; torch warns when wrapping them. We only ever read them.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


@dataclass(frozen=True, slots=True)
class ChunkMatch:
    hash: bytes
    holders: tuple[Holder, ...]  # live holders, the preferred one (this node first, then by tier) first

    @property
    def node_id(self) -> str:
        return self.holders[0].node_id

    @property
    def tier(self) -> str:
        return TIER_NAMES[self.holders[0].tier]


@dataclass(frozen=True, slots=True)
class Match:
    """The longest cached prefix of a prompt, in whole chunks: chunks [start, start + len(chunks)) of it."""

    namespace: bytes  # spec namespace the lookup was made for
    chunk_tokens: int
    chunks: tuple[ChunkMatch, ...]
    plan: LoadPlan | None = None  # the cost model's advice for this prompt, with its reason
    start: int = 0  # index of the first chunk (non-zero only for a part selected with `select`)
    why: str = ""  # why the match ends where it does: "" (the whole prompt's full chunks), "not_cached",
    # "holder_dead", "spec_mismatch" (another spec of this model has the prefix), "directory_error"
    group: bytes = b""  # the directory group of the prompt (its first chunk's hash): where pulled chunks register

    @property
    def num_tokens(self) -> int:
        return len(self.chunks) * self.chunk_tokens

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def truncate(self, num_chunks: int) -> "Match":
        return replace(self, chunks=self.chunks[:max(0, num_chunks)], plan=None)

    def select(self, first: int, end: int) -> "Match":
        """Chunks [first, end) of this match (e.g. the part a split plan loads)."""
        return replace(self, chunks=self.chunks[first:end], start=self.start + first, plan=None)


@dataclass(frozen=True, slots=True)
class FetchStats:
    """Where the chunks of the last fetch came from."""

    local_chunks: int
    peer_chunks: int
    seconds: float
    error: str = ""  # why it stopped short ("checksum", "deadline", "peer_error"), "" if it did not


class KVMeshClient:
    def __init__(self, spec: KVSpec, config: KVMeshConfig, node_id: str | None, local_actor=None,
                 local_slab: tuple[str, int, int] | None = None, cache_salt: str | bytes | None = None) -> None:
        self.spec = spec
        self.config = config
        self.node_id = node_id
        self.cache_salt = salt_bytes(cache_salt)
        self.counts: Counter[str] = Counter()
        self.last_fetch = FetchStats(0, 0, 0.0)
        # sources: "local" = this node's slab (calibrated here), "peer" = another node (learned from pulls)
        self.cost = CostModel({"local": LinkModel(measure_memcpy_bps() / 2, 1e-3), "peer": LinkModel(1e9, 2e-3),
                               "local-disk": LinkModel(5e8, 5e-3), "peer-disk": LinkModel(4e8, 6e-3)})
        self.directory = Directory(config.redis_url, config.key_prefix, timeout_s=config.lookup_timeout_s)
        self._local = local_actor
        self._slab = SlabReader.open(*local_slab[:2]) if local_slab else None
        self._slab_slot_bytes = local_slab[2] if local_slab else 0
        self._actors: dict[str, object] = {}
        self._data = DataClient()
        self._scratch: torch.Tensor | None = None
        self._stage: torch.Tensor | None = None  # page-locked, chunk-major, for peer chunks bound for a GPU
        self._verify_pool = None
        self._pending_stores: list = []
        self._store_lock = threading.Lock()  # _pending_stores and _staged_jobs: the GPU stager thread adds to them
        self._staged: queue.Queue = queue.Queue()  # stores being copied off a GPU, handed over by `_stager`
        self._staged_jobs = 0
        self._stager: threading.Thread | None = None
        self._store_streams: dict = {}  # device -> side stream for device-to-host store copies
        self._pending_pins: list = []  # pin replies we stopped waiting for; unpinned when they arrive
        self._table = NodeTable(None, 0, {}, (), {})
        self._directory_down_until = 0.0  # a failed directory call makes the next ones fail fast until then
        self._seen: dict[bytes, tuple[bool, float]] = {}  # chunk hash -> (cached, when) as a recent lookup saw it
        self._samples: list = []  # (kind, source, seconds) for the latency histograms, drained by the exporter
        self._events: list = []  # (kind, reason, detail) failures for the live page, drained by the exporter
        self._last_error: str | None = None
        self._other_specs: list[KVSpec] = []
        self._specs_at = -1e9
        self._exporter = ClientExporter(Records(self.directory.redis, config.key_prefix), node_id or "")
        try:
            self.directory.register_spec(spec.model_id, spec.canonical_bytes())
        except redis.RedisError:
            pass
        self._table_at = time.monotonic()
        self._closed = threading.Event()
        self._refresh_nodes()
        self._refresher = threading.Thread(target=self._refresh_loop, name="kvmesh-client-nodes", daemon=True)
        self._refresher.start()

    # -- lookup -------------------------------------------------------------------------------------------------
    def _salt(self, cache_salt) -> bytes:
        return self.cache_salt if cache_salt is None else salt_bytes(cache_salt)

    def hashes(self, tokens, cache_salt: str | bytes | None = None) -> list[bytes]:
        """Chunk hashes of the full chunks of `tokens` under this client's spec and salt."""
        return chunk_hashes(self.spec.namespace, as_tokens(tokens), self.spec.chunk_tokens, self._salt(cache_salt))

    def lookup(self, tokens, cache_salt: str | bytes | None = None, *, max_chunks: int | None = None,
               allow_split: bool = True, cost_model: bool = True) -> Match:
        """`max_chunks` caps the chunks looked up (an engine must compute at least the prompt's last token);
        the plan still prices the whole prompt. `allow_split=False` plans only load-or-recompute, for engines
        that cannot compute a front part while the rest loads. `cost_model=False`: the caller loads whatever is
        cached (no plan; a cached prefix counts as a hit, never as the cost model's miss)."""
        toks = as_tokens(tokens)
        if max_chunks is not None and (isinstance(max_chunks, bool) or not isinstance(max_chunks, int)
                                       or max_chunks < 0):
            raise ValueError(f"max_chunks must be a non-negative int, got {max_chunks!r}")
        salt = self._salt(cache_salt)
        limit = len(toks) if max_chunks is None else min(len(toks), max_chunks * self.spec.chunk_tokens)
        hashes = chunk_hashes(self.spec.namespace, toks[:limit], self.spec.chunk_tokens, salt)
        self.counts["lookups"] += 1
        holders, why = self._live_holders(hashes, prefix_only=True)
        chunks = tuple(ChunkMatch(h, hs) for h, hs in zip(hashes, holders))
        if why != "directory_error":
            self._remember(hashes, len(chunks))
        if not chunks and hashes:
            if why == "not_cached" and self._cached_elsewhere(toks, salt):
                why = "spec_mismatch"
            self.counts[f"miss_{why}"] += 1
        match = Match(self.spec.namespace, self.spec.chunk_tokens, chunks, why=why or "",
                      group=hashes[0] if hashes else b"")
        if cost_model:
            match = replace(match, plan=self.plan(match, len(toks), allow_split=allow_split))
        if chunks and match.plan is not None and match.plan.end == 0:
            self.counts["miss_cost_model"] += 1
        elif chunks:
            self.counts["hits"] += 1
        return match

    def _cached_elsewhere(self, toks, salt: bytes) -> bool:
        """On a miss: does another spec of the same model hold this prompt's first chunk? (One extra round trip,
        misses only, with the list of specs cached for a while.) Turns a silent 0 % hit rate from a dtype, TP or
        layout difference into a counted "spec_mismatch"."""
        now = time.monotonic()
        if now - self._specs_at > 10.0:
            try:
                self._other_specs = [x for x in map(_spec_or_none, self.directory.specs_of(self.spec.model_id))
                                     if x is not None and x != self.spec]
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
        """Integrations report each request's prompt tokens by where their KV came from (for the metrics)."""
        self.counts["reused_tokens_local"] += reused_local
        self.counts["reused_tokens_peer"] += reused_peer
        self.counts["recomputed_tokens"] += recomputed

    def _source(self, holder: Holder) -> str:
        """The link a chunk comes over, for the cost model: this node or a peer, and whether from its disk."""
        where = "local" if holder.node_id == self.node_id else "peer"
        return f"{where}-disk" if holder.tier == TIER_DISK else where

    def plan(self, match: "Match", prompt_tokens: int, allow_split: bool = True) -> LoadPlan:
        """The cost model's plan for using `match` in a prompt of `prompt_tokens` tokens."""
        sources = [self._source(ch.holders[0]) for ch in match.chunks]
        plan = self.cost.plan(prompt_tokens, self.spec.chunk_tokens, self.spec.chunk_bytes, sources,
                              allow_split=allow_split)
        self.counts[f"plan_{plan.reason.replace(' ', '_')}"] += 1
        return plan

    def _live_holders(self, hashes: list[bytes], prefix_only: bool) -> tuple[list[tuple[Holder, ...]], str | None]:
        if not hashes:
            return [], None
        try:
            values = self._lookup_raw(hashes[0], hashes)
        except redis.RedisError as e:
            log.debug("lookup failed: %s", e)
            return [], "directory_error"
        table = self._current_table()
        if prefix_only:
            return self.directory.longest_prefix_why(values, table, prefer=self.node_id)
        return [r[0] if (r := self.directory.longest_prefix([v], table, prefer=self.node_id)) else ()
                for v in values], None

    def _lookup_raw(self, group: bytes, hashes: list[bytes]) -> list:
        """The directory's entries for `hashes`, timed; a directory that failed within DIRECTORY_RETRY_S is not
        asked again (a fast miss instead of a timeout per call) until the node-table refresh reaches it."""
        now = time.monotonic()
        if now < self._directory_down_until:
            self.counts["directory_skipped"] += 1
            raise redis.ConnectionError("the directory failed moments ago")
        try:
            values = self.directory.lookup_raw(group, hashes)
        except redis.RedisError:
            self.counts["directory_errors"] += 1
            self._directory_down_until = time.monotonic() + DIRECTORY_RETRY_S
            raise
        self._samples.append(("rtt", "", time.monotonic() - now))
        return values

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

    def _current_table(self) -> NodeTable:
        """The node table with leases judged at this moment (Redis's clock advanced by our elapsed time)."""
        t, at = self._table, self._table_at
        now_ms = t.now_ms + int((time.monotonic() - at) * 1000)
        live = {inc: info for inc, info in t.live.items() if t.deadlines.get(inc, 0) > now_ms}
        return NodeTable(t.epoch, now_ms, live, t.dead, t.deadlines)

    def _refresh_nodes(self) -> None:
        try:
            table = self.directory.node_table()
        except redis.RedisError:
            self.counts["directory_errors"] += 1
            return
        self._table, self._table_at = table, time.monotonic()
        self._directory_down_until = 0.0  # it answers again

    def _refresh_loop(self) -> None:
        while not self._closed.wait(self.config.node_refresh_s):
            self._refresh_nodes()
            self._flush_telemetry()

    def _flush_telemetry(self) -> None:
        samples, self._samples = self._samples, []
        events, self._events = self._events, []
        self._exporter.flush(self.counts, samples, events)

    # -- fetch --------------------------------------------------------------------------------------------------
    def fetch(self, match: Match, device: str | torch.device = "cpu", deadline_s: float | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """KV of the matched prefix, `[num_layers, 2, tokens, num_kv_heads, head_dim]`; `tokens` is
        `match.num_tokens` or, if part of the pull failed, the whole chunks before the first failure.

        `out`, a contiguous CPU tensor of the spec's dtype and shape `[num_layers, 2, >= match.num_tokens,
        num_kv_heads, head_dim]`, receives the chunks (an engine's preallocated buffer); the result is then a
        view of it. Without it a new tensor is allocated, whose first touch costs as much as the copy."""
        if not isinstance(match, Match):
            raise TypeError(f"match must be a kvmesh Match from lookup(), got {type(match).__name__}")
        if match.namespace != self.spec.namespace or match.chunk_tokens != self.spec.chunk_tokens:
            raise ValueError("match was made for a different KVSpec than this client's")
        if deadline_s is not None and (isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float))
                                       or deadline_s <= 0):
            raise ValueError(f"deadline_s must be a positive number, got {deadline_s!r}")
        device = _device(device)
        t0 = time.monotonic()
        deadline = t0 + (deadline_s or self.config.fetch_timeout_s)
        n = match.num_chunks
        C = self.spec.chunk_tokens
        if out is None:
            out = torch.empty(self.spec.kv_shape(n * C), dtype=self.spec.torch_dtype,
                              pin_memory=device.type == "cuda" and torch.cuda.is_available())
        else:
            self._check_out(out, n * C)
        self._last_error = None
        local, peer = self._fill(match, out, deadline) if n else (0, 0)
        got = local + peer
        self.last_fetch = FetchStats(local, peer, time.monotonic() - t0,
                                     (self._last_error or "peer_error") if got < n else "")
        self.counts["fetched_chunks_local"] += local
        self.counts["fetched_chunks_peer"] += peer
        self.counts["fetched_bytes_local"] += local * self.spec.chunk_bytes
        self.counts["fetched_bytes_peer"] += peer * self.spec.chunk_bytes
        for c in match.chunks[:got]:  # by the holder the lookup named first (the one a fetch tries first)
            h = c.holders[0]
            source = "local" if h.node_id == self.node_id else "peer"
            self.counts[f"fetched_bytes:{source}:{TIER_NAMES[h.tier]}:{device.type}"] += self.spec.chunk_bytes
        if got < n:
            self.counts["fetch_truncated"] += 1
            reason = self._last_error or "peer_error"
            self.counts[f"miss_{reason}"] += 1
            self._events.append(("fetch_truncated", reason, f"{got} of {n} chunks"))
        result = out[:, :, : got * C]
        return result if device.type == "cpu" else result.to(device, non_blocking=True)

    def scratch(self, num_tokens: int) -> torch.Tensor:
        """A reusable, already-touched CPU buffer for `fetch(..., out=)`, valid until the next call: for callers
        that copy the fetched KV elsewhere at once (a fresh allocation's page faults cost as much as the copy)."""
        buf = self._scratch
        if buf is None or buf.shape[2] < num_tokens:
            grown = max(num_tokens, 2 * buf.shape[2] if buf is not None else 0)
            buf = self._scratch = torch.zeros(self.spec.kv_shape(grown), dtype=self.spec.torch_dtype)
        return buf  # shape[2] >= num_tokens; fetch fills the front

    def fetch_to_device(self, match: Match, device: str | torch.device, deadline_s: float | None = None,
                        min_copy_bytes: int = 8 << 20):
        """Land the matched chunks on a CUDA device, layer group by layer group (`movers.LayerwiseLoad`):
        same-node chunks are copied by DMA straight from the node's page-locked slab, peer chunks first into a
        page-locked staging buffer. Checksums of the slab chunks are verified by CPU threads while the DMA runs
        (`load.verified()`). Returns (load or None, chunks in it); call `load.release()` when done."""
        import ray

        from kvmesh.movers import to_device

        if not isinstance(match, Match):
            raise TypeError(f"match must be a kvmesh Match from lookup(), got {type(match).__name__}")
        if match.namespace != self.spec.namespace:
            raise ValueError("match was made for a different KVSpec than this client's")
        deadline = time.monotonic() + (deadline_s or self.config.fetch_timeout_s)
        cb = self.spec.chunk_bytes
        srcs, checks, pins = [], [], []
        nodes = self._current_table().by_node()
        pool = self._verifier()
        for node_id, start, keys in self._plan(match):
            if start != len(srcs):
                break
            if node_id == self.node_id and self._slab is not None:
                try:
                    pin_id, rows, path = unpack_pin_reply(ray.get(self._local.pin.remote(pack_keys(keys)),
                                                                  timeout=max(0.0, deadline - time.monotonic())))
                except (ray.exceptions.RayError, TimeoutError, WireError):
                    break
                if rows:
                    pins.append(pin_id)
                if path != self._slab.path:
                    break
                for row in rows:
                    if row.nbytes != cb:
                        break
                    view = self._slab.view(row.slot * self._slab_slot_bytes, cb)
                    srcs.append(view)
                    checks.append(pool.submit(lambda v=view, c=row.checksum: checksum(v) == c))
                if len(rows) < len(keys):
                    break
                continue
            info = nodes.get(node_id)
            if info is None or not info.data_addr:
                break
            stage = self._pinned_stage(len(keys))
            k, err = self._data.pull(info.data_addr, keys, cb, lambda j: [stage[j].numpy()], deadline)
            srcs.extend(stage[j] for j in range(k))  # verified on receipt
            if k < len(keys):
                break
        self.counts["fetched_chunks_to_device"] += len(srcs)

        def unpin() -> None:
            for pin_id in pins:
                self._local.unpin.remote(pin_id)

        if not srcs:
            unpin()
            return None, 0
        load = to_device(srcs, self.spec, device, min_copy_bytes=min_copy_bytes)
        load.checks, load.on_release = checks, [unpin]
        return load, len(srcs)

    def _verifier(self):
        from concurrent.futures import ThreadPoolExecutor

        if self._verify_pool is None:
            self._verify_pool = ThreadPoolExecutor(4, thread_name_prefix="kvmesh-verify")
        return self._verify_pool

    def _pinned_stage(self, n: int) -> torch.Tensor:
        cb = self.spec.chunk_bytes
        if self._stage is None or self._stage.shape[0] < n:
            self._stage = torch.empty((n, cb), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self._stage

    def _check_out(self, out, num_tokens: int) -> None:
        s = self.spec
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.dtype != s.torch_dtype or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous CPU tensor of dtype {s.dtype}")
        if (out.dim() != 5 or out.shape[0] != s.num_layers or out.shape[1] != 2 or out.shape[2] < num_tokens
                or out.shape[3] != s.num_kv_heads or out.shape[4] != s.head_dim):
            raise ValueError(f"out must have shape [{s.num_layers}, 2, >= {num_tokens}, {s.num_kv_heads}, "
                             f"{s.head_dim}], got {list(out.shape)}")

    def _plan(self, match: Match) -> list[tuple[str, int, list[bytes]]]:
        """Runs of consecutive chunks from one holder: (node id, first chunk index, keys). Prefers this node,
        then staying on the previous chunk's holder; peer runs are split into batches that pipeline."""
        per_batch = max(1, self.config.pull_batch_bytes // self.spec.chunk_bytes)
        runs: list[tuple[str, int, list[bytes]]] = []
        prev = None
        for i, ch in enumerate(match.chunks):
            nodes = [h.node_id for h in ch.holders]
            if self.node_id in nodes and self._slab is not None:
                pick = self.node_id
            elif prev in nodes:
                pick = prev
            else:
                pick = nodes[0]
            if runs and runs[-1][0] == pick and (pick == self.node_id or len(runs[-1][2]) < per_batch):
                runs[-1][2].append(ch.hash)
            else:
                runs.append((pick, i, [ch.hash]))
            prev = pick
        return runs

    def _fill(self, match: Match, out: torch.Tensor, deadline: float) -> tuple[int, int]:
        import ray

        self._release_pending_pins()
        nodes = self._current_table().by_node()
        # through this node's KVNode: readers of this node share one transfer per chunk, and keep the chunks here
        group = match.group or (match.chunks[0].hash if match.start == 0 else b"")
        via = self.config.coalesce_pulls and self._slab is not None and bool(group)
        inflight = []  # (kind, first chunk, keys, ref or address, node id); Ray calls all start now
        for node_id, start, keys in self._plan(match):
            if node_id == self.node_id and self._slab is not None:
                inflight.append(("pin", start, keys, self._local.pin.remote(pack_keys(keys, self.node_id or "")),
                                 node_id))
                continue
            if via:
                ms = max(0, min(MAX_DEADLINE_MS, int((deadline - time.monotonic()) * 1000)))
                req = PullThrough(keys, group, self.spec.chunk_bytes, node_id, self.config.peer_transport, ms)
                inflight.append(("via", start, keys, self._local.pull_through.remote(pack_pull_through(req)),
                                 node_id))
                continue
            info = nodes.get(node_id)
            if self.config.peer_transport == "tcp" and info is not None and info.data_addr:
                inflight.append(("tcp", start, keys, info.data_addr, node_id))
                continue
            actor = self._actor(node_id)
            if actor is None:
                break
            inflight.append(("ray", start, keys, actor.pull.remote(pack_keys(keys, self.node_id or "")), node_id))
        got = {"pin": 0, "via": 0, "tcp": 0, "ray": 0}
        pos = 0
        t_prev = time.monotonic()
        for idx, (kind, start, keys, handle, node_id) in enumerate(inflight):
            if start != pos:
                break
            k = 0
            try:
                if kind == "tcp":
                    k, err = self._data.pull(handle, keys, self.spec.chunk_bytes,
                                             lambda j, s=start: self._chunk_segments(out, s + j), deadline,
                                             self.node_id or "")
                    if err is not None:
                        self.counts[f"fetch_error_{type(err).__name__}"] += 1
                        self.counts[f"pull_failure_{type(err).__name__}"] += 1
                        self._last_error = ("checksum" if isinstance(err, ChecksumError)
                                            else "deadline" if isinstance(err, TimeoutError) else "peer_error")
                        if isinstance(err, ChecksumError) and (actor := self._actor(node_id)) is not None:
                            actor.report_corrupt.remote(pack_keys(keys[k:k + 1]))
                else:
                    reply = ray.get(handle, timeout=max(0.0, deadline - time.monotonic()))
                    k = (self._consume_pin(keys, reply, out, start) if kind in ("pin", "via")
                         else self._consume_pull(reply, out, start))
            except (ray.exceptions.RayError, TimeoutError, WireError) as e:
                self.counts[f"fetch_error_{type(e).__name__}"] += 1
                self.counts[f"pull_failure_{type(e).__name__}"] += 1
                self._last_error = "deadline" if isinstance(e, TimeoutError) else "peer_error"
                log.debug("fetch of %d chunk(s) (%s) failed: %s", len(keys), kind, e)
                if kind in ("pin", "via"):
                    self._pending_pins.append(handle)
            got[kind] += k
            pos += k
            now = time.monotonic()
            if k:  # what the cost model learns links from; runs overlap, so this is an upper bound on each
                source = self._source(match.chunks[start].holders[0])
                self.cost.observe_transfer(source, k * self.spec.chunk_bytes, now - t_prev)
                self._samples.append(("transfer", source, now - t_prev))
            t_prev = now
            if k < len(keys):
                self._pending_pins.extend(h for kd, _s, _k, h, _n in inflight[idx + 1:] if kd in ("pin", "via"))
                break
        return got["pin"], got["via"] + got["tcp"] + got["ray"]

    def _chunk_segments(self, out: torch.Tensor, index: int) -> list[np.ndarray]:
        """The writable pieces of `out` that chunk `index` fills, in chunk byte order: for each layer, K then V,
        one contiguous run of chunk_tokens x heads x head_dim."""
        dst = self._chunk_dst(out, index)
        return [dst[layer, kv].numpy() for layer in range(self.spec.num_layers) for kv in (0, 1)]

    def _chunk_dst(self, out: torch.Tensor, index: int) -> torch.Tensor:
        C, s = self.spec.chunk_tokens, self.spec
        u8 = out.view(torch.uint8).view(s.num_layers, 2, out.shape[2], s.num_kv_heads * s.head_dim * s.element_size)
        return u8[:, :, index * C:(index + 1) * C]

    def _copy_in(self, out: torch.Tensor, index: int, src) -> None:
        s = self.spec
        view = torch.frombuffer(src, dtype=torch.uint8).view(s.num_layers, 2, s.chunk_tokens, -1)
        self._chunk_dst(out, index).copy_(view)

    def _consume_pin(self, keys: list[bytes], reply: bytes, out: torch.Tensor, start: int) -> int:
        pin_id, rows, slab_path = unpack_pin_reply(reply)
        try:
            if self._slab is None or slab_path != self._slab.path:
                self.counts["fetch_stale_slab"] += 1
                self._reattach_local()
                return 0
            k = 0
            for j, row in enumerate(rows):
                if row.nbytes != self.spec.chunk_bytes:
                    break
                src = self._slab.view(row.slot * self._slab_slot_bytes, row.nbytes)
                self._copy_in(out, start + j, src)
                if checksum(src) != row.checksum:  # after the copy: catches a slot overwritten under us
                    self.counts["fetch_checksum_failures"] += 1
                    self._last_error = "checksum"
                    self._local.report_corrupt.remote(pack_keys(keys[j:j + 1]))
                    break
                k += 1
            return k
        finally:
            if rows:
                self._local.unpin.remote(pin_id)

    def _consume_pull(self, reply, out: torch.Tensor, start: int) -> int:
        header, data = reply
        rows = unpack_chunk_header(header)
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
            raise WireError("PullReply: buffer must be a uint8 array")
        k = off = 0
        for nbytes, c in rows:
            if nbytes != self.spec.chunk_bytes or off + nbytes > data.size:
                break
            piece = data[off:off + nbytes]
            if checksum(piece) != c:
                self.counts["fetch_checksum_failures"] += 1
                self._last_error = "checksum"
                break
            self._copy_in(out, start + k, piece)
            off += nbytes
            k += 1
        return k

    def _release_pending_pins(self) -> None:
        import ray

        if not self._pending_pins:
            return
        ready, self._pending_pins = ray.wait(self._pending_pins, num_returns=len(self._pending_pins), timeout=0)
        for ref in ready:
            try:
                pin_id, rows, _ = unpack_pin_reply(ray.get(ref))
                if rows:
                    self._local.unpin.remote(pin_id)
            except Exception:
                pass  # the node is gone or the pin expired: nothing to release

    def _actor(self, node_id: str):
        if node_id == self.node_id and self._local is not None:
            return self._local
        h = self._actors.get(node_id)
        if h is None:
            import ray

            from kvmesh.mesh import NAMESPACE, actor_name

            if not ray.is_initialized():  # a client outside Ray: never start or join a Ray cluster implicitly
                self.counts["fetch_node_unknown"] += 1
                return None
            try:
                h = ray.get_actor(actor_name(node_id), namespace=NAMESPACE)
            except ValueError:
                self.counts["fetch_node_unknown"] += 1
                return None
            self._actors[node_id] = h
        return h

    def _reattach_local(self) -> None:
        """The local KVNode restarted (new slab): map its new slab."""
        import ray

        from kvmesh.mesh import NodeHello

        try:
            hello = NodeHello.unpack(ray.get(self._local.hello.remote(), timeout=5))
        except Exception:
            return
        if self._slab is not None:
            self._slab.close()
        self._slab = SlabReader.open(hello.info.slab_path, hello.info.slab_bytes)
        self._slab_slot_bytes = hello.info.slot_bytes

    # -- store --------------------------------------------------------------------------------------------------
    def store(self, tokens, kv: torch.Tensor, cache_salt: str | bytes | None = None) -> int:
        """Store the full chunks of `tokens` not already cached; `kv` is `[num_layers, 2, n, num_kv_heads,
        head_dim]` with `n >= len(tokens)`. Returns the number of chunks handed to the local node."""
        toks = as_tokens(tokens)
        kv = self._check_kv(kv, len(toks))
        hashes = chunk_hashes(self.spec.namespace, toks, self.spec.chunk_tokens, self._salt(cache_salt))
        if not hashes:
            return 0
        if self._local is None:
            self.counts["store_no_local_node"] += 1
            return 0
        held = self._recently_seen(hashes)  # usually: the lookup that preceded this store saw them all
        if held is None:
            held, _ = self._live_holders(hashes, prefix_only=False)
        else:
            self.counts["store_checked_by_lookup"] += 1
        todo = [i for i in range(len(hashes)) if i >= len(held) or not held[i]]
        c = self.spec.chunk_tokens
        return self._hand_over(hashes[0], [hashes[i] for i in todo],
                               [kv[:, :, i * c:(i + 1) * c] for i in todo])

    def _hand_over(self, group: bytes, keys: list[bytes], chunks: list[torch.Tensor]) -> int:
        """Copy `chunks` (each of the spec's `chunk_shape`, any strides) into one staging buffer and hand them to
        the local node without waiting for it. Returns how many were handed over: 0 when too many stores are
        already in flight (dropped and counted: a store never blocks the engine). Chunks on a GPU are copied
        out on a side stream into page-locked staging and handed over from a background thread once the copy
        is done: neither the caller nor its compute stream waits for the device-to-host copy."""
        if not keys:
            return 0
        self._reap_stores()
        if len(self._pending_stores) + self._staged_jobs >= MAX_INFLIGHT_STORES:
            self.counts["store_dropped_busy"] += 1
            return 0
        s, cb = self.spec, self.spec.chunk_bytes
        if chunks[0].is_cuda:
            self._stage_from_device(group, keys, chunks)
        else:
            staging = np.empty(len(keys) * cb, dtype=np.uint8)
            st = torch.from_numpy(staging).view(s.torch_dtype).view(len(keys), *s.chunk_shape)
            for j, chunk in enumerate(chunks):
                st[j].copy_(chunk)
            self._send(group, keys, staging)
        self.counts["stored_chunks"] += len(keys)
        return len(keys)

    def _stage_from_device(self, group: bytes, keys: list[bytes], chunks: list[torch.Tensor]) -> None:
        s, cb = self.spec, self.spec.chunk_bytes
        device = chunks[0].device
        stream = self._store_streams.get(device)
        if stream is None:
            stream = self._store_streams[device] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the KV as computed so far, nothing later
        staging = torch.empty(len(keys) * cb, dtype=torch.uint8, pin_memory=True)
        st = staging.view(s.torch_dtype).view(len(keys), *s.chunk_shape)
        with torch.cuda.stream(stream):
            for j, chunk in enumerate(chunks):
                st[j].copy_(chunk, non_blocking=True)
                chunk.record_stream(stream)  # its memory is not reused (the engine may free it) before the copy
            done = torch.cuda.Event()
            done.record(stream)
        with self._store_lock:
            self._staged_jobs += 1
            if self._stager is None:
                self._stager = threading.Thread(target=self._stage_loop, name="kvmesh-client-stores", daemon=True)
                self._stager.start()
        self._staged.put((group, keys, staging, done))

    def _stage_loop(self) -> None:
        while True:
            job = self._staged.get()
            try:
                if job is None:
                    return
                group, keys, staging, done = job
                done.synchronize()
                self._send(group, keys, staging.numpy())
            except Exception as e:  # a store is best effort: count it, never raise into the engine
                self.counts["store_failures"] += 1
                log.warning("kvmesh: handing a store to the node failed: %s", e)
            finally:
                if job is not None:
                    with self._store_lock:
                        self._staged_jobs -= 1
                self._staged.task_done()

    def _send(self, group: bytes, keys: list[bytes], staging: np.ndarray) -> None:
        """Checksum the staged chunks and hand them to the local node (a Ray call; not waited for)."""
        cb = self.spec.chunk_bytes
        items = [StoreItem(group, key, cb, checksum(staging[j * cb:(j + 1) * cb])) for j, key in enumerate(keys)]
        ref = self._local.store.remote(pack_store(items), staging)
        with self._store_lock:
            self._pending_stores.append(ref)

    def _check_kv(self, kv, num_tokens: int) -> torch.Tensor:
        s = self.spec
        if not isinstance(kv, torch.Tensor):
            raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
        if kv.dtype != s.torch_dtype:
            raise ValueError(f"kv has dtype {kv.dtype}, but the spec says {s.dtype}")
        if (kv.dim() != 5 or kv.shape[0] != s.num_layers or kv.shape[1] != 2 or kv.shape[3] != s.num_kv_heads
                or kv.shape[4] != s.head_dim):
            raise ValueError(f"kv must have shape [{s.num_layers}, 2, n, {s.num_kv_heads}, {s.head_dim}], "
                             f"got {list(kv.shape)}")
        if kv.shape[2] < num_tokens:
            raise ValueError(f"kv holds {kv.shape[2]} tokens, fewer than the {num_tokens} in tokens")
        kv = kv.detach()
        return kv if kv.stride(-1) == 1 else kv.contiguous()

    def _reap_stores(self) -> None:
        with self._store_lock:
            pending = self._pending_stores
        if pending:
            import ray

            _, left = ray.wait(pending, num_returns=len(pending), timeout=0)
            with self._store_lock:
                done = set(pending) - set(left)
                self._pending_stores = [r for r in self._pending_stores if r not in done]

    def flush(self, timeout_s: float = 30.0) -> int:
        """Wait until every store handed over so far is in the node's tier and registered; returns how many
        chunks the node actually stored."""
        import ray

        self._staged.join()  # stores still being copied off a GPU are handed over first
        with self._store_lock:
            refs, self._pending_stores = self._pending_stores, []
        stored = 0
        for r in refs:
            try:
                stored += ray.get(r, timeout=timeout_s)
            except (ray.exceptions.RayError, TimeoutError):
                self.counts["store_failures"] += 1
        return stored

    # -- by explicit chunk keys -----------------------------------------------------------------------------------
    # For engines that name their pages themselves (SGLang's HiCache hands out page hashes, never token ids): the
    # caller derives each key under this client's spec namespace and salt (`root_hash`), so keys of different
    # specs never meet, and names the directory group they are registered in.
    def lookup_keys(self, group: bytes, keys: list[bytes]) -> Match:
        """`lookup` for caller-made keys: the longest run of `keys`, from the first, with a live holder in
        directory group `group`. Pure read, one round trip; no cost-model plan (the engine decides)."""
        self._check_keys(group, keys)
        self.counts["lookups"] += 1
        holders, why = [], None
        if keys:
            try:
                values = self._lookup_raw(group, keys)
            except redis.RedisError as e:
                log.debug("lookup failed: %s", e)
                values, why = None, "directory_error"
            if values is not None:
                holders, why = self.directory.longest_prefix_why(values, self._current_table(), prefer=self.node_id)
        chunks = tuple(ChunkMatch(k, hs) for k, hs in zip(keys, holders))
        if keys:
            self.counts["hits" if chunks else f"miss_{why}"] += 1
        return Match(self.spec.namespace, self.spec.chunk_tokens, chunks, why=why or "", group=group)

    def store_keys(self, group: bytes, keys: list[bytes], chunks) -> int:
        """`store` for caller-made keys: `chunks[i]` (a tensor of the spec's dtype and `chunk_shape`, any
        strides, e.g. a view into an engine's host pool) is chunk `keys[i]`, registered in directory group
        `group`. Those not already cached are copied out before this returns and handed to the local node;
        returns their count."""
        self._check_keys(group, keys)
        s = self.spec
        if len(chunks) != len(keys):
            raise ValueError(f"chunks has {len(chunks)} entries for {len(keys)} keys")
        for c in chunks:
            if not isinstance(c, torch.Tensor) or c.dtype != s.torch_dtype or tuple(c.shape) != s.chunk_shape:
                raise ValueError(f"each chunk must be a {s.dtype} tensor of shape {list(s.chunk_shape)}")
        if not keys:
            return 0
        if self._local is None:
            self.counts["store_no_local_node"] += 1
            return 0
        try:
            table = self._current_table()
            held = [bool(self.directory.longest_prefix([v], table, prefer=self.node_id))
                    for v in self._lookup_raw(group, keys)]
        except redis.RedisError:
            held = [False] * len(keys)
        todo = [i for i in range(len(keys)) if not held[i]]
        return self._hand_over(group, [keys[i] for i in todo], [chunks[i] for i in todo])

    @staticmethod
    def _check_keys(group, keys) -> None:
        if not isinstance(group, bytes) or len(group) != HASH_BYTES:
            raise ValueError(f"group must be {HASH_BYTES} bytes")
        if not isinstance(keys, (list, tuple)) or not all(isinstance(k, bytes) and len(k) == HASH_BYTES
                                                          for k in keys):
            raise ValueError(f"keys must be a list of {HASH_BYTES}-byte chunk keys")

    def close(self) -> None:
        if self._stager is not None:
            self._staged.put(None)
            self._stager.join(timeout=10)
        self._closed.set()
        self._refresher.join(timeout=2)
        self._flush_telemetry()
        if self._slab is not None:
            self._slab.close()
            self._slab = None
        self._data.close()
        if self._verify_pool is not None:
            self._verify_pool.shutdown(wait=False)
        self.directory.close()

    def __enter__(self) -> "KVMeshClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _device(device) -> torch.device:
    """`device` as a torch.device: the CPU, or a CUDA device that this process can use."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):  # torch's words for a bad name or type
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


def connect(spec: KVSpec, redis_url: str | None = None, *, cache_salt: str | bytes | None = None,
            config: KVMeshConfig | None = None, node_id: str | None = None, **options) -> KVMeshClient:
    """A client for `spec` in this process. Finds the KVNode on this process's Ray node (or on `node_id`: for an
    engine whose Ray connection lands elsewhere, e.g. a child process of an actor) and takes its config (directory
    URL included) unless `redis_url`/`config`/`options` say otherwise."""
    if not isinstance(spec, KVSpec):
        raise TypeError(f"spec must be a kvmesh.KVSpec, got {type(spec).__name__}")
    if node_id is not None and (not isinstance(node_id, str) or not node_id):
        raise ValueError(f"node_id must be a Ray node id (hex string), got {node_id!r}")
    salt_bytes(cache_salt)
    from kvmesh.mesh import NAMESPACE, NodeHello, _require_ray, actor_name

    ray = _require_ray()
    named = node_id is not None
    node_id = node_id or ray.get_runtime_context().get_node_id()
    try:
        local = ray.get_actor(actor_name(node_id), namespace=NAMESPACE)
        hello = NodeHello.unpack(ray.get(local.hello.remote(), timeout=30))
    except (ValueError, ray.exceptions.RayError) as e:
        if named:
            raise RuntimeError(f"no KVNode answers on Ray node {node_id} (call kvmesh.start first): {e}") from None
        local, hello = None, None
    if hello is None and redis_url is None and config is None:
        raise RuntimeError("no KVNode runs on this Ray node (call kvmesh.start first) and no redis_url was given")
    cfg = config or (hello.config if hello else KVMeshConfig())
    if redis_url is not None:
        cfg = cfg.replace(redis_url=redis_url)
    cfg = cfg.replace(**options)
    if spec.chunk_bytes > cfg.slot_bytes:
        raise ValueError(f"spec.chunk_tokens={spec.chunk_tokens} makes {spec.chunk_bytes}-byte chunks, larger than "
                         f"the nodes' slot_bytes={cfg.slot_bytes}; use fewer chunk_tokens or bigger slots")
    slab = (hello.info.slab_path, hello.info.slab_bytes, hello.info.slot_bytes) if hello else None
    return KVMeshClient(spec, cfg, node_id, local, slab, cache_salt)
