"""The connector's scheduler side on its own: block arithmetic of loads and saves, when vLLM must keep blocks, and
what a failed load changes. A stand-in client answers lookups from a dict (pure logic: no Ray, Redis or engine)."""

from collections import Counter
from types import SimpleNamespace as NS

import numpy as np

from kvmesh.client import ChunkMatch, Match
from kvmesh.cost import LoadPlan
from kvmesh.directory import Holder
from kvmesh.integrations.vllm_options import ConnectorOptions
from kvmesh.integrations.vllm_meta import WorkerReport
from kvmesh.integrations.vllm_scheduler import SchedulerSide
from kvmesh.spec import KVSpec

BS, C = 128, 256  # vLLM's CPU block size; two blocks per chunk
SPEC = KVSpec("m@1", 2, 2, 64, "bfloat16", chunk_tokens=C)


class Client:
    """Holds chunk i of every prompt on `holders[i]` (a node id), for the first `cached` chunks."""

    def __init__(self, cached: int, node: str = "me") -> None:
        self.cached, self.node_id = cached, node
        self.holders = {}
        self.tiers = {}  # chunk -> its holder's tier (default: the CPU tier)
        self.counts: Counter = Counter()
        self.config = NS(lease_s=5.0)
        self.cost = NS(prefill=NS(observe=lambda *a: None), observe_transfer=lambda *a: None)
        self.recorded = []
        self.view = NS(allow=lambda: True)  # the client's directory breaker: closed

    def share(self, other, cost=False):  # (KVMeshClient.share)
        self.counts = other.counts
        if cost:
            self.cost = other.cost

    def hashes(self, toks, salt=None):
        return [bytes([i]) * 16 for i in range(len(toks) // C)]

    def _match(self, first: int, last: int) -> Match:
        n = max(0, min(self.cached, last) - first)
        chunks = tuple(ChunkMatch(bytes([first + i]) * 16, (Holder(self.holders.get(first + i, "peer"), 1,
                                                                   self.tiers.get(first + i, 1)),))
                       for i in range(n))
        return Match(SPEC.namespace, C, chunks, plan=LoadPlan(0, n, "load"))

    def lookup(self, toks, salt=None, *, max_chunks=None, allow_split=True, cost_model=True, count=True):
        self.counts["lookups"] += count
        return self._match(0, max_chunks)

    def lookup_keys(self, group, keys, count=True):
        self.counts["lookups"] += count
        return self._match(keys[0][0], keys[0][0] + len(keys))

    def plan(self, match, prompt_tokens, allow_split=True, count=True):
        return LoadPlan(0, match.num_chunks, "load")

    def record_request(self, *a):
        self.recorded.append(a)


def side(cached: int, background: bool = False, **opts) -> tuple[SchedulerSide, Client]:
    client = Client(cached)
    return SchedulerSide((SPEC,), lambda spec: client, ConnectorOptions(**opts), BS, "kv_both", background), client


def request(req_id: str, n: int, salt=None):
    return NS(request_id=req_id, prompt_token_ids=list(range(3, 3 + n)), mm_features=[], prompt_embeds=None,
              prompt_is_token_ids=None, cache_salt=salt, lora_request=None, skip_reading_prefix_cache=False)


def step(new=(), cached=(), scheduled=None, blocks=None, preempted=()):
    """A SchedulerOutput stand-in: `new`/`cached` are (req_id, num_computed_tokens) pairs."""
    return NS(scheduled_new_reqs=[NS(req_id=r, num_computed_tokens=n) for r, n in new],
              scheduled_cached_reqs=NS(req_ids=[r for r, _ in cached], num_computed_tokens=[n for _, n in cached]),
              num_scheduled_tokens=scheduled or {}, preempted_req_ids=set(preempted),
              kv_connector_block_state=NS(get_block_ids=lambda r: blocks[r] if isinstance(blocks[r], tuple)
                                                     else (blocks[r],)))


def test_a_partly_local_chunk_is_fetched_whole_and_only_its_missing_blocks_written():
    s, client = side(cached=4)
    r = request("r", 1064)  # 4 full chunks; vLLM holds the first 3 blocks (384 tokens) itself
    assert s.lookup(r, 384) == (1024 - 384, True)  # chunks 1..3: the whole run after vLLM's hit
    blocks = list(range(100, 109))
    s.allocated(r, blocks, 1024 - 384)
    meta = s.build_step(step())
    (job,) = meta.loads
    assert (job.first_chunk, job.end_chunk) == (1, 4)
    assert job.block_ids == blocks[2:8]  # the blocks of chunks 1..3
    assert (job.skip_blocks, job.fill_blocks) == (1, 6)  # block 2 (the chunk's first) is vLLM's already
    assert np.frombuffer(job.tokens, "<u4").tolist() == list(range(3, 3 + 1024))
    assert s.build_step(step()).loads == []  # handed over once


def test_reuse_counts_this_nodes_disk_as_local_and_a_peers_as_peer():
    # before, every disk hit was counted as a peer's: a one-node mesh whose slab overflows to disk read 100 % peer
    from kvmesh.tiers import TIER_DISK

    s, client = side(cached=4)
    client.holders = {0: "me", 1: "me", 2: "peer", 3: "peer"}
    client.tiers = {1: TIER_DISK, 3: TIER_DISK}
    r = request("r", 1064)
    assert s.lookup(r, 0) == (1024, True)
    s.allocated(r, list(range(9)), 1024)
    assert client.recorded == [(2 * C, 2 * C, 1064 - 1024)]
    assert s.sources(r, 1024) == {"host": C, "disk": 2 * C, "p2p": C}  # (vLLM's own labels: by tier)


def test_the_last_prompt_token_is_always_left_to_vllm():
    s, _ = side(cached=8)
    assert s.lookup(request("a", 1024), 0) == (768, True)  # 1024 = 4 chunks, but the last token is computed
    assert s.lookup(request("b", 1025), 0) == (1024, True)
    assert s.lookup(request("c", 255), 0) == (0, False)


def test_saves_cover_each_prompt_chunk_once_as_it_becomes_full():
    s, _ = side(cached=0)
    r = request("r", 700)  # 2 full chunks (512 tokens), then 188 more
    assert s.lookup(r, 0) == (0, False)
    blocks = {"r": list(range(10, 16))}
    m1 = s.build_step(step(new=[("r", 0)], scheduled={"r": 300}, blocks=blocks))  # chunked prefill: 300 tokens
    assert [(j.first_chunk, j.end_chunk, j.block_ids) for j in m1.saves] == [(0, 1, [10, 11])]
    m2 = s.build_step(step(cached=[("r", 300)], scheduled={"r": 400}, blocks=blocks))
    assert [(j.first_chunk, j.end_chunk, j.block_ids) for j in m2.saves] == [(1, 2, [12, 13])]
    assert s.build_step(step(cached=[("r", 700)], scheduled={"r": 1}, blocks=blocks)).saves == []  # decode
    assert not s.finished(r)  # inline copies: the blocks were read in the step


def test_a_loaded_prefix_is_not_saved_again_and_background_copies_keep_blocks():
    s, _ = side(cached=2, background=True)
    r = request("r", 600)
    assert s.lookup(r, 0) == (512, True)
    s.allocated(r, list(range(5)), 512)
    s.build_step(step())
    assert s.finished(request("other", 10)) is False  # unknown request
    s.worker_output({"r"}, None)  # the load ended
    meta = s.build_step(step(new=[("r", 512)], scheduled={"r": 88}, blocks={"r": list(range(5))}))
    assert meta.saves == []  # chunks 0-1 came from kvmesh; 600 tokens make no third full chunk
    r2 = request("r2", 600)
    s.lookup(r2, 0)
    s.allocated(r2, list(range(10, 15)), 512)
    assert s.finished(r2) is False  # finished before its load was handed over: dropped, nothing to wait for
    assert s.build_step(step()).loads == []
    r3 = request("r3", 300)
    s.lookup(r3, 0)
    s.build_step(step(new=[("r3", 0)], scheduled={"r3": 300}, blocks={"r3": [20, 21, 22]}))
    assert s.finished(r3) is True  # its save copies blocks after the step: vLLM keeps them until reported


def test_a_failed_load_is_not_offered_again_and_its_holder_is_avoided():
    s, client = side(cached=4)
    r = request("r", 1100)
    assert s.lookup(r, 0)[0] == 1024
    s.allocated(r, list(range(9)), 1024)
    s.build_step(step())
    s.worker_output({"r"}, WorkerReport(failed_loads=[("r", "peer")]))
    assert s.lookup(r, 0) == (0, False)  # vLLM recomputes it
    assert client.counts["vllm_skip_after_failed_load"] == 1
    client.holders = {0: "me", 1: "me"}  # another prompt: its first two chunks live elsewhere than "peer"
    assert s.lookup(request("q", 1100), 0) == (512, True)
    assert client.counts["vllm_cut_unreachable_chunks"] == 2


def test_a_step_whose_saves_were_dropped_saves_those_requests_again():
    # a step with a failed load saves nothing (what it computed may rest on blocks never loaded): the workers say
    # which requests lost their saves, and the next step saves them from what vLLM holds of them then
    s, _ = side(cached=0)
    r = request("r", 1100)
    s.lookup(r, 0)
    blocks = {"r": list(range(10, 19))}
    m1 = s.build_step(step(new=[("r", 0)], scheduled={"r": 600}, blocks=blocks))
    assert [(j.first_chunk, j.end_chunk) for j in m1.saves] == [(0, 2)]
    s.worker_output(set(), WorkerReport(resave=["r", "gone"]))  # (a request that finished meanwhile: ignored)
    m2 = s.build_step(step(cached=[("r", 256)], scheduled={"r": 600}, blocks=blocks))  # vLLM recomputes from 256
    assert [(j.first_chunk, j.end_chunk) for j in m2.saves] == [(1, 3)]


class Cache:
    """vLLM's KV cache manager as the scheduler side uses it: block tables by request, and evictions."""

    def __init__(self, tables):
        self.tables, self.evicted = tables, set()

    def get_block_ids(self, req_id):
        return (self.tables.get(req_id, []),)

    def evict_blocks(self, ids):
        self.evicted |= set(ids)


def test_failed_blocks_and_the_blocks_computed_after_them_leave_vllms_prefix_cache():
    # a sync load of r failed from its block 14 on; q shares r's blocks through vLLM's prefix cache up to 15; p
    # holds none of them. Every block from the first failed one of each holder goes, and nothing of p's
    s, client = side(cached=4)
    for r in ("r", "q", "p"):
        s.lookup(request(r, 1100), 0)
    s.uncache_failed({14, 15})  # (no cache bound: a no-op)
    s.prefix_cache = Cache({"r": list(range(10, 20)), "q": [10, 11, 12, 13, 14, 15, 30, 31], "p": [40, 41]})
    s.uncache_failed(set())
    assert s.prefix_cache.evicted == set()
    s.uncache_failed({14, 15})
    assert s.prefix_cache.evicted == {14, 15, 16, 17, 18, 19, 30, 31}
    assert client.counts["vllm_uncached_failed_blocks"] == 8


def test_a_request_aborted_while_its_failed_load_was_in_flight_still_has_its_later_blocks_uncached():
    # async scheduling (vLLM's default): r is aborted after the step that loaded it was scheduled and before its
    # output came back; vLLM frees r's blocks (its table is gone) and then reports r's block 14 invalid. Blocks
    # 15..19 were computed over it and are still in vLLM's prefix cache under the prompt's hashes: once another
    # request recomputes and caches block 14, a third one reading the prefix gets the stale 15..19
    s, _ = side(cached=4)
    s.lookup(request("r", 1100), 0)
    s.prefix_cache = Cache({"r": list(range(10, 20))})
    s.finished(request("r", 1100))
    del s.prefix_cache.tables["r"]  # vLLM took the blocks back
    s.uncache_failed({14})
    assert s.prefix_cache.evicted == {14, 15, 16, 17, 18, 19}
    for _ in range(8):  # and is not kept for ever
        s.uncache_failed(set())
    s.prefix_cache.evicted.clear()
    s.uncache_failed({14})
    assert s.prefix_cache.evicted == {14}


def test_a_request_preempted_while_its_failed_load_was_in_flight_still_has_its_later_blocks_uncached():
    # async scheduling: the next schedule() preempts r (vLLM frees its blocks, telling the connector nothing) before
    # the output of the step that loaded it reports block 101 invalid
    s, _ = side(cached=4)
    s.prefix_cache = cache = Cache({})
    r = request("r", 1064)
    s.lookup(r, 0)
    cache.tables["r"] = list(range(100, 109))
    s.allocated(r, cache.tables["r"], 1024)
    (job,) = s.build_step(step()).loads
    del cache.tables["r"]  # preempted
    s.uncache_failed({101})
    assert cache.evicted == set(range(101, 109))


def test_a_salted_request_gets_the_engine_salt_in_front():
    s, client = side(cached=0, cache_salt="eng")
    s.lookup(request("r", 300, salt="t1"), 0)
    assert s._reqs["r"].salt == "eng\x00t1"


# -- several KV cache groups (vLLM's hybrid allocator): a full-attention group and a sliding-window one ------------
from kvmesh.spec import KVGroup, group_specs  # noqa: E402

WINDOW = 300  # tokens: from a boundary at 1024 the window reaches back to token 725, in chunk 2
HYBRID = group_specs(KVSpec("m@1", 2, 2, 64, "bfloat16", chunk_tokens=C),
                     [KVGroup(0, "full", 0, (1, 3)), KVGroup(1, "sliding_window", WINDOW, (0, 2))])


class GroupClient(Client):
    """Holds the chunks in `held` (indices) of every prompt, of one group's spec."""

    def __init__(self, spec, held) -> None:
        super().__init__(0)
        self.spec, self.held = spec, set(held)

    def hashes(self, toks, salt=None):
        return [self.spec.namespace[:8] + bytes([i]) * 8 for i in range(len(toks) // C)]

    def _run(self, first: int, last: int) -> Match:
        n = 0
        while first + n < last and first + n in self.held:
            n += 1
        chunks = tuple(ChunkMatch(self.spec.namespace[:8] + bytes([first + i]) * 8, (Holder("peer", 1, 1),))
                       for i in range(n))
        return Match(self.spec.namespace, C, chunks, plan=LoadPlan(0, n, "load"))

    def lookup(self, toks, salt=None, *, max_chunks=None, allow_split=True, cost_model=True, count=True):
        self.counts["lookups"] += count
        return self._run(0, max_chunks)

    def lookup_keys(self, group, keys, count=True):
        self.counts["lookups"] += count
        first = keys[0][8] if keys else 0
        return self._run(first, first + len(keys))


def hybrid_side(full_held, swa_held, specs=HYBRID):
    clients = {specs[0].namespace: GroupClient(specs[0], full_held)}
    if len(specs) > 1:
        clients[specs[1].namespace] = GroupClient(specs[1], swa_held)
    counts = Counter()
    for c in clients.values():
        c.counts = counts

    def connect(spec):
        return clients[spec.namespace]

    return SchedulerSide(specs, connect, ConnectorOptions(cost_model=False), BS, "kv_both", False), clients


def test_a_hybrid_hit_needs_every_full_chunk_and_only_the_window_of_the_sliding_group():
    s, clients = hybrid_side(full_held=range(4), swa_held={2, 3})  # the window's chunks only
    r = request("r", 1064)
    assert s.lookup(r, 0) == (1024, True)
    full_ids = list(range(100, 109))
    null = 0  # vLLM's null block: the sliding group keeps none of the blocks before the window (token 725)
    swa_ids = [null] * 5 + list(range(200, 204))
    s.allocated(r, [full_ids, swa_ids], 1024, null)
    full, swa = s.build_step(step()).loads
    assert (full.group, full.first_chunk, full.end_chunk, full.skip_blocks, full.fill_blocks) == (0, 0, 4, 0, 8)
    assert full.block_ids == full_ids[:8]
    # the sliding group loads chunks 2-3 only, and skips block 4 (null: before the window) of chunk 2
    assert (swa.group, swa.first_chunk, swa.end_chunk, swa.skip_blocks, swa.fill_blocks) == (1, 2, 4, 1, 4)
    assert swa.block_ids == [null, 200, 201, 202]


def test_a_missing_window_chunk_moves_the_hit_back_to_where_every_group_can_serve_it():
    # the sliding group lacks chunk 3: a hit ending at 1024 is impossible; one ending at 768 needs its chunks 1-2
    s, _ = hybrid_side(full_held=range(4), swa_held={1, 2})
    assert s.lookup(request("r", 1064), 0) == (768, True)
    s2, _ = hybrid_side(full_held=range(4), swa_held={2})  # ... and without chunk 1 there is no hit at all
    assert s2.lookup(request("r", 1064), 0) == (0, False)
    s3, _ = hybrid_side(full_held=range(2), swa_held={0, 1, 2, 3})  # the full group holds two chunks: 512 tokens
    assert s3.lookup(request("r", 1064), 0) == (512, True)


def test_a_sliding_group_saves_only_the_window_of_the_prompts_last_boundary():
    s, _ = hybrid_side(full_held=(), swa_held=())
    r = request("r", 1064)
    assert s.lookup(r, 0) == (0, False)
    blocks = {"r": (list(range(10, 19)), list(range(30, 39)))}
    meta = s.build_step(step(new=[("r", 0)], scheduled={"r": 1064}, blocks=blocks))
    got = sorted((j.group, j.first_chunk, j.end_chunk, tuple(j.block_ids)) for j in meta.saves)
    assert got == [(0, 0, 4, tuple(range(10, 18))), (1, 2, 4, tuple(range(34, 38)))]


def test_a_model_of_one_sliding_group_hits_on_the_window_alone():
    (mistral,) = group_specs(KVSpec("m@1", 2, 2, 64, "bfloat16", chunk_tokens=C),
                             [KVGroup(0, "sliding_window", WINDOW, (0, 1))])
    s, _ = hybrid_side(full_held=(2, 3), swa_held=(), specs=(mistral,))
    assert s.lookup(request("r", 1064), 0) == (1024, True)


def test_a_request_that_kept_its_blocks_for_saves_and_a_load_is_reported_finished_once():
    # aborted while loading again after its preemption (its earlier saves kept its blocks too): the worker said it
    # twice, finished receiving and finished sending; vLLM frees it on the first and dies on the second
    import threading

    from kvmesh.integrations.vllm_worker import WorkerSide

    w = WorkerSide.__new__(WorkerSide)  # (the bookkeeping only: no layers, loader or saver threads)
    w.mu = threading.Condition()
    w.counts = Counter()
    w._recved, w._async_loads, w._req_loads = [], 1, Counter({"r": 1})
    w._errors, w._reported_errors, w._failed_reqs, w._failed_out = set(), set(), set(), set()
    w._pending_saves, w._saved_from, w._finishing = Counter({"r": 1}), {"r"}, set()
    reports = [w.finished({"r"})]  # aborted: its load and a save are still under way
    w._pending_saves["r"] = 0  # the save read its blocks
    reports.append(w.finished(set()))
    w._req_loads.clear()  # the load ended
    w._recved.append("r")
    reports.append(w.finished(set()))
    reports.append(w.finished(set()))
    said = [(kind, r) for sending, recving in reports for kind, got in (("sent", sending), ("recv", recving))
            for r in got or ()]
    assert said == [("recv", "r")]


def test_a_finished_request_whose_load_ended_waits_for_its_saves_before_it_is_reported():
    import threading

    from kvmesh.integrations.vllm_worker import WorkerSide

    w = WorkerSide.__new__(WorkerSide)
    w.mu = threading.Condition()
    w.counts = Counter()
    w._recved, w._async_loads, w._req_loads = ["r"], 0, Counter()
    w._errors, w._reported_errors, w._failed_reqs, w._failed_out = set(), set(), set(), set()
    w._pending_saves, w._saved_from, w._finishing = Counter({"r": 1}), {"r"}, set()
    assert w.finished({"r"}) == (None, None)  # its blocks are still being read by a save: vLLM must keep them
    w._pending_saves["r"] = 0
    assert w.finished(set()) == (None, {"r"})
    assert w.finished(set()) == (None, None)


def test_a_request_waiting_for_blocks_is_counted_once_however_often_vllm_asks():
    # vLLM asks again every step while a request waits for blocks: 270 steps counted 270 lookups and 269 hits
    # for one request. A request asked about anew (after a preemption: from another computed length) counts again
    s, client = side(cached=4)
    r = request("r", 1064)
    for _ in range(5):
        assert s.lookup(r, 0) == (1024, True)
    assert client.counts["lookups"] == 1 and client.counts["vllm_hit_tokens"] == 1024
    assert client.counts["vllm_lookup_tokens"] == 1064
    assert s.lookup(r, 256) == (768, True)
    assert client.counts["lookups"] == 2 and client.counts["vllm_hit_tokens"] == 1024 + 768
