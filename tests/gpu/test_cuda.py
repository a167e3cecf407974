"""CUDA paths of the data plane. Skipped without a GPU; run on the H200 machine (see the closing notes)."""

import dataclasses
import os

import pytest
import torch

from kvmesh import KVSpec
from bench.movers_paged import gather_paged, scatter_paged, store_paged, to_host
from kvmesh.movers import to_device
from kvmesh.tiers import checksum
from kvmesh.tiers.cpu import CpuTier

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SPEC = KVSpec("m", num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", chunk_tokens=64)


@pytest.fixture
def tier(tmp_path):
    t = CpuTier(os.path.join("/dev/shm", f"kvmesh-test-{os.getpid()}"), 16, SPEC.chunk_bytes)
    yield t
    t.close()


def slots(tier, n, spec=SPEC):
    out = []
    for _ in range(n):
        t = tier.prepare_store(os.urandom(16), b"g" * 16, spec.chunk_bytes)
        out.append((t, tier.buffer(t.slot)[: spec.chunk_bytes]))
    return out


def test_the_cpu_tier_slab_is_page_locked(tier):
    assert tier.page_locked


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact (CUDA cannot compare float8 tensors)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# an fp8 KV cache too: CUDA has no indexed copy for float8 types, so the paged movers move their bytes
DTYPES = ["bfloat16", "float8_e4m3fn"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_gather_and_scatter_match_the_cpu_result(dtype):
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    cpu_layers = [torch.randn((2, 40, 16, 2, 64), generator=g).to(dt) for _ in range(4)]
    table = torch.randperm(40, generator=g)[:8].view(2, 4)
    gpu_layers = [t.cuda() for t in cpu_layers]
    assert same(gather_paged(gpu_layers, table.cuda()).cpu(), gather_paged(cpu_layers, table))
    dst = [torch.zeros_like(t) for t in gpu_layers]
    scatter_paged(gather_paged(gpu_layers, table.cuda()), dst, table.cuda())
    assert all(same(a[:, table.flatten().cuda()], b[:, table.flatten().cuda()]) for a, b in zip(dst, gpu_layers))


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_to_the_cpu_tier_and_layerwise_load_round_trip_bit_exact(tier, dtype):
    spec = dataclasses.replace(SPEC, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    layers = [torch.randn((2, 64, 16, 2, 64), generator=g).to(spec.torch_dtype).cuda() for _ in range(4)]
    table = torch.randperm(64, generator=g)[:32].view(8, 4).cuda()
    reserved = slots(tier, 8, spec)
    done = store_paged(layers, table, [v for _, v in reserved], batch_chunks=3)
    assert done is not None
    done.synchronize()
    expect = gather_paged(layers, table).cpu()
    for i, (ticket, view) in enumerate(reserved):
        assert bytes(view) == expect[i].view(torch.uint8).numpy().tobytes()
        tier.complete_store(ticket, checksum(view))
    load = to_device([v for _, v in reserved], spec, "cuda", min_copy_bytes=1)  # one group per layer
    assert len({id(e) for e in load.events}) == 4  # completion is signalled per layer
    for layer in range(4):
        load.wait(layer)
    assert same(load.staging.cpu(), expect)
    tier.check_integrity(verify_checksums=True)
    from bench.movers_paged import load_paged

    targets = [torch.zeros_like(t) for t in layers]
    load_paged([v for _, v in reserved], spec, targets, table, batch_chunks=3).synchronize()
    assert same(gather_paged(targets, table).cpu(), expect)
    # a load and a store in one step, batches interleaved: the load lands, the store writes the other pages
    from bench.movers_paged import load_and_store_paged

    again = [torch.zeros_like(t) for t in layers]
    other = torch.randperm(64, generator=g)[:12].view(3, 4).cuda()
    out = [torch.zeros(spec.chunk_bytes, dtype=torch.uint8).pin_memory() for _ in range(3)]
    loaded, stored = load_and_store_paged(([v for _, v in reserved], spec, again, table), (layers, other, out),
                                          batch_chunks=2)
    loaded.synchronize()
    stored.synchronize()
    assert same(gather_paged(again, table).cpu(), expect)
    assert same(torch.stack(out), gather_paged(layers, other).cpu().view(3, -1).view(torch.uint8))


def test_store_does_not_wait_for_its_copies():
    chunks = torch.randn((16, *SPEC.chunk_shape), device="cuda").to(torch.bfloat16)
    big = [torch.empty(SPEC.chunk_bytes, dtype=torch.uint8).pin_memory() for _ in range(16)]
    torch.cuda.synchronize()
    torch.cuda._sleep(int(5e8))  # a long kernel on the compute stream, as a running model would queue
    ev = to_host(chunks, big)
    assert not ev.query()  # the call returned with its copies still queued behind the compute stream's work
    ev.synchronize()


def test_prefill_on_load_gives_recompute_tokens_on_the_gpu():
    from kvmesh.integrations.hf import _forward, _new_cache, generate, prefill_on_load, tiny_llama
    from bench.movers_paged import gather_contiguous

    model = tiny_llama(3, vocab_size=512, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2).cuda()
    spec = KVSpec("t", 4, 2, 32, "float32", chunk_tokens=32)
    ids = torch.randint(0, 512, (1, 32 * 6 + 9), generator=torch.Generator().manual_seed(4)).cuda()
    cache = _new_cache()
    with torch.inference_mode():
        _forward(model, ids[:, :192], cache)
        keys = [cache.layers[i].keys for i in range(4)] if hasattr(cache, "layers") else cache.key_cache
        values = [cache.layers[i].values for i in range(4)] if hasattr(cache, "layers") else cache.value_cache
        chunks = gather_contiguous(keys, values, 0, 6, 32).cpu().pin_memory()
        load = to_device([chunks[i].view(torch.uint8).reshape(-1) for i in range(6)], spec, "cuda")
        logits, _ = prefill_on_load(model, ids[:, 192:], load, 192)
    plain = generate(model, ids[0].cpu(), 1, keep_logits=True)
    assert int(logits.argmax(-1)) == plain.tokens[0]
    assert torch.allclose(logits[0].float().cpu(), plain.first_logits, atol=1e-3)


FRESH_PROCESS_STORE = r"""
import time, torch
from bench.movers_paged import gather_paged, store_paged
layers = [torch.randn((2, 64, 16, 2, 64), device="cuda").to(torch.bfloat16) for _ in range(4)]
table = torch.randperm(64, device="cuda")[:32].view(8, 4)
hosts = [torch.zeros(4 * 2 * 64 * 2 * 64 * 2, dtype=torch.uint8).pin_memory() for _ in range(8)]
expect = gather_paged(layers, table).cpu().view(8, -1).view(torch.uint8)
torch.cuda.synchronize()
torch.cuda._sleep(2_000_000_000)  # the engine's compute stream is busy (~1 s)
t0 = time.perf_counter()
done = store_paged(layers, table, hosts, batch_chunks=3)
returned_s = time.perf_counter() - t0
done.synchronize()
assert all(torch.equal(hosts[i], expect[i]) for i in range(8)), "wrong bytes"
print("returned_s", returned_s)
"""


def test_the_first_side_stream_of_a_process_does_not_wait_for_a_busy_device(tmp_path):
    """The first `torch.cuda.Stream()` of a process waits for the work already queued on the device (torch sets up
    its stream pool then): an engine's first store or fetch would block its Python for a whole prefill. Side streams
    are made with the runtime's own call instead (`cudart.side_stream`). Run in a fresh process: in this one,
    earlier tests have made streams already. With CUDA's module loading eager: under its default (lazy) the first
    launch of each kernel waits for a busy device too (measured: 505 ms for the gather's `index_select`), the
    runtime's behaviour for every kernel of a process, the engine's own included, which engines' warm-up runs
    cover for theirs and `CUDA_MODULE_LOADING=EAGER` for all (see the README)."""
    import subprocess
    import sys

    script = tmp_path / "fresh.py"
    script.write_text(FRESH_PROCESS_STORE)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (bench/ is not installed)
    env = dict(os.environ, CUDA_MODULE_LOADING="EAGER",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    returned_s = float(out.stdout.split("returned_s")[1])
    assert returned_s < 0.2, returned_s
