"""The scheduler side of the vLLM connector: which prefix to load for each request, and which chunks to save.

    lookup(request, num_computed_tokens) -> (tokens, async)   read, one directory round trip: the longest run of
                                                              cached chunks beyond vLLM's own prefix cache, cut by
                                                              the cost model
    allocated(request, block_ids, num_external_tokens)        plans the load into the blocks vLLM allocated
    build_step(scheduler_output) -> StepMeta                  hands this step's loads and saves to the workers
    worker_output(finished_recving, report)                   loads that ended; failed loads (that request is not
                                                              offered a load again, an unreachable holder is
                                                              avoided for a lease); prefill and fetch times for
                                                              the cost model
    uncache_failed(invalid_block_ids)                         failed blocks, and what was computed over them, out
                                                              of vLLM's prefix cache
    finished(request) -> bool                                 whether vLLM must keep the request's blocks until
                                                              the workers report it (a load or a save may still
                                                              read or write them)

Saves: each step, the prompt chunks that become fully computed in it are saved by the workers after the step's
forward pass (only prompt tokens: output tokens of an async-scheduled step may not be known here yet). When the
workers copy them out of the blocks after the step (`save_copy="background"`), a finished request's blocks stay
allocated until the workers report that its copies are done.

KV cache groups. A model with several groups (vLLM's hybrid allocator: full-attention and sliding-window layers)
has one spec per group, and every chunk of every group is its own kvmesh chunk. A hit must hold in every group:
full-attention groups need every chunk from the first one vLLM lacks; a sliding-window group only the chunks its
window reaches back to from the hit's end (`KVSpec.window_start_chunk`), which are also the only ones of it that
vLLM keeps (the blocks before are its null block) and the only ones loaded. Saves of a sliding-window group cover
the chunks within the window of the prompt's last chunk boundaries (what a later prompt sharing this one, or
extending it, needs), not the whole prompt. The lookup is one directory round trip per group (the first group's
gives the cost model's plan), and one more for a group whose window moved when another group cut the hit short.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from kvmesh.integrations.vllm_clients import EngineClients
from kvmesh.integrations.vllm_meta import LoadJob, SaveJob, StepMeta, WorkerReport
from kvmesh.integrations.vllm_options import ConnectorOptions, lora_identity, request_salt
from kvmesh.match import Match
from kvmesh.tiers import TIER_DISK

log = logging.getLogger("kvmesh.vllm")


@dataclass(slots=True)
class _Request:
    """What the scheduler side knows of one request; created on its first lookup, dropped when it finishes."""

    tokens: np.ndarray  # prompt token ids, <u4
    salt: str | None
    lora_id: str | None
    skip: str  # why kvmesh leaves it alone ("multimodal", "prompt_embeds"), "" when it does not
    hashes: dict[int, list[bytes]] = field(default_factory=dict)  # group -> chunk hashes of the prompt under
    # that group's spec, computed on first need
    match: Match | None = None  # the last lookup's Match in the first group (chunks from `match_first` on)
    match_first: int = 0
    local: int = 0  # vLLM's own computed tokens at that lookup
    hit_end: int = 0  # the chunk the last lookup's hit ends at (every group holds what it needs up to there)
    saved: int | None = None  # prompt chunks present in kvmesh or saved by now; None until first scheduled
    had_save: bool = False  # a background-copy save was handed to the workers: keep the blocks until they report
    loading: bool = False  # an asynchronous load was handed to the workers and has not ended
    load_failed: bool = False  # a load of it failed: vLLM recomputes, and it is never offered a load again
    # vLLM's computed tokens at the lookup last counted: vLLM asks again every step while a request waits for
    # blocks, and only a request asked about anew (first, or after a preemption) is counted again
    counted_at: int | None = None


MAX_LOOKUP_ROUNDS = 8  # groups cutting each other's hit short: give up (no hit) after this many rounds
MAX_GONE = 4096  # finished requests' block tables kept at most
GONE_CALLS = 4  # update_connector_output calls a finished request's block table is kept for (steps still in flight)


class SchedulerSide:
    def __init__(
        self, specs, connect, options: ConnectorOptions, block_size: int, kv_role: str, background_copy: bool
    ) -> None:
        self.specs = tuple(specs)  # one per KV cache group, in vLLM's group order
        spec = self.spec = self.specs[0]
        # lookup order: full-attention groups first (their hits are prefixes), then sliding windows, widest first
        self.order = sorted(range(len(self.specs)), key=lambda g: (self.specs[g].window != 0, -self.specs[g].window, g))
        self.background_copy = background_copy  # saves read blocks after the step: keep finished ones for them
        self.options = options
        self.block_size = block_size
        self.chunk = spec.chunk_tokens
        self.per_chunk = self.chunk // block_size
        self.load = kv_role in ("kv_both", "kv_consumer")
        self.save = kv_role in ("kv_both", "kv_producer")
        self._clients = EngineClients(self.specs, connect, share_cost=True)
        self.counts = self._clients.base.counts  # shared by every client of this side (one per LoRA adapter
        # and group)
        self._reqs: dict[str, _Request] = {}
        self._loads: list[LoadJob] = []  # planned since the last step was built
        self._fingerprints: dict[str, str] = {}
        # node -> monotonic time until which its chunks are not offered: a worker could not reach it, and the
        # directory may list a dead node until its lease ends (vLLM would otherwise retry the same load)
        self._unreachable: dict[str, float] = {}
        # vLLM's KV cache manager (`get_block_ids(req_id)`, `evict_blocks(ids)`), bound by vLLM once it is built
        # (None when this side runs alone): failed loads are taken out of vLLM's own prefix cache through it
        self.prefix_cache = None
        # the block tables of requests that finished lately, with how many more `uncache_failed` calls keep them:
        # with async scheduling a request can be aborted while the step that loaded it is still running, and the
        # failure reported after vLLM took its blocks back (its table is gone from the KV cache manager by then)
        self._gone: dict[str, tuple[list[int], int]] = {}

    def client(self, lora_id: str | None, group: int = 0):
        return self._clients.get(lora_id, group)

    # -- lookup ---------------------------------------------------------------------------------------------------
    def _track(self, request) -> _Request:
        st = self._reqs.get(request.request_id)
        if st is None:
            skip = (
                "multimodal"
                if getattr(request, "mm_features", None)
                else "prompt_embeds"
                if getattr(request, "prompt_embeds", None) is not None
                or getattr(request, "prompt_is_token_ids", None) is not None
                or request.prompt_token_ids is None
                else ""
            )
            toks = np.asarray(request.prompt_token_ids or [], dtype="<u4")
            st = _Request(
                toks,
                request_salt(self.options.cache_salt, getattr(request, "cache_salt", None)),
                lora_identity(getattr(request, "lora_request", None), self._fingerprints),
                skip,
            )
            if skip:
                self.counts[f"vllm_skip_{skip}"] += 1
            self._reqs[request.request_id] = st
        return st

    def _hashes(self, st: _Request, group: int = 0) -> list[bytes]:
        h = st.hashes.get(group)
        if h is None:
            h = st.hashes[group] = self.client(st.lora_id, group).hashes(st.tokens, st.salt)
        return h

    def lookup(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._track(request)
        st.match, st.hit_end = None, 0
        if not self.load or st.skip or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        if st.load_failed:
            self.counts["vllm_skip_after_failed_load"] += 1
            return 0, False
        n, c = len(st.tokens), self.chunk
        last = (n - 1) // c  # vLLM computes at least the last prompt token itself
        first = num_computed_tokens // c  # a chunk vLLM holds only in part is loaded whole, its rest written
        if first >= last:
            return 0, False
        # the client's breaker: a directory call of this client failed moments ago (no lookup timeout per request
        # while the directory is away; the client's refresh closes it as soon as the directory answers)
        if not self.client(st.lora_id, self.order[0]).view.allow():
            self.counts["vllm_skip_directory_down"] += 1
            return 0, False
        count = st.counted_at != num_computed_tokens
        st.counted_at = num_computed_tokens
        found: dict[tuple[int, int], tuple[int, int, Match]] = {}  # (group, lo) -> (asked end, present, Match)
        plan_box: list = []
        end = self._converge(st, first, last, found, plan_box, count)
        plan, first_lo = plan_box[0] if plan_box else (None, first)
        g0 = self.order[0]
        lo0 = first if not self.specs[g0].window else max(first, self.specs[g0].window_start_chunk(end * c))
        if end > first and self.options.cost_model and plan is not None:
            if first_lo + plan.end < end:  # the cost model says recomputing the rest is cheaper
                self.counts["vllm_cost_model_cut_chunks"] += (end - first_lo - plan.end) * count
                end = self._converge(st, first, first_lo + plan.end, found, plan_box, count)
                lo0 = first if not self.specs[g0].window else max(first, self.specs[g0].window_start_chunk(end * c))
        self.counts["vllm_lookup_tokens"] += (n - num_computed_tokens) * count
        external = end * c - num_computed_tokens
        if end <= first or external <= 0:
            return 0, False
        hit = found.get((g0, lo0))
        st.match = hit[2].truncate(end - lo0) if hit is not None else None
        st.match_first, st.local, st.hit_end = lo0, num_computed_tokens, end
        self.counts["vllm_hit_tokens"] += external * count
        return external, self.options.load_mode == "async"

    def _converge(self, st: _Request, first: int, end: int, found: dict, plan_box: list, count: bool = True) -> int:
        """The largest hit end (in chunks, <= `end`) that every group can serve: full-attention groups all chunks
        from `first`, sliding-window groups those their window needs. `found` caches what was looked up."""
        c = self.chunk
        for _ in range(MAX_LOOKUP_ROUNDS):
            start = end
            for g in self.order:
                spec = self.specs[g]
                lo = first if not spec.window else max(first, spec.window_start_chunk(end * c))
                if lo >= end:
                    continue  # a window of one token needs no chunk at all
                end = min(end, lo + self._present(st, g, lo, end, found, plan_box, count))
                if end <= first:
                    return first
            if end == start:
                return end
        self.counts["vllm_lookup_no_convergence"] += 1
        return first

    def _present(self, st: _Request, g: int, lo: int, end: int, found: dict, plan_box: list, count: bool = True) -> int:
        """How many chunks of group `g` from chunk `lo` on (of those before `end`) some reachable node holds:
        one directory round trip, unless an earlier lookup from `lo` already covered `end`."""
        hit = found.get((g, lo))
        if hit is not None and hit[0] >= end:
            return min(hit[1], end - lo)
        client = self.client(st.lora_id, g)
        n = len(st.tokens)
        plan = None
        if lo == 0 and not self.specs[g].window and not plan_box:
            # from the prompt's start: also detects another spec of this model holding it ("spec_mismatch")
            match = client.lookup(
                st.tokens, st.salt, max_chunks=end, allow_split=False, cost_model=self.options.cost_model, count=count
            )
            plan = match.plan
        else:
            hashes = self._hashes(st, g)
            match = client.lookup_keys(hashes[0], hashes[lo:end], count=count)
            if not plan_box and match.num_chunks and self.options.cost_model:
                plan = client.plan(match, n - lo * self.chunk, allow_split=False, count=count)
        if not plan_box:
            plan_box.append((plan, lo))
        k = self._reachable(match)
        if k < match.num_chunks:
            self.counts["vllm_cut_unreachable_chunks"] += (match.num_chunks - k) * count
        found[(g, lo)] = (end, k, match)
        return k

    def _reachable(self, match) -> int:
        """Leading chunks of `match` with a holder that no worker recently failed to reach."""
        if not self._unreachable:
            return match.num_chunks
        now = time.monotonic()
        self._unreachable = {n: t for n, t in self._unreachable.items() if t > now}
        for i, ch in enumerate(match.chunks):
            if all(h.node_id in self._unreachable for h in ch.holders):
                return i
        return match.num_chunks

    def sources(self, request, num_external_tokens: int) -> dict[str, int]:
        """Tokens of a hit by where they come from: "host" (this node's CPU tier), "disk" or "p2p" (a peer)."""
        st = self._reqs.get(request.request_id)
        out: dict[str, int] = {}
        if st is None or st.match is None:
            return out
        node = self.client(st.lora_id, self.order[0]).node_id
        lo, hi = st.local, st.local + num_external_tokens
        for i, ch in enumerate(st.match.chunks):
            a, b = (st.match_first + i) * self.chunk, (st.match_first + i + 1) * self.chunk
            tokens = max(0, min(b, hi) - max(a, lo))
            holder = ch.holders[0]
            where = "disk" if holder.tier == TIER_DISK else "host" if holder.node_id == node else "p2p"
            out[where] = out.get(where, 0) + tokens
        return {k: v for k, v in out.items() if v}

    def _reuse_by_node(self, st: _Request, num_external_tokens: int) -> tuple[int, int]:
        """Tokens of a hit held by this node (its slab or its disk) and by peers: reuse counts where KV came from by
        node, whatever the tier (`sources` names the tier, for vLLM)."""
        here = there = 0
        if st.match is None:
            return 0, 0
        node = self.client(st.lora_id, self.order[0]).node_id
        lo, hi = st.local, st.local + num_external_tokens
        for i, ch in enumerate(st.match.chunks):
            a, b = (st.match_first + i) * self.chunk, (st.match_first + i + 1) * self.chunk
            tokens = max(0, min(b, hi) - max(a, lo))
            if ch.holders[0].node_id == node:
                here += tokens
            else:
                there += tokens
        return here, there

    # -- planning -------------------------------------------------------------------------------------------------
    def allocated(self, request, block_ids, num_external_tokens: int, null_block: int | None = None) -> None:
        """vLLM allocated blocks for `num_external_tokens` after the local hit: plan the loads, one per KV cache
        group. `block_ids[g]` are group g's blocks (a single list: group 0 of a one-group model); `null_block` is
        the id of vLLM's null block, which stands for the blocks a sliding window does not keep (never loaded).
        Never fails: a load that cannot be planned still becomes a job, which the workers report as failed (vLLM
        recomputes it)."""
        if num_external_tokens <= 0:
            return
        if block_ids and not isinstance(block_ids[0], (list, tuple)):
            block_ids = [block_ids]
        try:
            self._allocated(request, block_ids, num_external_tokens, null_block)
        except Exception as e:  # vLLM now waits for these blocks: a job must report them, as failed
            log.warning("kvmesh: planning the load of %s failed: %s", request.request_id, e)
            self.counts["vllm_errors_alloc"] += 1
            st = self._reqs.get(request.request_id)
            local = st.local if st is not None else 0
            lo, hi = local // self.block_size, (local + num_external_tokens) // self.block_size
            sync = self.options.load_mode == "sync"
            for g, ids in enumerate(block_ids):
                self._loads.append(LoadJob(request.request_id, b"", 0, 0, list(ids[:hi]), lo, hi, None, None, sync, g))
            if st is not None:
                st.loading = not sync

    def _allocated(self, request, block_ids, num_external_tokens: int, null_block: int | None) -> None:
        st = self._track(request)
        bs, m = self.block_size, self.per_chunk
        local = st.local
        fill_end = (local + num_external_tokens) // bs  # blocks [.., fill_end) become computed
        end = min(-(-fill_end // m), st.hit_end)
        sync = self.options.load_mode == "sync"
        for g, ids in enumerate(block_ids):
            live = local // bs  # the first block vLLM keeps after its own hit
            while null_block is not None and live < fill_end and ids[live] == null_block:
                live += 1
            first = min(live // m, end)
            job = LoadJob(
                request.request_id,
                st.tokens[: end * self.chunk].tobytes(),
                first,
                end,
                list(ids[first * m : first * m + max(fill_end - first * m, 0)]),
                skip_blocks=live - first * m,
                fill_blocks=fill_end - first * m,
                salt=st.salt,
                lora_id=st.lora_id,
                sync=sync,
                group=g,
            )
            self._loads.append(job)
        st.loading = not sync
        here, there = self._reuse_by_node(st, num_external_tokens)
        self.client(st.lora_id).record_request(here, there, max(0, len(st.tokens) - local - num_external_tokens))

    def build_step(self, so) -> StepMeta:
        meta = StepMeta(loads=self._loads, preempted=set(getattr(so, "preempted_req_ids", None) or ()))
        self._loads = []
        for job in meta.loads:  # (a request preempted by the next schedule() loses its table before the report)
            self._keep_table(job.req_id)
        before: dict[str, int] = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        new_ids = set(before)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            before[req_id] = cached.num_computed_tokens[i]
        scheduled = so.num_scheduled_tokens
        if len(scheduled) == 1:  # one prompt computed from its start and nothing else: a recompute's cost
            ((req_id, n),) = scheduled.items()
            st = self._reqs.get(req_id)
            # (suffix prefills after a load are not observed: fitted on those alone, the model would price a
            # whole prompt like its suffix and refuse every load)
            if st is not None and before.get(req_id) == 0 and n > 1:
                meta.prefill = (min(n, len(st.tokens)), 0)
        if not self.save:
            return meta
        blocks_of = getattr(so, "kv_connector_block_state", None)
        for req_id, n in scheduled.items():
            st = self._reqs.get(req_id)
            if st is None or st.skip or req_id not in before:
                continue
            if st.saved is None or req_id in new_ids and st.saved < before[req_id] // self.chunk:
                st.saved = before[req_id] // self.chunk  # what vLLM or kvmesh already held
            done = min(before[req_id] + n, len(st.tokens)) // self.chunk
            if done <= st.saved:
                continue
            ids = blocks_of.get_block_ids(req_id) if blocks_of is not None else None
            if not ids:
                self.counts["vllm_save_no_blocks"] += 1
                continue
            m = self.per_chunk
            tokens = st.tokens[: done * self.chunk].tobytes()
            for g, spec in enumerate(self.specs):
                lo = max(st.saved, self._window_save_start(spec, len(st.tokens)))
                if lo < done:
                    meta.saves.append(
                        SaveJob(req_id, tokens, lo, done, list(ids[g][lo * m : done * m]), st.salt, st.lora_id, g)
                    )
            st.saved = done
            st.had_save = st.had_save or self.background_copy
        return meta

    def _window_save_start(self, spec, prompt_tokens: int) -> int:
        """The first chunk of a prompt a group saves: 0 for full attention; for a sliding window, the first chunk
        the window reaches back to from the prompt's last hit boundary (a later request repeating the prompt
        loads up to there; one extending it, from its last full chunk on, needs less)."""
        if not spec.window:
            return 0
        return spec.window_start_chunk(((prompt_tokens - 1) // self.chunk) * self.chunk)

    # -- completion -----------------------------------------------------------------------------------------------
    def worker_output(self, finished_recving, report: WorkerReport | None) -> None:
        for req_id in finished_recving or ():
            st = self._reqs.get(req_id)
            if st is not None:
                st.loading = False
        if report is not None:
            client = self._clients.base
            for req_id, node in report.failed_loads:
                st = self._reqs.get(req_id)
                if st is not None:
                    st.load_failed = True
                    st.saved = None  # the chunks vLLM now recomputes are saved again (the failed step's were not)
                if node:
                    self._unreachable[node] = time.monotonic() + client.config.lease_s
                    self.counts["vllm_unreachable_reports"] += 1
            for req_id in report.resave:  # (a step's saves dropped because a load in it failed)
                st = self._reqs.get(req_id)
                if st is not None:
                    st.saved = None
            cost = client.cost
            for n_new, n_past, seconds in report.prefills:
                cost.prefill.observe(n_new, n_past, seconds)
            for source, nbytes, seconds in report.transfers:
                cost.observe_transfer(source, nbytes, seconds)

    def uncache_failed(self, invalid_block_ids) -> None:
        """Take the blocks a load failed to write out of vLLM's prefix cache, with every later block of each request
        that holds one. vLLM caches a synchronous load's blocks as it allocates them, and the blocks the step
        computed after them (over what was never written); under the recompute policy it leaves all of them cached
        until the request recomputes them. A request aborted or preempted first would leave them there for a later
        prompt with the same prefix to read as its own KV. (An asynchronous load's blocks are cached only once it
        ended, its failed ones never: evicting them changes nothing.) Block ids name blocks of one group: vLLM takes
        them only from a model with one KV cache group."""
        gone = self._gone
        self._gone = {r: (ids, left - 1) for r, (ids, left) in gone.items() if left > 1}
        if not invalid_block_ids or self.prefix_cache is None or len(self.specs) > 1:
            return
        evict = set(invalid_block_ids)
        # every unfinished request vLLM asked about (those that share the blocks too), and those finished lately
        tables = [self.prefix_cache.get_block_ids(req_id)[0] for req_id in self._reqs]
        tables += [ids for ids, _ in gone.values()]
        for ids in tables:
            first = next((i for i, b in enumerate(ids) if b in invalid_block_ids), None)
            if first is not None:
                evict.update(ids[first:])
        self.prefix_cache.evict_blocks(evict)
        self.counts["vllm_uncached_failed_blocks"] += len(evict)

    def _keep_table(self, req_id: str) -> None:
        """Keep a request's block table for the next few `uncache_failed` calls: a request finished, or preempted,
        while a step that loaded it was in flight (async scheduling) has none in vLLM when that step's failure comes."""
        if self.prefix_cache is None or len(self.specs) != 1:
            return
        tables = self.prefix_cache.get_block_ids(req_id)
        if len(tables) == 1 and tables[0]:  # (one KV cache group: vLLM reports invalid blocks of no other)
            self._gone.pop(req_id, None)
            self._gone[req_id] = (list(tables[0]), GONE_CALLS)
            if len(self._gone) > MAX_GONE:  # (steps that report nothing to the connector age nothing)
                del self._gone[next(iter(self._gone))]

    def finished(self, request) -> bool:
        """The request finished: True if vLLM must keep its blocks until the workers report it (an asynchronous
        load still writes them, or a save may still read them: the workers report every request they saved
        from, once its last save has read its blocks)."""
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False
        self._keep_table(request.request_id)  # (while vLLM still has it)
        pending = [j for j in self._loads if j.req_id == request.request_id]
        if pending:  # never handed to the workers: nothing will write the blocks
            self._loads = [j for j in self._loads if j.req_id != request.request_id]
            st.loading = False
        return st.loading or st.had_save

    def close(self) -> None:
        for c in self._clients.all():
            c.close()
