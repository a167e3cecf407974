"""A device fetch reads this node's slab in place: every slab-resident chunk is adopted (DMA'd from the page-locked
slab on a GPU), none copied on the host, whatever the fetch's deadline and however much of the slab it covers.
This is what makes the vLLM connector's GPU load run at the speed of a pinned H2D copy (`bench/gpu.py --only
vllm`); on the CPU the planning and the sources are the same, so it runs in CI. A plain KVNode against a real
redis-server."""

import pytest
import torch

from kvmesh import KVSpec
from kvmesh.connecting import connect_local
from kvmesh.local import RedisServer
from tests.conftest import NodeFactory

SPEC = KVSpec("adopts", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)
N, SLOTS = 64, 72  # the fetch covers most of the slab (as bench/gpu.py's vLLM load: 64 chunks, 72 slots)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with RedisServer() as server, NodeFactory(tmp_path_factory.mktemp("adopts"), server.url) as make:
        yield make("node-adopts-" * 4, "kvnode-adopts", key_prefix="ad", cpu_bytes=SLOTS * SPEC.chunk_bytes,
                   slot_bytes=SPEC.chunk_bytes, fetch_timeout_s=60.0, pin_ttl_s=30.0, lease_s=5.0, heartbeat_s=1.0)


@pytest.mark.parametrize("deadline_s", [None, 5.0, 600.0])  # the config's 60 s, shorter and longer than the TTL
def test_a_device_fetch_of_slab_chunks_adopts_every_slot(node, deadline_s):
    toks = list(range(7, 7 + N * SPEC.chunk_tokens))
    kv = torch.randn(SPEC.kv_shape(len(toks)), generator=torch.Generator().manual_seed(3)).to(SPEC.torch_dtype)
    c = connect_local(SPEC, node)
    try:
        c.store(toks, kv)
        assert c.flush() in (0, N)  # (0: stored by an earlier case)
        match = c.lookup(toks, cost_model=False)
        assert match.num_chunks == N
        load, n = c.fetch_to_device(match, "cpu", deadline_s=deadline_s)
        try:
            st = c.last_fetch
            assert n == N and st.local_chunks == N
            assert st.adopted_chunks == N, f"{N - st.adopted_chunks} of {N} slab chunks were copied on the host"
            assert load.verified()
            got = load.staging[:n].permute(1, 2, 0, 3, 4, 5).reshape(SPEC.kv_shape(n * SPEC.chunk_tokens))
            assert torch.equal(got, kv)
        finally:
            load.release()
        assert node.stats()["pinned"] == 0  # released with the load
    finally:
        c.close()
