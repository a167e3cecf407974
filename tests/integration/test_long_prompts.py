"""Long prompts through the client, as an engine sees them: lookups from the directory's summaries (a bucket of 64
chunks each) give the same prefix and the same bytes as the entries they summarize, across stores, evictions and a
conversation's turns. Real redis-server, a KVNode in this process."""

import numpy as np
import pytest
import redis
import torch

from kvmesh.connecting import connect_local
from kvmesh.spec import KVSpec

SPEC = KVSpec("long-prompts-model", 2, 2, 8, "float16", chunk_tokens=4)


@pytest.fixture
def node(private_redis, make_node):
    redis.Redis.from_url(private_redis.url).flushall()
    return make_node("b" * 32, "kvnode-b", redis_url=private_redis.url, key_prefix="lp", cpu_bytes=64 << 20,
                     slot_bytes=1 << 16, lease_s=5.0, node_refresh_s=0.2)


def kv_of(tokens: list[int]) -> torch.Tensor:
    """KV that depends on each token and its position only, so a prefix's KV is the prefix of a longer prompt's."""
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    base = (t * 0.001 + pos * 0.0001).view(1, 1, -1, 1, 1)
    return (base + torch.arange(SPEC.num_layers * 2 * SPEC.num_kv_heads * SPEC.head_dim).view(
        SPEC.num_layers, 2, 1, SPEC.num_kv_heads, SPEC.head_dim) * 0.01).to(torch.float16)


def test_a_conversation_of_long_prompts_reuses_exactly_what_is_cached(node):
    c = connect_local(SPEC, node)
    try:
        rng = np.random.default_rng(3)
        turn1 = [int(x) for x in rng.integers(10, 30_000, 300 * 4)]  # 300 chunks: 4 buckets and a tail
        assert c.store(turn1, kv_of(turn1)) == 300
        c.flush()
        d = c.directory
        d.summary_write_s = 0.0  # (this conversation's turns come within a second: each may write its summaries)
        for _ in range(3):  # the first reads every entry and writes the summaries; the others read them
            m = c.lookup(turn1, cost_model=False)
            assert m.num_chunks == 300
            d.flush_summaries()
        assert d.summary_counts["hits"] >= 2
        kv = c.fetch(m)
        assert torch.equal(kv, kv_of(turn1)[:, :, : 300 * 4])

        # the next turn: the prompt goes on; what it adds is stored, and its lookup sees all of it
        turn2 = turn1 + [int(x) for x in rng.integers(10, 30_000, 130 * 4)]
        m = c.lookup(turn2, cost_model=False)
        assert m.num_chunks == 300 and m.why == "not_cached"
        c.store(turn2, kv_of(turn2))
        c.flush()
        for _ in range(2):
            m = c.lookup(turn2, cost_model=False)
            assert m.num_chunks == 430
            d.flush_summaries()
        assert torch.equal(c.fetch(m), kv_of(turn2)[:, :, : 430 * 4])

        # a chunk in the middle leaves the directory (an eviction's unregister): the next lookup ends before it
        hashes = c.hashes(turn2)
        hits = d.summary_counts["hits"]
        d.unregister(node.lease, hashes[0], [hashes[200]])
        m = c.lookup(turn2, cost_model=False)
        assert m.num_chunks == 200 and m.why == "not_cached"
        assert torch.equal(c.fetch(m), kv_of(turn2)[:, :, : 200 * 4])
        d.flush_summaries()
        m = c.lookup(turn2, cost_model=False)
        assert m.num_chunks == 200 and d.summary_counts["hits"] > hits
    finally:
        c.close()
