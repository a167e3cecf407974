"""A store of KV that lives on the GPU (what `kvmesh.integrations.hf.generate` hands over on a CUDA model) returns
at once, leaves the compute stream alone, and lands bit-exact in a real KVNode (real Redis). Skipped without a GPU.

The GPU machine has no Ray: the client reaches a plain KVNode of this process (`connect_local`), which is what the
actor runs; its store queue hands the staged chunks to it as it would to the actor."""

import time

import pytest
import torch

from kvmesh import KVSpec
from kvmesh.client import connect_local
from kvmesh.config import KVMeshConfig
from kvmesh.node import KVNode

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SPEC = KVSpec("cuda-store", num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", chunk_tokens=64)


@pytest.fixture
def node(tmp_path):
    from kvmesh.local import RedisServer

    with RedisServer() as server:
        cfg = KVMeshConfig(redis_url=server.url, key_prefix="cs", cpu_bytes=32 * SPEC.chunk_bytes,
                           slot_bytes=SPEC.chunk_bytes, shm_dir=str(tmp_path))
        n = KVNode(cfg, "node-gpu" * 3, "kvnode-gpu")
        yield n, cfg
        n.shutdown()


def test_a_store_of_gpu_kv_returns_at_once_and_lands_bit_exact(node):
    n, cfg = node
    client = connect_local(SPEC, n)
    try:
        toks = list(range(SPEC.chunk_tokens * 8))
        kv = torch.randn(SPEC.kv_shape(len(toks)), device="cuda").to(torch.bfloat16)
        expected = kv.cpu()
        torch.cuda._sleep(2_000_000_000)  # the compute stream is busy for a while (~1 s) with later work
        t0 = time.perf_counter()
        assert client.store(toks, kv) == 8
        returned_s = time.perf_counter() - t0
        del kv  # the engine drops its tensor at once; the copy must still read the right bytes
        torch.cuda.empty_cache()
        assert client.flush() == 8  # the side-stream copy ran after the busy stream's work, then the node stored
        assert returned_s < 0.2, returned_s  # it did not wait for the busy stream, nor for the copy
        hashes = client.hashes(toks)
        pulled = n.pull(hashes)  # what a peer reads from the node, verified by it
        assert len(pulled.rows) == 8
        got = torch.frombuffer(bytearray(pulled.data.tobytes()), dtype=torch.bfloat16).view(8, *SPEC.chunk_shape)
        C = SPEC.chunk_tokens
        for i in range(8):
            assert torch.equal(got[i], expected[:, :, i * C:(i + 1) * C])
        n.check_integrity()
    finally:
        client.close()
