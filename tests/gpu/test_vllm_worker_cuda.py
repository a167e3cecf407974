"""The vLLM connector's worker half on real CUDA tensors, without vLLM (it cannot be installed on the GPU machine):
the block layouts vLLM's GPU backends allocate, saved then loaded bit-exact; the background save on a side stream
never stalls the compute stream; a synchronous load lets layer i's consumer wait for layer i alone.

The two vLLM names the worker imports are stubbed when vLLM is absent. Most tests use a stand-in client holding
chunks in a dict (the worker's own logic, streams and layouts are what is under test); the last ones load through a
real KVNode (a plain object, no Ray) and a real redis-server: the data plane's device sink DMAs the chunks from the
node's page-locked slab, and a chunk that fails its checksum is never used. Skipped without a GPU."""

import dataclasses
import hashlib
import os
import sys
import threading
import time
from collections import Counter
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module", autouse=True)
def vllm_names():
    """Stand-ins for the two vLLM modules the worker imports, while this module's tests run (vLLM itself when it
    is installed); the connector modules imported against them are forgotten afterwards."""
    try:
        import vllm  # noqa: F401
        stubbed = []
    except ImportError:
        from bench.gpu_vllm import install_vllm_stubs

        stubbed = install_vllm_stubs()
    from kvmesh.integrations import vllm_meta, vllm_options, vllm_worker

    g = globals()
    g.update(WorkerSide=vllm_worker.WorkerSide, LoadJob=vllm_meta.LoadJob, SaveJob=vllm_meta.SaveJob,
             StepMeta=vllm_meta.StepMeta, ConnectorOptions=vllm_options.ConnectorOptions)
    yield
    for name in stubbed + (["kvmesh.integrations.vllm_worker", "kvmesh.integrations.vllm_loader",
                            "kvmesh.integrations.vllm_scheduler", "kvmesh.integrations.vllm_meta"]
                           if stubbed else []):
        sys.modules.pop(name, None)


from kvmesh import KVSpec  # noqa: E402

L, H, D, BS, C, DTYPE = 4, 2, 64, 16, 64, "bfloat16"  # 4 blocks per chunk
if os.environ.get("KVMESH_VLLM_CUDA_SHAPE"):  # another shape: "layers,kv_heads,head_dim,block_size,chunk_tokens,dtype"
    *_ints, DTYPE = os.environ["KVMESH_VLLM_CUDA_SHAPE"].split(",")
    L, H, D, BS, C = map(int, _ints)
SPEC = KVSpec("vllm-cuda", L, H, D, DTYPE, chunk_tokens=C)
P = C // BS  # blocks per chunk
assert P * BS == C
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
NB = 96


class Client:
    """Chunks by hash in a dict, on the CPU (what the worker hands to and asks of `KVMeshClient`)."""

    def __init__(self, spec=SPEC) -> None:
        self.spec = spec
        self.chunks: dict[bytes, torch.Tensor] = {}
        self.counts: Counter = Counter()
        self.config = NS(fetch_timeout_s=10.0)
        self.node_id = "me"
        self.stored_at: list[float] = []
        self.last_fetch = None

    def hashes(self, toks, salt=None):
        toks = np.asarray(toks, dtype="<u4")
        return [hashlib.blake2b(toks[:(i + 1) * C].tobytes(), digest_size=16).digest() for i in range(len(toks) // C)]

    def store_keys(self, group, keys, staging):
        for k, t in zip(keys, staging):
            self.chunks[k] = t.clone()
        self.stored_at.append(time.perf_counter())
        return len(keys)

    def lookup_keys(self, group, keys):
        n = next((i for i, k in enumerate(keys) if k not in self.chunks), len(keys))
        return NS(num_chunks=n, keys=keys[:n], chunks=[])

    def fetch(self, match, out, deadline_s=None):
        for i, k in enumerate(match.keys):
            out[:, :, i * C:(i + 1) * C] = self.chunks[k]
        self.last_fetch = NS(local_chunks=match.num_chunks, peer_chunks=0, seconds=0.0, error="", runs=())
        return out[:, :, :match.num_chunks * C]

    def fetch_to_device(self, match, device, deadline_s=None):
        from kvmesh.movers import to_device

        srcs = [self.chunks[k].contiguous().view(-1).view(torch.uint8).pin_memory() for k in match.keys]
        self.last_fetch = NS(local_chunks=match.num_chunks, peer_chunks=0, seconds=0.0, error="", runs=())
        return to_device(srcs, self.spec, device, min_copy_bytes=0), match.num_chunks

    def flush(self, timeout_s=None):
        pass

    def close(self):
        pass


# vLLM's per-layer caches, each as (allocate, block view): `make(g)` returns the tensors vLLM would hand over,
# `block(t, b)` reads block b of one of them in its own layout (for the comparisons)
def _logical(phys):  # [NB, bs, H, 2D] memory -> vLLM's logical [NB, H, bs, 2D] view (NHD order)
    return phys.permute(0, 2, 1, 3)


LAYOUTS = {
    # vLLM 0.32 (KVCacheLayout): logical [blocks, H, bs, 2D] per layer over each backend's physical order
    "flash_attn_LBNHC": (lambda g, dt=SPEC.torch_dtype: [
        _logical(torch.randn(NB, BS, H, 2 * D, generator=g).to(dt).cuda()) for _ in range(L)], lambda t, b: t[b]),
    "flashinfer_LBHNC": (lambda g, dt=SPEC.torch_dtype: [torch.randn(NB, H, BS, 2 * D, generator=g).to(dt).cuda()
                                    for _ in range(L)], lambda t, b: t[b]),
    # cross-layer stacked (one allocation [blocks, layers, bs, H, 2D]); vLLM hands over per-layer views of it
    "cross_layer_BLNHC": (lambda g, dt=SPEC.torch_dtype: (lambda a: [_logical(a[:, i]) for i in range(L)])(
        torch.randn(NB, L, BS, H, 2 * D, generator=g).to(dt).cuda()), lambda t, b: t[b]),
    # vLLM's 5-D layouts before KVCacheLayout (and LMCache's NL_X_TWO_NB_BS_NH_HS / NL_X_NB_TWO_BS_NH_HS)
    "flash_attn_2_NB_BS_H_D": (lambda g, dt=SPEC.torch_dtype: [torch.randn(2, NB, BS, H, D, generator=g).to(dt).cuda()
                                          for _ in range(L)], lambda t, b: t[:, b]),
    "flashinfer_NB_2_BS_H_D": (lambda g, dt=SPEC.torch_dtype: [torch.randn(NB, 2, BS, H, D, generator=g).to(dt).cuda()
                                          for _ in range(L)], lambda t, b: t[b]),
}


def worker(client, layers, spec=SPEC):
    w = WorkerSide([spec], lambda spec: client, ConnectorOptions(), BS, "kv_both", [NAMES], background_copy=True)
    w.register(dict(zip(NAMES, layers)))
    return w


def wait_for(cond, timeout=20.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def tokens(n_chunks, seed=0):
    return np.random.default_rng(seed).integers(0, 1 << 20, n_chunks * C).astype("<u4")


@pytest.mark.parametrize("dtype", [DTYPE, "float8_e4m3fn"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_save_then_load_is_bit_exact_in_each_gpu_layout(layout, dtype):
    """And with an fp8 KV cache (vLLM's kv_cache_dtype="fp8"): CUDA has no index_copy_ for float8 types, so every
    load into one failed (recomputed) before the indexed copies moved bytes (kvmesh.paged.raw)."""
    make, block = LAYOUTS[layout]
    spec = dataclasses.replace(SPEC, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    client = Client(spec)
    src = make(g, spec.torch_dtype)
    toks = tokens(3)
    save_ids = torch.randperm(NB, generator=g)[:3 * P].tolist()
    w = worker(client, src, spec)
    try:
        meta = StepMeta(saves=[SaveJob("r1", toks.tobytes(), 0, 3, save_ids, None, None)])
        w.begin_step(meta)
        w.end_step(meta)
        wait_for(lambda: len(client.chunks) == 3)
        assert w.counts["vllm_saved_chunks"] == 3
    finally:
        w.close()
    dst = [torch.zeros_like(t) for t in make(torch.Generator().manual_seed(2), spec.torch_dtype)]  # zeroed
    load_ids = torch.randperm(NB, generator=g)[:3 * P].tolist()
    w2 = worker(client, dst, spec)
    try:
        # vLLM already has the first block (its own prefix cache): skip_blocks=1 leaves it alone
        meta = StepMeta(loads=[LoadJob("r2", toks.tobytes(), 0, 3, load_ids, 1, 3 * P, None, None, sync=False)])
        w2.start_loads(meta)
        done = set()
        wait_for(lambda: done.update(w2.finished(set())[1] or ()) or "r2" in done)
        assert w2.load_errors() == set()
        torch.cuda.synchronize()
        for i in range(L):
            assert not bool(block(dst[i], load_ids[0]).view(torch.uint8).ne(0).any()), "a skipped block was written"
            for s, d in zip(save_ids[1:], load_ids[1:]):  # (bytes: CUDA cannot compare float8 tensors)
                assert torch.equal(block(dst[i], d).view(torch.uint8), block(src[i], s).view(torch.uint8)), \
                    f"layer {i} block {s}->{d}"
    finally:
        w2.close()


def test_the_background_save_never_stalls_the_compute_stream():
    make, block = LAYOUTS["flash_attn_LBNHC"]
    client = Client()
    layers = make(torch.Generator().manual_seed(3))
    toks = tokens(8, seed=3)
    ids = list(range(8 * P))
    second = P + (P > 1)  # chunk 1's second block (its only one when a chunk is one block)
    w = worker(client, layers)
    try:
        torch.cuda.synchronize()
        torch.cuda._sleep(int(1e9))  # the step's kernels are still running when vLLM ends the step (~0.5 s)
        layers[0][ids[second]].fill_(7)  # ... and the last of them writes a block that the save must see
        t0 = time.perf_counter()
        meta = StepMeta(saves=[SaveJob("r", toks.tobytes(), 0, 8, ids, None, None)])
        w.end_step(meta)
        returned = time.perf_counter() - t0
        marker = torch.cuda.Event()
        marker.record()  # the compute stream's next work: behind the step, not behind the save's copies
        assert returned < 0.05, returned
        assert not marker.query()  # the step's kernels are still running: end_step did not wait for them
        marker.synchronize()
        wait_for(lambda: len(client.chunks) == 8)
        saved = client.chunks[client.hashes(toks)[1]]  # chunk 1 holds block ids[second]
        at = (second - P) * BS
        assert bool(saved[0, :, at:at + BS].eq(7).all())
    finally:
        w.close()


@pytest.mark.skipif(L < 2, reason="needs two layers")
def test_a_synchronous_load_lets_layer_i_wait_for_layer_i_alone():
    make, block = LAYOUTS["flashinfer_LBHNC"]
    client = Client()
    src = make(torch.Generator().manual_seed(4))
    toks = tokens(2, seed=4)
    save_ids, load_ids = list(range(2 * P)), list(range(40, 40 + 2 * P))
    w = worker(client, src)
    meta = StepMeta(saves=[SaveJob("r1", toks.tobytes(), 0, 2, save_ids, None, None)])
    w.end_step(meta)
    wait_for(lambda: len(client.chunks) == 2)
    w.close()
    dst = [torch.zeros_like(t) for t in src]
    w2 = worker(client, dst)
    real_write = w2.loader._write
    gate = threading.Event()

    def slow_write(ld, layers, **kw):
        if layers.start >= 1:
            gate.wait(10)  # layers 1.. are written only once the test has checked layer 0
        torch.cuda._sleep(int(1e8))  # the loader's stream is slow: its writes land well after they are queued
        real_write(ld, layers, **kw)
    w2.loader._write = slow_write
    try:
        compute = torch.cuda.Stream()  # the forward pass's stream, not the loader thread's
        meta = StepMeta(loads=[LoadJob("r2", toks.tobytes(), 0, 2, load_ids, 0, 2 * P, None, None, sync=True)])
        w2.start_loads(meta)
        batch = w2._sync
        with torch.cuda.stream(compute):
            w2.wait_layer(NAMES[0], meta)
            seen0 = torch.stack([block(dst[0], b) for b in load_ids])  # layer 0's "attention"
        assert not batch.layer_done[1].is_set()  # layer 0 went ahead while layer 1 was not even written
        compute.synchronize()
        assert torch.equal(seen0, torch.stack([block(src[0], b) for b in save_ids]))  # ordered after its writes
        gate.set()
        with torch.cuda.stream(compute):
            seen = [seen0]
            for i in range(1, L):
                w2.wait_layer(NAMES[i], meta)
                seen.append(torch.stack([block(dst[i], b) for b in load_ids]))
        w2.end_step(meta)
        compute.synchronize()
        for i in range(L):
            assert torch.equal(seen[i], torch.stack([block(src[i], b) for b in save_ids])), f"layer {i}"
        assert w2.load_errors() == set()
    finally:
        gate.set()
        w2.close()


# -- through a real KVNode ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def node(tmp_path_factory):
    from kvmesh.config import KVMeshConfig
    from kvmesh.local import RedisServer
    from kvmesh.node import KVNode

    with RedisServer() as server:
        cfg = KVMeshConfig(redis_url=server.url, key_prefix="vw", cpu_bytes=64 * SPEC.chunk_bytes,
                           slot_bytes=SPEC.chunk_bytes, shm_dir=str(tmp_path_factory.mktemp("vw")))
        n = KVNode(cfg, "node-vllm-worker" * 2, "kvnode-vw")
        yield n
        n.shutdown()


def real_worker(node, layers):
    from kvmesh.connecting import connect_local

    w = WorkerSide([SPEC], lambda spec: connect_local(spec, node), ConnectorOptions(), BS, "kv_both", [NAMES],
                   background_copy=True)
    w.register(dict(zip(NAMES, layers)))
    return w


def save_through(node, layers, toks, ids):
    w = real_worker(node, layers)
    try:
        n = len(toks) // C
        meta = StepMeta(saves=[SaveJob("s", toks.tobytes(), 0, n, ids, None, None)])
        w.end_step(meta)
        wait_for(lambda: w.counts["vllm_saved_chunks"] == n)
        assert w.client(None).flush() == n
    finally:
        w.close()


def load_through(node, dst, toks, ids, sync):
    """Load chunks 0..2 of `toks` into `ids` (the first block vLLM's own: skipped); returns (failed blocks, counts)."""
    w = real_worker(node, dst)
    try:
        meta = StepMeta(loads=[LoadJob("r", toks.tobytes(), 0, 3, ids, 1, 3 * P, None, None, sync=sync)])
        w.start_loads(meta)
        if sync:  # the forward pass: each layer waits for its own writes
            for name in NAMES:
                w.wait_layer(name, meta)
            w.end_step(meta)
            w.finished(set())
        else:
            done = set()
            wait_for(lambda: done.update(w.finished(set())[1] or ()) or "r" in done)
        torch.cuda.synchronize()
        return w.load_errors(), dict(w.counts)
    finally:
        w.close()


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("layout", ["flash_attn_2_NB_BS_H_D", "flashinfer_NB_2_BS_H_D", "flash_attn_LBNHC"])
def test_a_load_through_a_real_node_lands_from_the_slab_on_the_gpu_bit_exact(node, layout, sync):
    make, block = LAYOUTS[layout]
    seed = 10 + list(LAYOUTS).index(layout) * 2 + sync
    g = torch.Generator().manual_seed(seed)
    src = make(g)
    toks = tokens(3, seed=seed)
    save_ids = torch.randperm(NB, generator=g)[:3 * P].tolist()
    load_ids = torch.randperm(NB, generator=g)[:3 * P].tolist()
    save_through(node, src, toks, save_ids)
    dst = [torch.zeros_like(t) for t in src]
    failed, counts = load_through(node, dst, toks, load_ids, sync)
    assert failed == set()
    # the device sink took them: DMA'd from this node's slab, not copied through a CPU tensor
    assert counts.get("fetched_chunks_to_device") == 3 and counts.get("fetched_chunks_local") == 3
    assert counts["vllm_loaded_blocks"] == 3 * P - 1
    for i in range(L):
        assert not bool(block(dst[i], load_ids[0]).ne(0).any()), "a skipped block was written"
        for s, d in zip(save_ids[1:], load_ids[1:]):
            assert torch.equal(block(dst[i], d), block(src[i], s)), f"layer {i} block {s}->{d}"


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_a_chunk_that_fails_its_checksum_in_the_slab_is_never_used(node, sync):
    # async: what arrived is written while the checks run, and the blocks from the bad chunk on are failed (vLLM
    # recomputes them before reading any block of the load); sync: the forward reads each layer at once, so only
    # chunks whose checks passed are written
    make, block = LAYOUTS["flash_attn_2_NB_BS_H_D"]
    g = torch.Generator().manual_seed(40 + sync)  # (each variant its own chunks: the node keeps the other's)
    src = make(g)
    toks = tokens(3, seed=40 + sync)
    save_ids = torch.randperm(NB, generator=g)[:3 * P].tolist()
    load_ids = torch.randperm(NB, generator=g)[:3 * P].tolist()
    save_through(node, src, toks, save_ids)
    from kvmesh.connecting import connect_local

    c = connect_local(SPEC, node)
    try:
        key = c.hashes(toks)[1]
    finally:
        c.close()
    (_, path, offset), = [w for w in node.locate([key])[0] if w[0] == "cpu"]
    with open(path, "r+b") as f:  # chunk 1 rots in the slab after it was stored
        f.seek(offset + min(1000, SPEC.chunk_bytes // 2))
        b = f.read(1)
        f.seek(offset + min(1000, SPEC.chunk_bytes // 2))
        f.write(bytes([b[0] ^ 0x20]))
    dst = [torch.zeros_like(t) for t in src]
    failed, counts = load_through(node, dst, toks, load_ids, sync=sync)
    assert failed == set(load_ids[P:])  # chunks 1 and 2: vLLM recomputes them
    assert counts["vllm_loaded_blocks"] == P - 1
    for i in range(L):
        for s, d in zip(save_ids[1:P], load_ids[1:P]):
            assert torch.equal(block(dst[i], d), block(src[i], s)), f"layer {i} block {s}->{d}"
        if sync:
            assert not any(bool(block(dst[i], d).ne(0).any()) for d in load_ids[P:]), "a failed block was written"



def test_what_a_step_computed_on_top_of_a_failed_sync_load_is_never_saved(node):
    # load_mode sync: the step that loads a request's prefix also computes (and saves) its next chunk. When the
    # load fails (the chunks were evicted after the lookup), that chunk attended to blocks never loaded: vLLM
    # recomputes it, but it was stored anyway, under its prompt's own hash, and served to the next prompt (other
    # greedy tokens, found by a hunt with a real vLLM engine). So may another request's in the same step, one that
    # shares those blocks through vLLM's prefix cache (a second hunt): the worker cannot tell which, so a step with a
    # failed load saves nothing, and reports the requests for the scheduler to save again.
    make, _block = LAYOUTS["flash_attn_2_NB_BS_H_D"]
    g = torch.Generator().manual_seed(60)
    layers = make(g)
    toks, other = tokens(4, seed=60), tokens(1, seed=61)  # chunks 0..2 of `toks` are held nowhere
    ids = torch.randperm(NB, generator=g)[:4 * P].tolist()
    w = real_worker(node, layers)
    try:
        load = LoadJob("r", toks[: 3 * C].tobytes(), 0, 3, ids[:3 * P], 1, 3 * P, None, None, sync=True)
        meta = StepMeta(loads=[load],
                        saves=[SaveJob("r", toks.tobytes(), 3, 4, ids[3 * P:4 * P], None, None),
                               SaveJob("o", other.tobytes(), 0, 1, ids[:P], None, None)])
        w.start_loads(meta)
        for name in NAMES:
            w.wait_layer(name, meta)
        w.end_step(meta)
        w.finished(set())
        assert w.load_errors()  # the load failed, and vLLM hears of it
        c = w.client(None)
        w.close()  # (the saver thread is done: every save it took went to the node, synchronously here)
        assert not node.cascade.holds(c.hashes(toks)[3]), "a chunk computed over unloaded blocks was stored"
        assert not node.cascade.holds(c.hashes(other)[0]), "a save of a step with a failed load was stored"
        assert w.counts["vllm_saves_dropped_failed_load"] == 2
        assert w.take_report().resave == ["r", "o"]
    finally:
        w.close()
