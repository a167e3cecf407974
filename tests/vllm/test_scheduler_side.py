"""The connector's scheduler side on its own: block arithmetic of loads and saves, when vLLM must keep blocks, and
what a failed load changes. A stand-in client answers lookups from a dict (pure logic: no Ray, Redis or engine)."""

from collections import Counter
from types import SimpleNamespace as NS

import numpy as np

from kvmesh.client import ChunkMatch, Match
from kvmesh.cost import LoadPlan
from kvmesh.directory import Holder
from kvmesh.integrations.vllm_options import ConnectorOptions
from kvmesh.integrations.vllm_scheduler import SchedulerSide, WorkerReport
from kvmesh.spec import KVSpec

BS, C = 128, 256  # vLLM's CPU block size; two blocks per chunk
SPEC = KVSpec("m@1", 2, 2, 64, "bfloat16", chunk_tokens=C)


class Client:
    """Holds chunk i of every prompt on `holders[i]` (a node id), for the first `cached` chunks."""

    def __init__(self, cached: int, node: str = "me") -> None:
        self.cached, self.node_id = cached, node
        self.holders = {}
        self.counts: Counter = Counter()
        self.config = NS(lease_s=5.0)
        self.cost = NS(prefill=NS(observe=lambda *a: None), observe_transfer=lambda *a: None)
        self.recorded = []

    def hashes(self, toks, salt=None):
        return [bytes([i]) * 16 for i in range(len(toks) // C)]

    def _match(self, first: int, last: int) -> Match:
        n = max(0, min(self.cached, last) - first)
        chunks = tuple(ChunkMatch(bytes([first + i]) * 16, (Holder(self.holders.get(first + i, "peer"), 1, 1),))
                       for i in range(n))
        return Match(SPEC.namespace, C, chunks, plan=LoadPlan(0, n, "load"))

    def lookup(self, toks, salt=None, *, max_chunks=None, allow_split=True, cost_model=True):
        self.counts["lookups"] += 1
        return self._match(0, max_chunks)

    def lookup_keys(self, group, keys):
        self.counts["lookups"] += 1
        return self._match(keys[0][0], keys[0][0] + len(keys))

    def plan(self, match, prompt_tokens, allow_split=True):
        return LoadPlan(0, match.num_chunks, "load")

    def record_request(self, *a):
        self.recorded.append(a)


def side(cached: int, background: bool = False, **opts) -> tuple[SchedulerSide, Client]:
    client = Client(cached)
    return SchedulerSide(SPEC, lambda spec: client, ConnectorOptions(**opts), BS, "kv_both", background), client


def request(req_id: str, n: int, salt=None):
    return NS(request_id=req_id, prompt_token_ids=list(range(3, 3 + n)), mm_features=[], prompt_embeds=None,
              prompt_is_token_ids=None, cache_salt=salt, lora_request=None, skip_reading_prefix_cache=False)


def step(new=(), cached=(), scheduled=None, blocks=None, preempted=()):
    """A SchedulerOutput stand-in: `new`/`cached` are (req_id, num_computed_tokens) pairs."""
    return NS(scheduled_new_reqs=[NS(req_id=r, num_computed_tokens=n) for r, n in new],
              scheduled_cached_reqs=NS(req_ids=[r for r, _ in cached], num_computed_tokens=[n for _, n in cached]),
              num_scheduled_tokens=scheduled or {}, preempted_req_ids=set(preempted),
              kv_connector_block_state=NS(get_block_ids=lambda r: (blocks[r],)))


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


def test_a_salted_request_gets_the_engine_salt_in_front():
    s, client = side(cached=0, cache_salt="eng")
    s.lookup(request("r", 300, salt="t1"), 0)
    assert s._reqs["r"].salt == "eng\x00t1"
