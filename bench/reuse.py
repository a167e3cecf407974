"""Reuse benchmark on this machine (not run in CI): time to first token of the demo model with its prefix taken
from the CPU tier (layer-wise, through `kvmesh.integrations.hf.prefill_on_load`) vs recomputing it, over context
lengths. Prints JSON, saves it under bench/results/ with a PNG of speedup vs context length next to it.

Run: .venv/bin/python bench/reuse.py        or        kvmesh bench reuse
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import plot_speedup, save  # noqa: E402


def run(lengths: list[int], suffix: int = 32, progress=None) -> list[dict]:
    from kvmesh.integrations.hf import _forward, _layer_kv, _new_cache, prefill_on_load, spec_for_model, tiny_llama
    from bench.movers_paged import gather_contiguous, to_host
    from kvmesh.movers import to_device
    from kvmesh.tiers.cpu import CpuTier

    torch.set_num_threads(os.cpu_count() or 1)
    model = tiny_llama(0, hidden_size=512, num_layers=8, intermediate_size=512 * 11 // 4,
                       max_position_embeddings=16384)
    spec = spec_for_model(model, chunk_tokens=256)
    rows = []
    ids_all = torch.randint(0, 4096, (1, max(lengths) + suffix), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        _forward(model, ids_all[:, :256], _new_cache(), logits_to_keep=1)  # warm up
        for n in lengths:
            ids = torch.cat([ids_all[:, :n], ids_all[:, -suffix:]], dim=1)
            k = n // 256
            tier = CpuTier(os.path.join("/dev/shm", f"kvmesh-reuse-bench-{os.getpid()}-{n}"), k, spec.chunk_bytes)
            cache = _new_cache()
            _forward(model, ids[:, :n], cache, logits_to_keep=1)
            keys = [_layer_kv(cache, i)[0] for i in range(spec.num_layers)]
            values = [_layer_kv(cache, i)[1] for i in range(spec.num_layers)]
            tickets = [tier.prepare_store(os.urandom(16), b"g" * 16, spec.chunk_bytes) for _ in range(k)]
            to_host(gather_contiguous(keys, values, 0, k, 256), [tier.buffer(t.slot) for t in tickets])
            views = [tier.buffer(t.slot)[: spec.chunk_bytes] for t in tickets]

            def recompute():
                return _forward(model, ids, _new_cache(), logits_to_keep=1).logits[:, -1]

            def reuse():
                return prefill_on_load(model, ids[:, n:], to_device(views, spec, "cpu"), n)[0]
            t_rec = min(_timed(recompute) for _ in range(2))
            t_reuse = min(_timed(reuse) for _ in range(3))
            same = bool(recompute().argmax() == reuse().argmax())
            rows.append({"prompt_tokens": n + suffix, "prefix_tokens": n, "recompute_ttft_s": t_rec,
                         "reuse_ttft_s": t_reuse, "speedup": t_rec / t_reuse, "same_first_token": same})
            tier.close()
            if progress:
                progress(rows[-1])
    return rows


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="256,512,1024,2048,4096,8192")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    from kvmesh._extras import require

    require("matplotlib", "bench", "bench/reuse.py")  # its plot: fail now, not after the run
    bar = require("tqdm", "bench", "bench/reuse.py").tqdm(total=len(lengths), desc="context lengths", unit="len")
    rows = run(lengths, progress=lambda r: (bar.update(1), bar.set_postfix(speedup=f"{r['speedup']:.1f}x")))
    bar.close()
    path = save("reuse", {"model": "demo llama (hidden 512, 8 layers, fp32)", "rows": rows})
    png = path.with_suffix(".png")
    plot_speedup(rows, "prompt_tokens", "speedup", png, "TTFT speedup with a CPU-tier hit (this machine)")
    print(f"plot {png}")


if __name__ == "__main__":
    main()
