"""A store of KV that lives on the GPU (what `kvmesh.integrations.hf.generate` hands over on a CUDA model) returns
at once, leaves the compute stream alone, and lands bit-exact in a real KVNode (real Redis). Skipped without a GPU.

The GPU machine has no Ray: the client reaches a plain KVNode of this process (`connect_local`), which is what the
actor runs; its store queue hands the staged chunks to it as it would to the actor."""

import time

import pytest
import torch

from kvmesh import KVSpec
from kvmesh.connecting import connect_local
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


@pytest.mark.parametrize("gpu_tier", [False, True], ids=["host-path", "device-to-device"])
def test_a_store_reads_the_kv_as_it_was_at_store_and_the_caller_may_overwrite_it_at_once(tmp_path, gpu_tier):
    """An engine with a static KV buffer stores a prompt and prefills the next one into the same memory at once.
    The copies off the GPU run later (a side stream; the background thread for the device-to-device path): the
    store must hold the first prompt's bytes, not the next one's under the first one's keys."""
    from kvmesh.local import RedisServer

    with RedisServer() as server:
        cfg = KVMeshConfig(redis_url=server.url, key_prefix="ow", cpu_bytes=32 * SPEC.chunk_bytes,
                           slot_bytes=SPEC.chunk_bytes, shm_dir=str(tmp_path),
                           **(dict(gpu_bytes=16 * SPEC.chunk_bytes, gpu_device="cuda") if gpu_tier else {}))
        n = KVNode(cfg, "node-ow" * 4, "kvnode-ow")
        client = connect_local(SPEC, n)
        try:
            assert (client.fetcher.env.gpu is not None) == gpu_tier
            toks = list(range(SPEC.chunk_tokens * 8))
            kv = torch.randn(SPEC.kv_shape(len(toks)), device="cuda").to(torch.bfloat16)
            expected = kv.cpu()
            torch.cuda._sleep(200_000_000)  # the compute stream is busy: the store's copies queue behind it
            assert client.store(toks, kv) == 8
            kv.fill_(0)  # the next prompt's prefill, into the same buffer, on the same stream
            kv.add_(7)
            assert client.flush() == 8
            assert client.counts["stored_chunks_d2d"] == (8 if gpu_tier else 0)
            got = client.fetch(client.lookup(toks, cost_model=False))
            assert got.shape == expected.shape and torch.equal(got, expected)
            n.check_integrity()
        finally:
            client.close()
            n.shutdown()
