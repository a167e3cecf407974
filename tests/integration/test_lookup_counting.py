"""A lookup is counted once, as a hit or as a miss with its reason, and only where something could be cached: the
counters are what the hit rate on the live page, `kvmesh status` and the metrics is made of. Real redis-server, a
KVNode in this process, a random-weight Llama for the transformers integration."""

import pytest
import redis
import torch

from kvmesh.connecting import connect_local
from kvmesh.cost import LinkModel
from kvmesh.integrations.hf import generate, spec_for_model, tiny_llama
from kvmesh.spec import KVSpec

SPEC = KVSpec("lookup-counting-model", 2, 2, 16, "float16", chunk_tokens=16)


@pytest.fixture
def node(private_redis, make_node):
    redis.Redis.from_url(private_redis.url).flushall()
    return make_node("a" * 32, "kvnode-a", redis_url=private_redis.url, key_prefix="lc", cpu_bytes=64 << 20,
                     slot_bytes=1 << 20, node_refresh_s=0.2)


def test_a_prompt_shorter_than_a_chunk_is_neither_looked_up_nor_counted(node):
    # before: counted as a lookup, and as neither a hit nor a miss, which lowered the hit rate unexplained
    c = connect_local(SPEC, node)
    try:
        toks = list(range(100, 100 + 3 * 16 + 5))
        c.store(toks, torch.randn(SPEC.kv_shape(len(toks))).to(torch.float16))
        c.flush()
        c.lookup(toks[:10])
        c.lookup(toks, max_chunks=0)
        c.lookup(toks)
        c.lookup(list(range(9000, 9000 + 40)))
        counts = {k: v for k, v in c.counts.items() if v and (k in ("lookups", "hits") or k.startswith("miss_"))}
        assert counts == {"lookups": 2, "hits": 1, "miss_not_cached": 1}
    finally:
        c.close()


def test_generate_counts_the_hit_it_uses(node):
    # a prompt of exactly one chunk reuses nothing (its last token is computed, and with it the chunk): before, the
    # lookup of the whole chunk counted a hit (and the cost model ran twice)
    model = tiny_llama(seed=5, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128,
                       vocab_size=512)
    c = connect_local(spec_for_model(model, chunk_tokens=16, model_id="lookup-counting-llama"), node)
    # a synthetic machine where loading a chunk is 100 times faster than computing it: the plan loads it all
    for n in (16, 32, 64, 128):
        c.cost.prefill.observe(n, 0, 1e-3 * n / 16)
    for name in ("local", "peer"):
        c.cost.links[name] = LinkModel(c.spec.chunk_bytes / 1e-5, 1e-9)
    try:
        one, two = list(range(3, 19)), list(range(3, 3 + 2 * 16 + 5))
        for toks in (one, two):
            generate(model, toks, 2, client=c)
            c.flush()
        before = dict(c.counts)
        r1 = generate(model, one, 2, client=c)
        mid = dict(c.counts)
        r2 = generate(model, two, 2, client=c)
        after = dict(c.counts)

        def delta(a, b, k):
            return b.get(k, 0) - a.get(k, 0)

        assert r1.reused_tokens == 0 and delta(before, mid, "hits") == 0 and delta(before, mid, "lookups") == 0
        # the two chunks before the last token: a hit if the plan loads them (the model prefills in a millisecond
        # here, so it may well not), else the cost model's miss, never both
        reused = r2.reused_tokens > 0
        assert delta(mid, after, "lookups") == 1
        assert (delta(mid, after, "hits"), delta(mid, after, "miss_cost_model")) == (int(reused), int(not reused))
        assert sum(delta(before, after, k) for k in after if k.startswith("plan_")) == 2  # one plan per request
    finally:
        c.close()


def test_another_adapter_holding_the_prompt_is_not_a_spec_mismatch(node):
    """A miss whose prompt another LoRA adapter of the model (or the base model) holds is a plain miss: adapters'
    KV differ by design. Before, it was counted as a "spec_mismatch" (the counter that names a setting gone
    wrong), and with hundreds of adapters registered every miss hashed the prompt for each of them. A spec that
    differs in a setting (the dtype here) still is one."""
    from dataclasses import replace

    base = replace(SPEC, model_id="lc-lora-model")
    toks = list(range(500, 500 + 2 * 16))
    kv = torch.randn(base.kv_shape(len(toks))).to(torch.float16)
    clients = [connect_local(base, node)] + [connect_local(replace(base, lora_id=f"ad{i}@1"), node) for i in range(40)]
    other_dtype = connect_local(replace(base, lora_id="ad0@1", dtype="bfloat16"), node)
    try:
        clients[0].store(toks, kv)
        assert clients[0].flush() == 2
        adapter = clients[1]
        assert adapter.lookup(toks).num_chunks == 0
        assert adapter.counts["miss_not_cached"] == 1 and not adapter.counts["miss_spec_mismatch"]
        other_dtype.store(toks, kv.to(torch.bfloat16))
        assert other_dtype.flush() == 2
        fresh = connect_local(replace(base, lora_id="ad0@1"), node)  # (a client reads the spec list on its first miss)
        try:
            assert fresh.lookup(toks).num_chunks == 0 and fresh.counts["miss_spec_mismatch"] == 1
        finally:
            fresh.close()
    finally:
        for c in clients + [other_dtype]:
            c.close()
