"""Disk tier benchmark (not run in CI). Each figure is a ratio to a baseline measured in the same run:

  D1  disk-tier store (write_chunk, commit record included) vs raw sequential `dd oflag=direct` writes of the same
      bytes on the same file system; and fetch (the tier's read path, `read_verified`: reads on the tier's reader
      threads, each chunk checksummed as it lands in its own slot) vs `dd iflag=direct` reads, alternately, the
      median of the per-pair ratios (top-level `d1_fetch_over_dd`).                                  goal >= 0.8
  D2  fetching a cached prefix of the demo model from disk vs recomputing it on this CPU, over prefix lengths,
      with the crossover: where loading from disk pays and where the cost model must recompute.

Run: .venv/bin/python bench/disk.py [--dir /path/on/the/disk] [--mib 512]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench.common import plot_speedup, save  # noqa: E402
from kvmesh.tiers import checksum  # noqa: E402
from kvmesh.tiers.cpu import CpuTier  # noqa: E402
from kvmesh.tiers.disk import READ_OK, ChunkRead, DiskTier, aligned_buffer  # noqa: E402

MiB = 1 << 20


def dd(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.perf_counter() - t0


def d1(directory: str, total: int, chunk: int, repeat: int) -> dict:
    n = total // chunk
    raw = os.path.join(directory, "raw.bin")
    # the same work as the tier's stores: overwrite a file whose blocks exist already (the tier's slab is
    # preallocated), so the first, allocating write is not timed and later ones do not truncate
    dd(["if=/dev/zero", f"of={raw}", f"bs={chunk}", f"count={n}", "oflag=direct", "conv=fsync"])
    w = min(dd(["if=/dev/zero", f"of={raw}", f"bs={chunk}", f"count={n}", "oflag=direct", "conv=fsync,notrunc"])
            for _ in range(repeat))
    tier = DiskTier(os.path.join(directory, "tier"), n, chunk)
    bufs = [aligned_buffer(chunk) for _ in range(4)]
    for i, b in enumerate(bufs):
        b[:] = np.random.default_rng(i).integers(0, 255, chunk, dtype=np.uint8).tobytes()
    sums = [checksum(b) for b in bufs]
    slots = []
    for i in range(n):
        t = tier.prepare_store(i.to_bytes(16, "little"), b"g" * 16, chunk)
        tier.complete_store(t, sums[i % 4])
        slots.append(t.slot)
    for i, s in enumerate(slots):  # allocate the slab's blocks first, as dd's file was (untimed)
        tier.write_chunk(s, bufs[i % 4], chunk, i.to_bytes(16, "little"), b"g" * 16, sums[i % 4])
    os.fsync(tier._fd)

    def store():
        for i, s in enumerate(slots):
            tier.write_chunk(s, bufs[i % 4], chunk, i.to_bytes(16, "little"), b"g" * 16, sums[i % 4])
        os.fsync(tier._fd)

    # each chunk lands in its own slot of a CPU tier's shared-memory slab, as in a KVNode
    cpu = CpuTier(os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else directory,
                               f"kvmesh-disk-bench-{os.getpid()}"), n, chunk)
    reads = [ChunkRead(s, chunk, sums[i % 4], cpu.buffer(i)) for i, s in enumerate(slots)]
    into = aligned_buffer(chunk)

    def fetch():  # the node's path (Cascade.run_reads)
        assert tier.read_verified(reads) == [READ_OK] * n

    def fetch_inline():  # the node's path before: read_chunk into the slot, then its checksum, one after another
        for i, r in enumerate(reads):
            assert checksum(tier.read_chunk(r.slot, chunk, into=r.into)) == sums[i % 4]

    def fetch_inline_one_buffer():  # what this bench timed before: the same, every chunk into one buffer
        for i, s in enumerate(slots):
            assert checksum(tier.read_chunk(s, chunk, into=into)) == sums[i % 4]
    ws = min(_timed(store) for _ in range(repeat))
    # dd, the fetch and the inline fetch alternately: the ratio of each round's neighbours cancels the load of a
    # shared machine drifting between them
    fetch()
    raw_s, fetch_s, inline_s, one_s = [], [], [], []
    for _ in range(max(5, 3 * repeat)):
        raw_s.append(dd([f"if={raw}", "of=/dev/null", f"bs={chunk}", "iflag=direct"]))
        fetch_s.append(_timed(fetch))
        inline_s.append(_timed(fetch_inline))
        one_s.append(_timed(fetch_inline_one_buffer))
    os.unlink(raw)
    r, rs = min(raw_s), min(fetch_s)
    direct = tier.direct_io
    tier.close()
    reads.clear()  # (the slots' views, before the slab is unmapped)
    cpu.close()
    return {"bytes": n * chunk, "chunk_bytes": chunk, "direct_io": direct,
            "raw_write_gbps": n * chunk / w / 1e9, "raw_read_gbps": n * chunk / r / 1e9,
            "store_gbps": n * chunk / ws / 1e9, "fetch_gbps": n * chunk / rs / 1e9,
            "ratio_store": w / ws, "ratio_fetch": r / rs, "goal": ">= 0.8",
            "fetch_over_dd_paired": statistics.median(a / b for a, b in zip(raw_s, fetch_s)),
            "fetch_inline_over_dd_paired": statistics.median(a / b for a, b in zip(raw_s, inline_s)),
            "fetch_inline_gbps": n * chunk / min(inline_s) / 1e9,
            "fetch_inline_one_buffer_over_dd_paired": statistics.median(a / b for a, b in zip(raw_s, one_s)),
            "raw_read_ms": [round(x * 1e3, 1) for x in raw_s], "fetch_ms": [round(x * 1e3, 1) for x in fetch_s],
            "fetch_inline_ms": [round(x * 1e3, 1) for x in inline_s],
            "fetch_inline_one_buffer_ms": [round(x * 1e3, 1) for x in one_s],
            "note": "fetch: DiskTier.read_verified (the node's read path), each chunk into its own slot of a "
                    "CPU tier slab (/dev/shm); "
                    "fetch_inline: the node's path before (read_chunk into the slot, then checksum, serially); "
                    "fetch_inline_one_buffer: what D1 timed before (the same into one reused buffer: no slot's "
                    "pages to fill, like dd's); ratio_*: best times; "
                    "*_paired: median of the ratios of alternate runs (the headline)"}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def d2(directory: str, lengths: list[int], progress=None) -> list[dict]:
    """Demo model (hidden 512, 8 layers, fp32): disk fetch of a prefix's chunks vs its prefill on this CPU, and
    what kvmesh's cost model (fed with these disk reads and prefills, as a client would be) plans for each."""
    import torch

    from kvmesh.cost import CostModel
    from kvmesh.integrations.hf import _forward, _new_cache, spec_for_model, tiny_llama

    torch.set_num_threads(os.cpu_count() or 1)
    model = tiny_llama(0, hidden_size=512, num_layers=8, intermediate_size=512 * 11 // 4,
                       max_position_embeddings=16384)
    spec = spec_for_model(model, chunk_tokens=256)
    n_max = max(lengths) // 256
    tier = DiskTier(os.path.join(directory, "d2"), n_max, spec.chunk_bytes)
    buf = aligned_buffer(spec.chunk_bytes)
    buf[:] = np.random.default_rng(0).integers(0, 255, spec.chunk_bytes, dtype=np.uint8).tobytes()
    csum = checksum(buf)
    slots = []
    for i in range(n_max):
        t = tier.prepare_store(i.to_bytes(16, "little"), b"g" * 16, spec.chunk_bytes)
        tier.write_chunk(t.slot, buf, spec.chunk_bytes, i.to_bytes(16, "little"), b"g" * 16, csum)
        tier.complete_store(t, csum)
        slots.append(t.slot)
    os.fsync(tier._fd)
    dests = [aligned_buffer(spec.chunk_bytes) for _ in range(n_max)]  # as the CPU tier's slots would be
    rows = []
    cost = CostModel()
    ids = torch.randint(0, 4096, (1, max(lengths)))
    with torch.inference_mode():
        _forward(model, ids[:, :256], _new_cache(), logits_to_keep=1)  # warm up
        for n in lengths:
            k = n // 256
            t_fetch = min(_timed(lambda: [checksum(tier.read_chunk(slots[i], spec.chunk_bytes, into=dests[i]))
                                          for i in range(k)]) for _ in range(3))
            t_prefill = min(_timed(lambda: _forward(model, ids[:, :n], _new_cache(), logits_to_keep=1))
                            for _ in range(2 if n <= 4096 else 1))
            rows.append({"prefix_tokens": n, "kv_bytes": k * spec.chunk_bytes, "disk_fetch_s": t_fetch,
                         "recompute_s": t_prefill, "disk_speedup": t_prefill / t_fetch,
                         "disk_pays": t_fetch < t_prefill})
            cost.observe_transfer("local-disk", k * spec.chunk_bytes, t_fetch)
            cost.prefill.observe(n, 0, t_prefill)
            if progress:
                progress(rows[-1])
    for r in rows:  # the plans, with the model fitted on every point
        plan = cost.plan(r["prefix_tokens"], 256, spec.chunk_bytes, ["local-disk"] * (r["prefix_tokens"] // 256),
                         allow_split=False)
        r["cost_model_plan"] = plan.reason
    tier.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temp dir)")
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--only-d1", action="store_true", help="D1 alone (no demo model), saved")
    args = p.parse_args()
    from kvmesh._extras import require

    require("matplotlib", "bench", "bench/disk.py")  # its plot: fail now, not after the run
    tqdm = require("tqdm", "bench", "bench/disk.py").tqdm
    directory = tempfile.mkdtemp(prefix="kvmesh-disk-bench-", dir=args.dir)
    try:
        fs = subprocess.run(["df", "-T", directory], capture_output=True, text=True).stdout.splitlines()[-1]
        out = {"directory": directory, "filesystem": fs.split()[1], "load_average_before": os.getloadavg()}
        out["d1"] = d1(directory, args.mib * MiB, 4 * MiB, args.repeat)
        out["d1_fetch_over_dd"] = out["d1"]["fetch_over_dd_paired"]
        out["load_average_after_d1"] = os.getloadavg()
        print("D1", out["d1"], flush=True)
        if args.only_d1:
            save("disk", out)
            return
        lengths = [256, 512, 1024, 2048, 4096, 8192]
        bar = tqdm(total=len(lengths), desc="D2 prefix lengths", unit="len")
        out["d2"] = d2(directory, lengths, progress=lambda r: (bar.update(1), bar.set_postfix(
            disk=f"{r['disk_speedup']:.0f}x")))
        bar.close()
        pays = [r["prefix_tokens"] for r in out["d2"] if r["disk_pays"]]
        out["d2_crossover_tokens"] = min(pays) if pays else None
        out["d2_note"] = ("disk pays from the smallest prefix measured when every point pays; the cost model "
                          "recomputes where its fitted disk read exceeds its fitted prefill (cost_model_plan)")
        path = save("disk", out)
        png = path.with_suffix(".png")
        plot_speedup(out["d2"], "prefix_tokens", "disk_speedup", png,
                     "Prefix from the disk tier vs recompute (demo model, this CPU)")
        print(f"plot {png}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
