"""A store of KV that lives on the GPU goes device to device into its node's GPU tier (reserve_gpu ->
gpu_ipc.write_chunks on a side stream -> commit_gpu), without a host copy, and reads back bit-exact. Skipped without
a GPU.

As tests/gpu/test_cuda_store.py: the GPU machine has no Ray, the client reaches a plain KVNode of this process
(`connect_local`); it maps the node's pools from the node's hello as a same-node worker does (in this process, the
pool itself: CUDA IPC cannot open a handle of its own process)."""

import time

import pytest
import torch

from kvmesh import KVSpec
from kvmesh.connecting import connect_local
from kvmesh.config import KVMeshConfig
from kvmesh.node import KVNode

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SPEC = KVSpec("d2d-store-cuda", num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", chunk_tokens=64)
C = SPEC.chunk_tokens


@pytest.fixture
def server():
    from kvmesh.local import RedisServer

    with RedisServer() as s:
        yield s


def make_node(server, tmp_path, gpu_slots: int) -> KVNode:
    cfg = KVMeshConfig(redis_url=server.url, key_prefix="d2d", cpu_bytes=32 * SPEC.chunk_bytes,
                       slot_bytes=SPEC.chunk_bytes, gpu_bytes=gpu_slots * SPEC.chunk_bytes, gpu_device="cuda",
                       shm_dir=str(tmp_path))
    return KVNode(cfg, "node-d2d" * 3, "kvnode-d2d")


def read_back(client, toks, expected: torch.Tensor, n: int) -> dict:
    """fetch_to_device (GPU-tier chunks device to device, verified by their device sums) and a peer's pull (to the
    host), both compared with what was stored."""
    load, got = client.fetch_to_device(client.lookup(toks, cost_model=False), "cuda")
    try:
        assert got == n and load.verified()
        torch.cuda.synchronize()
        for i in range(n):
            assert torch.equal(load.staging[i].cpu(), expected[:, :, i * C:(i + 1) * C]), f"chunk {i}"
    finally:
        load.release()
    return dict(client.counts)


def test_a_store_of_gpu_kv_lands_in_the_gpu_tier_device_to_device_and_reads_back_bit_exact(server, tmp_path):
    n = make_node(server, tmp_path, gpu_slots=16)
    client = connect_local(SPEC, n)
    try:
        assert client.fetcher.env.gpu is not None  # the client mapped the node's pool
        toks = list(range(C * 8))
        kv = torch.randn(SPEC.kv_shape(len(toks)), device="cuda").to(torch.bfloat16)
        expected = kv.cpu()
        torch.cuda._sleep(1_000_000_000)  # the compute stream is busy for a while with later work
        t0 = time.perf_counter()
        assert client.store(toks, kv) == 8
        returned_s = time.perf_counter() - t0
        del kv  # the engine drops its tensor at once; the copies must still read the right bytes
        assert client.flush() == 8
        assert returned_s < 0.2, returned_s  # it waited neither for the busy stream nor for the copies
        st = n.stats()
        assert st["stored_chunks_d2d"] == 8 and st["gpu_chunks"] == 8 and client.counts["stored_chunks_d2d"] == 8
        assert st["chunks"] == 0 and st["tier_flows"] == []  # no host copy: nothing in the CPU slab, no moves
        assert not client.counts["store_d2d_fallback"]
        hashes = client.hashes(toks)
        gpu = n.cascade.gpu
        assert all(gpu.verify(gpu.slot_of(h)) for h in hashes)  # the committed sums match the bytes in the pool
        counts = read_back(client, toks, expected, 8)
        assert counts["fetched_chunks_gpu_tier_d2d"] == 8  # read back device to device too
        pulled = n.pull(hashes)  # to the host: each chunk's device sum checked on the GPU, then its xxh3 made
        assert len(pulled.rows) == 8
        host = torch.frombuffer(bytearray(pulled.data.tobytes()), dtype=torch.bfloat16).view(8, *SPEC.chunk_shape)
        for i in range(8):
            assert torch.equal(host[i], expected[:, :, i * C:(i + 1) * C])
        n.check_integrity(directory=True)
    finally:
        client.close()
        n.shutdown()


def test_a_gpu_tier_without_room_for_all_takes_the_rest_through_the_host_and_demotes_bit_exact(server, tmp_path):
    n = make_node(server, tmp_path, gpu_slots=4)
    client = connect_local(SPEC, n)
    try:
        toks = list(range(1000, 1000 + C * 8))
        kv = torch.randn(SPEC.kv_shape(len(toks)), device="cuda").to(torch.bfloat16)
        expected = kv.cpu()
        assert client.store(toks, kv) == 8
        assert client.flush() == 8
        st = n.stats()
        # 4 slots: 4 chunks go device to device; the other 4 through the host path, whose placement in the GPU
        # tier demotes the device-written ones to the CPU slab (device sums checked, xxh3 made on the way down)
        assert client.counts["stored_chunks_d2d"] == 4 and client.counts["store_d2d_fallback"] == 4
        assert st["stored_chunks_d2d"] == 4 and st["gpu_chunks"] == 4 and st["demotions"] == 4
        read_back(client, toks, expected, 8)
        n.check_integrity(directory=True)
    finally:
        client.close()
        n.shutdown()
