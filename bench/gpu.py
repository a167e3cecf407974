"""GPU data-plane benchmark (run on a CUDA machine; needs torch + transformers + kvmesh, not Ray or Redis).

  P1  moving paged KV (Llama-3.1-8B shape, 16-token pages, >= 1 GiB) GPU -> CPU tier and CPU tier -> GPU, each
      as a ratio to a raw pinned cudaMemcpy of the same bytes, and both at once vs raw bidirectional copies.
      Goals: >= 0.95 each way, >= 0.90 both ways.
  P2  time to first token with a CPU-tier hit vs recompute: Llama-3.1-8B shape, random bf16 weights, 32 k-token
      prompt + 64-token suffix. Goal: >= 0.9 of ideal = recompute / (KV bytes / H2D bandwidth + suffix prefill).
  P2' the same CPU-tier hit as a ratio to the overlapped limit recompute / max(KV bytes / H2D bw, suffix prefill):
      p2_ratio_to_overlapped_limit = max(KV bytes / H2D bw, suffix prefill) / hit TTFT. Goal >= 0.9. Reported for
      the default load (one strided copy per layer over each run of slab slots) and the previous one (a copy per
      chunk and 8 MiB layer group) in the same run.
  G1  GPU-tier hit bandwidth through CUDA IPC from a second process, as a ratio to a raw D2D copy (bench/gpu_tier.py).
  G2  TTFT at the P2 point with the prefix in another process's GPU tier (stored there D2D, loaded layer by layer
      D2D, device checksums verified), beside the CPU-tier hit and recompute; its logits must equal the CPU-tier
      hit's bit for bit (the same bytes), and both the split recompute's.
  LMCache  P1's paged store and load timed with LMCache 0.5.3's compiled multi_layer_kv_transfer on the same bytes
      and layout (bench/lmcache_side.py): p1_ratio_to_lmcache_store / _load = LMCache time / kvmesh time (>= 1.0).
  DEVSUM  the device checksum (what every verified GPU-side read runs) over 4 GiB in 32 MiB chunks: the fused
      Triton kernel vs the torch ops it replaced, each as a ratio to a raw D2D copy of the same bytes, same sums.
  VLLM the vLLM connector's load into GPU blocks (its worker half with real CUDA tensors in vLLM's 5-D and logical
      layouts, a KVNode as a plain object, Llama-3.1-8B shape, 16-token blocks, 2 GiB): vllm_gpu_load_ratio_to_h2d =
      a raw pinned H2D copy of the same bytes / the connector's load, in the same run. Goal >= 0.9 (bench/gpu_vllm.py).
  P3  speedup with the cost model on over {Llama-3.2-1B, Llama-3.1-8B shape} x {512, 2 k, 8 k, 32 k} tokens.
      Goal >= 1.0 everywhere. Greedy tokens compared with recompute at every point, max |logit diff| reported.

Run: python bench/gpu.py            (full)        python bench/gpu.py --quick   (small shapes, e.g. on the CPU)
     python bench/gpu.py --only tier  (P1 + LMCache, G1, P2/P2'/G2: the GPU-tier issue's figures)
     python bench/gpu.py --only vllm  (the vLLM connector's load into GPU blocks)
     python bench/gpu.py --only devsum  (the device checksum, fused vs torch ops)
     python bench/gpu.py --multi-gpu  (M1, M2 of the multi-GPU node: bench/gpu_multi.py; needs 2 GPUs, else it
                                       writes an error JSON; --multi-gpu-same-device: the same code on cuda:0 alone,
                                       a smoke run)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import save  # noqa: E402
from bench.movers_paged import (gather_contiguous, gather_paged, load_and_store_paged, load_paged,  # noqa: E402
                                scatter_paged, store_paged, to_host)
from kvmesh import KVSpec  # noqa: E402
from kvmesh.cost import CostModel, LinkModel  # noqa: E402
from kvmesh.integrations.hf import _forward, _new_cache, _layer_kv, prefill_on_load  # noqa: E402
from kvmesh.movers import to_device  # noqa: E402
from kvmesh.tiers import checksum  # noqa: E402
from kvmesh.tiers.cpu import CpuTier  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
SHAPES = {  # name: (layers, hidden, heads, kv_heads, head_dim, intermediate, vocab)
    "llama-3.2-1b": (16, 2048, 32, 8, 64, 8192, 128256),
    "llama-3.1-8b": (32, 4096, 32, 8, 128, 14336, 128256),
    "tiny": (2, 128, 4, 2, 32, 256, 512),
}


class Timer:
    """Wall time of GPU work: synchronizes before and after."""

    def __init__(self, device):
        self.device = device

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn, repeat=5, warmup=1):
        """Minimum over `repeat` runs: the least disturbed one, for every path alike."""
        for _ in range(warmup):
            fn()
        out = []
        for _ in range(repeat):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            out.append(time.perf_counter() - t0)
        return min(out)

    def interleaved(self, fa, fb, repeat=7):
        fa(), fb()
        ta, tb = [], []
        for _ in range(repeat):
            for f, acc in ((fa, ta), (fb, tb)):
                self.sync()
                t0 = time.perf_counter()
                f()
                self.sync()
                acc.append(time.perf_counter() - t0)
        return min(ta), min(tb)


def make_tier(nbytes_slots: int, slot_bytes: int) -> CpuTier:
    path = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                        f"kvmesh-bench-{os.getpid()}-{os.urandom(4).hex()}")
    return CpuTier(path, nbytes_slots // slot_bytes, slot_bytes)


def put_chunks(tier: CpuTier, n: int, nbytes: int) -> list[memoryview]:
    """Reserve n slots (written later) and return their buffers."""
    views = []
    for i in range(n):
        t = tier.prepare_store(os.urandom(16), b"g" * 16, nbytes)
        views.append(tier.buffer(t.slot)[:nbytes])
        tier.complete_store(t, 0)
    return views


# -- P1 ------------------------------------------------------------------------------------------------------------
def p1(device, total_bytes: int, layers=32, heads=8, head_dim=128, block=16, chunk_tokens=256) -> dict:
    spec = KVSpec("p1", layers, heads, head_dim, "bfloat16", chunk_tokens=chunk_tokens)
    n = max(1, total_bytes // spec.chunk_bytes)
    pages = chunk_tokens // block
    num_blocks = n * pages + 64
    g = torch.Generator(device="cpu").manual_seed(0)
    paged = [torch.randn((2, num_blocks, block, heads, head_dim), generator=g).to(device, torch.bfloat16)
             for _ in range(layers)]
    table = torch.randperm(num_blocks, generator=g)[: n * pages].view(n, pages).to(device)  # scattered pages
    tier = make_tier(2 * n * spec.chunk_bytes, spec.chunk_bytes)
    dsts = put_chunks(tier, n, spec.chunk_bytes)
    srcs2 = put_chunks(tier, n, spec.chunk_bytes)  # a second set, loaded while the first is stored
    nbytes = n * spec.chunk_bytes
    timer = Timer(device)
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    raw_d2h = timer(lambda: host_buf.copy_(dev_buf, non_blocking=True))
    raw_h2d = timer(lambda: dev_buf.copy_(host_buf, non_blocking=True))
    if device.type == "cuda":
        dev_buf2 = torch.empty_like(dev_buf)
        host_buf2 = torch.empty_like(host_buf).pin_memory()
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

        def raw_both():
            with torch.cuda.stream(s1):
                host_buf.copy_(dev_buf, non_blocking=True)
            with torch.cuda.stream(s2):
                dev_buf2.copy_(host_buf2, non_blocking=True)
        raw_bidir = timer(raw_both)
    else:
        raw_bidir = raw_d2h + raw_h2d
    del dev_buf, host_buf
    store_t = timer(lambda: store_paged(paged, table, dsts))
    targets = [torch.zeros_like(t) for t in paged]

    def load(min_copy_bytes=8 * MiB):
        ld = to_device(dsts, spec, device, min_copy_bytes=min_copy_bytes)
        ld.then(lambda layer, piece: scatter_paged(piece.unsqueeze(1), [targets[layer]], table))
        return ld
    load_layerwise_t = timer(load)  # 8 MiB pieces, completion per layer group, scatter overlapping the copies
    load_t = timer(lambda: load_paged(dsts, spec, targets, table))  # one copy per chunk, pipelined by batch
    # correctness of the round trip: the pages landed where the table says, bit for bit
    torch.cuda.synchronize() if device.type == "cuda" else None
    ok = all(torch.equal(t[:, table.flatten()], p[:, table.flatten()]) for t, p in zip(targets, paged))

    def both_one_after_the_other():  # the store is enqueued only once every batch of the load is
        load_paged(dsts, spec, targets, table)
        store_paged(paged, table, srcs2)
    both_sequential_t = timer(both_one_after_the_other)
    both_t = timer(lambda: load_and_store_paged((dsts, spec, targets, table), (paged, table, srcs2)))
    # the same raw copies into the CPU tier's own (registered /dev/shm) memory, for the analysis
    slab = torch.frombuffer(tier._view, dtype=torch.uint8)[:nbytes]
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    raw_slab_d2h = timer(lambda: slab.copy_(dev_buf, non_blocking=True))
    raw_slab_h2d = timer(lambda: dev_buf.copy_(slab, non_blocking=True))
    if device.type == "cuda":  # both directions at once, both on the slab (a D2H into one half, an H2D from other)
        half = nbytes // 2
        slab_a, slab_b = slab[:half], slab[half:2 * half]
        dev_a, dev_b = dev_buf[:half], torch.empty(half, dtype=torch.uint8, device=device)

        def raw_slab_both():
            with torch.cuda.stream(s1):
                slab_a.copy_(dev_a, non_blocking=True)
            with torch.cuda.stream(s2):
                dev_b.copy_(slab_b, non_blocking=True)
        raw_slab_bidir = timer(raw_slab_both)
        extra = {"raw_slab_bidir_gbps": 2 * half / raw_slab_bidir / 1e9}
        del dev_b
    else:
        extra = {}
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            extra["shmem_thp"] = f.read().strip()
    except OSError:
        pass
    del dev_buf, slab
    locked = tier.page_locked
    tier.close()
    if device.type == "cuda":
        try:
            from bench.lmcache_side import lmcache_paged

            lm = lmcache_paged(paged, table, block, chunk_tokens, timer, expected_chunks=gather_paged(paged, table))
            extra.update(lm, ratio_lmcache_store_to_raw=raw_d2h / lm["lmcache_store_s"],
                         ratio_lmcache_load_to_raw=raw_h2d / lm["lmcache_load_s"],
                         p1_ratio_to_lmcache_store=lm["lmcache_store_s"] / store_t,
                         p1_ratio_to_lmcache_load=lm["lmcache_load_s"] / load_t)
        except Exception as e:  # not installed, or its extension does not load on this torch: say so
            extra["lmcache_error"] = f"{type(e).__name__}: {e}"
    return {
        "bytes": nbytes, "chunks": n, "chunk_bytes": spec.chunk_bytes, "page_tokens": block,
        "cpu_tier_page_locked": locked, **extra,
        "raw_into_cpu_tier_slab_d2h_gbps": nbytes / raw_slab_d2h / 1e9,
        "raw_from_cpu_tier_slab_h2d_gbps": nbytes / raw_slab_h2d / 1e9, "round_trip_bit_exact": ok,
        "raw_d2h_gbps": nbytes / raw_d2h / 1e9, "raw_h2d_gbps": nbytes / raw_h2d / 1e9,
        "raw_bidir_gbps": 2 * nbytes / raw_bidir / 1e9,
        "store_gpu_to_cpu_tier_gbps": nbytes / store_t / 1e9, "load_cpu_tier_to_gpu_gbps": nbytes / load_t / 1e9,
        "both_gbps": 2 * nbytes / both_t / 1e9, "both_issued_one_after_the_other_gbps": 2 * nbytes / both_sequential_t / 1e9,
        "load_layerwise_gbps": nbytes / load_layerwise_t / 1e9,
        "ratio_store": raw_d2h / store_t, "ratio_load": raw_h2d / load_t, "ratio_both": raw_bidir / both_t,
        "goal": "store, load >= 0.95; both >= 0.90",
    }


# -- models --------------------------------------------------------------------------------------------------------
def make_model(shape: str, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, heads, kv_heads, head_dim, inter, vocab = SHAPES[shape]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=inter,
                      max_position_embeddings=40960, initializer_range=0.1, tie_word_embeddings=False)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


class Runner:
    """Prefill paths for one model, all through kvmesh.integrations.hf's functions."""

    def __init__(self, model, device, chunk_tokens=256):
        self.model, self.device = model, device
        cfg = model.config
        self.spec = KVSpec("bench", cfg.num_hidden_layers, cfg.num_key_value_heads,
                           getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                           str(next(model.parameters()).dtype).removeprefix("torch."), chunk_tokens=chunk_tokens)
        self.timer = Timer(device)

    @torch.inference_mode()
    def recompute(self, ids):
        cache = _new_cache()
        return _forward(self.model, ids, cache, logits_to_keep=1).logits[:, -1], cache

    @torch.inference_mode()
    def split_recompute(self, ids, prefix_tokens):
        """Recompute in two steps, no kvmesh: the prefix alone, then the suffix on the prefix's cache. This is what
        any prefix cache (an engine's own included) computes; reuse through kvmesh must match it bit for bit."""
        cache = _new_cache()
        _forward(self.model, ids[:, :prefix_tokens], cache, logits_to_keep=1)
        return _forward(self.model, ids[:, prefix_tokens:], cache, logits_to_keep=1).logits[:, -1], cache

    @torch.inference_mode()
    def stash_prefix(self, ids, prefix_tokens, tier):
        """Compute the prefix's KV and store it in the CPU tier (as a cache hit would find it)."""
        cache = _new_cache()
        _forward(self.model, ids[:, :prefix_tokens], cache, logits_to_keep=1)
        L = self.spec.num_layers
        keys = [_layer_kv(cache, i)[0] for i in range(L)]
        values = [_layer_kv(cache, i)[1] for i in range(L)]
        n = prefix_tokens // self.spec.chunk_tokens
        views = put_chunks(tier, n, self.spec.chunk_bytes)
        chunks = gather_contiguous(keys, values, 0, n, self.spec.chunk_tokens)
        ev = to_host(chunks, views)
        if ev is not None:
            ev.synchronize()
        return views, [checksum(v) for v in views]

    @torch.inference_mode()
    def reuse_gpu_tier(self, ids, hit, verify=True):
        """Load the prefix from another process's GPU tier (`bench.gpu_tier.GpuTierHit`) under the suffix prefill;
        the device checksums are verified before the logits count (as `hf.generate` does with `verified()`)."""
        n = hit.n * self.spec.chunk_tokens
        load = hit.load(self.device, verify=verify)
        out = prefill_on_load(self.model, ids[:, n:], load, n)
        assert load.verified(), "a GPU-tier chunk failed its device checksum"
        return out

    @torch.inference_mode()
    def reuse(self, ids, views, front_chunks=0, strided=None):
        """Load chunks [front, len(views)) from the CPU tier layer by layer, computing [0, front) meanwhile."""
        c = self.spec.chunk_tokens
        load = to_device(views[front_chunks:], self.spec, self.device, strided=strided) \
            if len(views) > front_chunks else None
        front_cache = None
        if front_chunks:
            front_cache = _new_cache()
            _forward(self.model, ids[:, :front_chunks * c], front_cache, logits_to_keep=1)
        loaded = (len(views) - front_chunks) * c
        start = front_chunks * c + loaded
        return prefill_on_load(self.model, ids[:, start:], load, loaded, front_cache, front_chunks * c)

    @torch.inference_mode()
    def suffix_only(self, ids, views):
        """The suffix prefill alone, its prefix already on the GPU (the denominator of the ideal)."""
        from kvmesh.integrations.hf import _install

        c = self.spec.chunk_tokens
        n = len(views) * c
        load = to_device(views, self.spec, self.device)
        _, cache = prefill_on_load(self.model, ids[:, n:n + 1], load, n)  # prefix K/V now on the GPU
        kv = [_layer_kv(cache, i) for i in range(self.spec.num_layers)]
        kv = [(k[:, :, :n], v[:, :, :n]) for k, v in kv]
        self.timer.sync()

        def run():
            fresh = _new_cache()
            for i, (k, v) in enumerate(kv):
                _install(fresh, i, k, v)  # no copy: the forward's concatenation makes new tensors
            return _forward(self.model, ids[:, n:], fresh, logits_to_keep=1)
        return self.timer(run, repeat=5)

    @torch.inference_mode()
    def decode(self, logits, cache, steps):
        toks = [int(logits.argmax(-1))]
        nxt = logits.argmax(-1)
        for _ in range(steps - 1):
            nxt = _forward(self.model, nxt.view(1, 1), cache).logits[:, -1].argmax(-1)
            toks.append(int(nxt))
        return toks


def _cache_copy(cache, n):
    from kvmesh.integrations.hf import _install

    out = _new_cache()
    layer = 0
    while True:
        try:
            k, v = _layer_kv(cache, layer)
        except (IndexError, KeyError):
            break
        _install(out, layer, k[:, :, :n].clone(), v[:, :, :n].clone())
        layer += 1
    return out


# -- P2 ------------------------------------------------------------------------------------------------------------
def _g2(r, ids, prompt_tokens, views, t_rec, t_cpu_hit) -> dict:
    """The P2 prompt with its prefix in another process's GPU tier (stored D2D from the computed chunks)."""
    from bench.gpu_tier import GpuTierHit

    n = len(views)
    chunks = torch.stack([torch.frombuffer(v, dtype=torch.uint8) for v in views]).to(r.device)
    chunks = chunks.view(n, -1).view(r.spec.torch_dtype).view(n, *r.spec.chunk_shape)
    hit = GpuTierHit(chunks, r.spec)
    del chunks
    try:
        t_gpu = r.timer(lambda: r.reuse_gpu_tier(ids, hit), repeat=3)
        t_gpu_unverified = r.timer(lambda: r.reuse_gpu_tier(ids, hit, verify=False), repeat=3)
        t_load = r.timer(lambda: hit.load(r.device, verify=False), repeat=3)
        t_load_verified = r.timer(lambda: hit.load(r.device).verified(), repeat=3)
        lg, _ = r.reuse_gpu_tier(ids, hit)
        lc, _ = r.reuse(ids, views)
        ls, _ = r.split_recompute(ids, prompt_tokens)
        return {"g2_ttft_gpu_hit_s": t_gpu, "g2_ttft_cpu_hit_s": t_cpu_hit, "g2_ttft_recompute_s": t_rec,
                "g2_speedup_gpu_hit": t_rec / t_gpu, "g2_gpu_hit_stored_verified": hit.stored_verified,
                "g2_ttft_gpu_hit_unverified_s": t_gpu_unverified, "g2_gpu_tier_load_alone_s": t_load,
                "g2_gpu_tier_load_alone_gbps": n * r.spec.chunk_bytes / t_load / 1e9,
                "g2_gpu_tier_load_verified_alone_s": t_load_verified,
                "g2_logits_equal_cpu_hit": bool(torch.equal(lg, lc)),
                "g2_logits_equal_split_recompute": bool(torch.equal(lg, ls)),
                "g2_gpu_tier_device": str(hit.srcs[0].device), "g2_reader_device": str(r.device)}
    finally:
        hit.close()


def p2(device, shape, prompt_tokens, suffix_tokens, h2d_bps, decode_steps, gpu_tier=False) -> dict:
    model = make_model(shape, device, torch.bfloat16)
    r = Runner(model, device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_tokens + suffix_tokens), generator=g).to(device)
    tier = make_tier(prompt_tokens // 256 * r.spec.chunk_bytes + r.spec.chunk_bytes, r.spec.chunk_bytes)
    views, sums = r.stash_prefix(ids, prompt_tokens, tier)
    t_rec = r.timer(lambda: r.recompute(ids), repeat=3)
    t_hit = r.timer(lambda: r.reuse(ids, views), repeat=3)
    t_hit_unstrided = r.timer(lambda: r.reuse(ids, views, strided=False), repeat=3)
    t_suffix = r.suffix_only(ids, views)
    kv_bytes = len(views) * r.spec.chunk_bytes
    ideal = t_rec / (kv_bytes / h2d_bps + t_suffix)
    overlapped = max(kv_bytes / h2d_bps, t_suffix)  # the hit's floor when the load hides under the prefill
    g2 = {}
    if gpu_tier and device.type == "cuda":
        try:
            g2 = _g2(r, ids, prompt_tokens, views, t_rec, t_hit)
        except Exception as e:  # recorded; P2 itself still reports
            import traceback

            traceback.print_exc()
            g2 = {"g2_error": f"{type(e).__name__}: {e}"}
    la, ca = r.recompute(ids)
    lb, cb = r.reuse(ids, views)
    diff = float((la.float() - lb.float()).abs().max())
    scale = float(la.float().abs().max())
    # how far the stored prefix KV (computed alone) is from the same positions inside the full recompute
    kv_rel = max(float((_layer_kv(ca, i)[j][:, :, :prompt_tokens].float() - _layer_kv(cb, i)[j][:, :, :prompt_tokens]
                        .float()).abs().max() / _layer_kv(ca, i)[j].float().abs().max())
                 for i in range(r.spec.num_layers) for j in (0, 1))
    toks_a, toks_b = r.decode(la, ca, decode_steps), r.decode(lb, cb, decode_steps)
    first_diverge = next((i for i, (x, y) in enumerate(zip(toks_a, toks_b)) if x != y), None)
    intact = [checksum(v) for v in views] == sums
    tier.close()
    del model
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return {"shape": shape, "prompt_tokens": prompt_tokens, "suffix_tokens": suffix_tokens, "kv_bytes": kv_bytes,
            "recompute_ttft_s": t_rec, "hit_ttft_s": t_hit, "suffix_prefill_s": t_suffix,
            "speedup": t_rec / t_hit, "ideal_speedup": ideal, "ratio_to_ideal": (t_rec / t_hit) / ideal,
            "overlapped_limit_s": overlapped, "ratio_to_overlapped_limit": overlapped / t_hit,
            "hit_ttft_unstrided_s": t_hit_unstrided, "ratio_to_overlapped_limit_unstrided": overlapped / t_hit_unstrided,
            "goal": ">= 0.9 (ratio_to_overlapped_limit)", "greedy_identical": toks_a == toks_b,
            "decode_steps": decode_steps, **g2,
            "max_abs_logit_diff": diff, "max_abs_logit": scale, "relative_logit_diff": diff / scale,
            "first_divergent_token": first_diverge, "prefix_kv_max_relative_diff": kv_rel,
            "cpu_tier_unchanged": intact}


# -- P3 ------------------------------------------------------------------------------------------------------------
def devsum_figure(device, total_bytes: int, chunk_bytes: int) -> dict:
    """The device checksum of `total_bytes` in chunks of `chunk_bytes` (as a verified GPU-tier hit of that many
    chunks runs it): the fused Triton kernel and the torch ops it replaces, each as a ratio to a raw D2D copy of the
    same bytes in the same run (a copy reads and writes each byte, the fused sum only reads it); the two must give
    the same sums."""
    from kvmesh.tiers.devsum import Coefficients, fused_ok

    n = total_bytes // chunk_bytes
    g = torch.Generator(device=device).manual_seed(7)
    bufs = [torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8, device=device, generator=g) for _ in range(n)]
    dsts = [torch.empty_like(b) for b in bufs]
    timer = Timer(device)
    co = Coefficients()

    def sums():
        return torch.cat([co.row_sums(b.view(torch.int32).view(1, -1)) for b in bufs])

    def copy():
        for d, b in zip(dsts, bufs):
            d.copy_(b)

    out: dict = {"total_bytes": total_bytes, "chunk_bytes": chunk_bytes, "fused_used": fused_ok(device)}
    t_copy = timer(copy)
    fused = sums()
    t_fused = timer(sums)
    os.environ["KVMESH_DEVICE_CHECKSUM"] = "torch"
    try:
        ops = sums()
        t_ops = timer(sums)
    finally:
        del os.environ["KVMESH_DEVICE_CHECKSUM"]
    rows = torch.stack(bufs).view(torch.int32)  # every chunk a row of one tensor: one launch for all
    t_rows = timer(lambda: co.row_sums(rows))
    out["fused_one_launch_gbps"] = total_bytes / t_rows / 1e9
    out["fused_one_launch_same_sums"] = bool(torch.equal(co.row_sums(rows), fused))
    del rows
    # the chunks where they are (separate allocations, as a hit lands in an engine's pages): device_checksums finds
    # them through a device array of their addresses, one launch for all
    from kvmesh.tiers.devsum import device_checksums

    t_bufs = timer(lambda: device_checksums(bufs, co))
    out["fused_separate_buffers_one_launch_gbps"] = total_bytes / t_bufs / 1e9
    out["fused_separate_buffers_same_sums"] = bool(torch.equal(device_checksums(bufs, co), fused))
    out.update({
        "d2d_copy_gbps": total_bytes / t_copy / 1e9, "fused_gbps": total_bytes / t_fused / 1e9,
        "torch_ops_gbps": total_bytes / t_ops / 1e9, "fused_ratio_to_d2d_copy": t_copy / t_fused,
        "torch_ops_ratio_to_d2d_copy": t_copy / t_ops, "fused_speedup_over_torch_ops": t_ops / t_fused,
        "same_sums": bool(torch.equal(fused, ops)),
    })
    return out


def p3(device, shapes, lengths, suffix_tokens, h2d_bps, h2d_latency, decode_steps) -> list[dict]:
    rows = []
    for shape in shapes:
        model = make_model(shape, device, torch.bfloat16)
        r = Runner(model, device)
        cost = CostModel({"h2d": LinkModel(h2d_bps, h2d_latency)})
        g = torch.Generator().manual_seed(2)
        cases = []
        for n in lengths:
            ids = torch.randint(0, model.config.vocab_size, (1, n + suffix_tokens), generator=g).to(device)
            tier = make_tier(n // 256 * r.spec.chunk_bytes + r.spec.chunk_bytes, r.spec.chunk_bytes)
            views, _ = r.stash_prefix(ids, n, tier)
            cases.append((n, ids, tier, views))
        # calibration, as a running engine would have observed: prefills with and without a cached prefix, and
        # what a reuse costs beyond its suffix prefill (the load and its overheads)
        for n, ids, _tier, views in cases:
            cost.prefill.observe(n + suffix_tokens, 0, r.timer(lambda: r.recompute(ids), repeat=2))
            t_suffix = r.suffix_only(ids, views)
            cost.prefill.observe(suffix_tokens, n, t_suffix)
            t = r.timer(lambda: r.reuse(ids, views), repeat=2)
            cost.observe_transfer("h2d", len(views) * r.spec.chunk_bytes, max(t - t_suffix, 1e-6))
        for n, ids, tier, views in cases:
            plan = cost.plan(n + suffix_tokens, r.spec.chunk_tokens, r.spec.chunk_bytes, ["h2d"] * len(views))
            if plan.end == 0:
                def chosen():
                    return r.recompute(ids)
            else:
                vs = views[: plan.end]

                def chosen():
                    return r.reuse(ids, vs, plan.front)
            # recompute and the plan, interleaved so drift hits both alike; the minimum of each
            t_rec, t_plan = r.timer.interleaved(lambda: r.recompute(ids), chosen, repeat=7)
            t_load_all = r.timer(lambda: r.reuse(ids, views), repeat=3)
            la, ca = r.recompute(ids)
            lb, cb = chosen()
            rows.append({
                "shape": shape, "prompt_tokens": n, "suffix_tokens": suffix_tokens, "plan": plan.reason,
                "plan_est_reuse_s": plan.est_reuse_s, "plan_est_recompute_s": plan.est_recompute_s,
                "plan_front": plan.front, "plan_end": plan.end, "chunks": len(views),
                "recompute_ttft_s": t_rec, "planned_ttft_s": t_plan, "load_all_ttft_s": t_load_all,
                "speedup": t_rec / t_plan, "speedup_load_all": t_rec / t_load_all, "goal": ">= 1.0",
                "greedy_identical": r.decode(la, ca, decode_steps) == r.decode(lb, cb, decode_steps),
                "max_abs_logit_diff": float((la.float() - lb.float()).abs().max()),
                "relative_logit_diff": float((la.float() - lb.float()).abs().max() / la.float().abs().max()),
            })
            print(rows[-1], flush=True)
            tier.close()
        del model, cases
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows


def correctness_bf16(device, shapes, lengths, suffix_tokens, decode_steps) -> list[dict]:
    """Where bf16 reuse differs from a one-shot recompute, is kvmesh the cause? Three paths per point: one-shot
    recompute, split recompute (prefix, then suffix on its cache; no kvmesh) and reuse (the prefix's KV stored in
    and loaded from the CPU tier). Reuse must equal the split recompute exactly (logits and greedy tokens); the
    one-shot vs split difference is bf16's own (different kernels and summation orders), which every prefix cache
    has."""
    rows = []
    for shape in shapes:
        model = make_model(shape, device, torch.bfloat16)
        r = Runner(model, device)
        g = torch.Generator().manual_seed(4)
        for n in lengths:
            ids = torch.randint(0, model.config.vocab_size, (1, n + suffix_tokens), generator=g).to(device)
            tier = make_tier(n // 256 * r.spec.chunk_bytes + r.spec.chunk_bytes, r.spec.chunk_bytes)
            views, _ = r.stash_prefix(ids, n, tier)
            la, ca = r.recompute(ids)
            ls, cs = r.split_recompute(ids, n)
            lb, cb = r.reuse(ids, views)
            ta, ts, tb = (r.decode(x, c, decode_steps) for x, c in ((la, ca), (ls, cs), (lb, cb)))
            rows.append({
                "shape": shape, "dtype": "bfloat16", "prompt_tokens": n, "suffix_tokens": suffix_tokens,
                "reuse_logits_equal_split": bool(torch.equal(lb, ls)), "reuse_greedy_equal_split": tb == ts,
                "reuse_vs_split_max_abs_logit_diff": float((lb.float() - ls.float()).abs().max()),
                "reuse_greedy_equal_oneshot": tb == ta, "split_greedy_equal_oneshot": ts == ta,
                "oneshot_vs_split_max_abs_logit_diff": float((la.float() - ls.float()).abs().max()),
                "oneshot_vs_reuse_max_abs_logit_diff": float((la.float() - lb.float()).abs().max()),
                "max_abs_logit": float(la.float().abs().max()),
            })
            print(rows[-1], flush=True)
            tier.close()
        del model
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows


def correctness_fp32(device, shape, lengths, suffix_tokens, decode_steps) -> list[dict]:
    """The same load path in float32 (TF32 off): numerics no longer hide a layout or ordering bug."""
    model = make_model(shape, device, torch.float32)
    r = Runner(model, device)
    g = torch.Generator().manual_seed(3)
    rows = []
    for n in lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, n + suffix_tokens), generator=g).to(device)
        tier = make_tier(n // 256 * r.spec.chunk_bytes + r.spec.chunk_bytes, r.spec.chunk_bytes)
        views, _ = r.stash_prefix(ids, n, tier)
        la, ca = r.recompute(ids)
        lb, cb = r.reuse(ids, views)
        ta, tb = r.decode(la, ca, decode_steps), r.decode(lb, cb, decode_steps)
        rows.append({"shape": shape, "dtype": "float32", "prompt_tokens": n, "greedy_identical": ta == tb,
                     "max_abs_logit_diff": float((la - lb).abs().max()),
                     "relative_logit_diff": float((la - lb).abs().max() / la.abs().max())})
        print(rows[-1], flush=True)
        tier.close()
    del model
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes (for a CPU smoke run)")
    p.add_argument("--only", choices=["p1", "p2", "p3", "fp32", "bf16", "g1", "tier", "vllm", "devsum"],
                   help="tier: P1 with LMCache beside it, G1, and P2/P2'/G2")
    p.add_argument("--multi-gpu", action="store_true",
                   help="M1/M2 only: a GPU tier on cuda:0 read by a worker on cuda:1 (bench/gpu_multi.py)")
    p.add_argument("--multi-gpu-same-device", action="store_true",
                   help="with --multi-gpu: both 'GPUs' are cuda:0 (a smoke run of the M1/M2 code on one GPU)")
    args = p.parse_args()
    if args.multi_gpu or args.multi_gpu_same_device:
        from bench.gpu_multi import run

        sys.exit(run(args.quick, args.multi_gpu_same_device))  # (it forces multicast off before CUDA starts)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = {"device": str(device)}
    if args.quick:
        p1_kw = dict(total_bytes=8 * MiB, layers=2, heads=2, head_dim=32)
        p2_args = ("tiny", 1024, 16)
        shapes, lengths = ["tiny"], [256, 1024]
    else:
        p1_kw = dict(total_bytes=2 * GiB)
        p2_args = ("llama-3.1-8b", 32768, 64)
        shapes, lengths = ["llama-3.2-1b", "llama-3.1-8b"], [512, 2048, 8192, 32768]
    name = "gpu" if not args.quick else "gpu-quick"
    partial = os.path.join(os.environ.get("OUT", tempfile.gettempdir()), f"{name}-partial.json")

    def checkpoint():
        import json

        with open(partial, "w") as f:
            json.dump(out, f, indent=2)
    if args.only in (None, "p1", "tier"):
        out["p1"] = p1(device, **p1_kw)
        print("P1", out["p1"], flush=True)
        for k in ("p1_ratio_to_lmcache_store", "p1_ratio_to_lmcache_load"):
            if k in out["p1"]:
                out[k] = out["p1"][k]
        checkpoint()
    if args.only in (None, "g1", "tier") and device.type == "cuda":
        from bench.gpu_tier import g1

        try:
            out["g1"] = g1(device, Timer(device), 256 * MiB if args.quick else 4 * GiB)
            out["g1_ratio_to_d2d"] = out["g1"]["ratio_to_d2d"]
        except Exception as e:  # e.g. IPC not permitted here: recorded, the rest still runs
            out["g1"] = {"error": f"{type(e).__name__}: {e}"}
        print("G1", out["g1"], flush=True)
        checkpoint()
    h2d = out.get("p1", {}).get("raw_h2d_gbps", 50.0) * 1e9
    if args.only in (None, "p2", "tier"):
        out["p2"] = p2(device, *p2_args, h2d_bps=h2d, decode_steps=16, gpu_tier=device.type == "cuda")
        out["p2_ratio_to_overlapped_limit"] = out["p2"]["ratio_to_overlapped_limit"]
        for k in ("g2_ttft_gpu_hit_s", "g2_ttft_cpu_hit_s", "g2_ttft_recompute_s"):
            if k in out["p2"]:
                out[k] = out["p2"][k]
        print("P2", out["p2"], flush=True)
        checkpoint()
    if args.only in (None, "devsum", "tier") and device.type == "cuda":
        out["devsum"] = devsum_figure(device, 64 * MiB if args.quick else 4 * GiB, 4 * MiB if args.quick else 32 * MiB)
        out["devsum_fused_speedup_over_torch_ops"] = out["devsum"]["fused_speedup_over_torch_ops"]
        print("DEVSUM", out["devsum"], flush=True)
        checkpoint()
    if args.only in (None, "vllm"):
        from bench.gpu_vllm import vllm_load

        out["vllm"] = vllm_load(device, 64 * MiB if args.quick else 2 * GiB, Timer(device),
                                **(dict(layers=2, heads=2, head_dim=32) if args.quick else {}))
        out["vllm_gpu_load_ratio_to_h2d"] = out["vllm"]["vllm_gpu_load_ratio_to_h2d"]
        print("VLLM", out["vllm"], flush=True)
        checkpoint()
    if args.only in (None, "p3"):
        out["p3"] = p3(device, shapes, lengths, 64 if not args.quick else 16, h2d, 1e-3, decode_steps=8)
        out["p3_min_speedup"] = min(r["speedup"] for r in out["p3"])
        out["p3_all_identical"] = all(r["greedy_identical"] for r in out["p3"])
        checkpoint()
    if args.only in (None, "fp32"):
        # up to 8 k: past that, fp32 attention with a cached prefix falls back to a kernel that materialises it
        out["correctness_fp32"] = correctness_fp32(device, "tiny" if args.quick else "llama-3.2-1b",
                                                   [n for n in lengths if n <= 8192], 64 if not args.quick else 16,
                                                   decode_steps=16)
    if args.only in (None, "bf16"):
        out["correctness_bf16"] = correctness_bf16(device, shapes, lengths, 64 if not args.quick else 16,
                                                   decode_steps=16)
        out["bf16_reuse_equals_split_everywhere"] = all(
            r["reuse_logits_equal_split"] and r["reuse_greedy_equal_split"] for r in out["correctness_bf16"])
        checkpoint()
    path = save(name, out)
    if os.environ.get("OUT"):
        import shutil

        shutil.copy(path, os.environ["OUT"])


if __name__ == "__main__":
    main()
