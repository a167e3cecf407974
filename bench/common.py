"""Shared by the benchmarks: machine description, result files, timing."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    info = {"hostname": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                                     "")
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def commit() -> str:
    """The git commit measured; `$KVMESH_COMMIT` where the copy has no .git (e.g. a lent GPU machine)."""
    if os.environ.get("KVMESH_COMMIT"):
        return os.environ["KVMESH_COMMIT"]
    if os.environ.get("KVMESH_BENCH_COMMIT"):  # a copy whose git metadata is not the tree's (the GPU machine's)
        return os.environ["KVMESH_BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def save(name: str, result: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": name, "commit": commit(), "machine": machine(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **result}
    path = RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(f"saved {path}")
    return path


def median_time(fn, repeat: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def plot_speedup(rows: list[dict], x: str, y: str, path, title: str, series: str | None = None) -> None:
    """A PNG of speedup (y) against context length (x), log-x, with the break-even line and the crossover where
    reuse starts to pay marked."""
    from kvmesh._extras import require

    matplotlib = require("matplotlib", "bench", "bench's plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    groups: dict = {}
    for r in rows:
        groups.setdefault(r.get(series, "") if series else "", []).append(r)
    for name, rs in groups.items():
        rs = sorted(rs, key=lambda r: r[x])
        xs, ys = [r[x] for r in rs], [r[y] for r in rs]
        ax.plot(xs, ys, marker="o", label=name or y)
        pays = [r[x] for r in rs if r[y] > 1.0]
        if pays:
            ax.axvline(min(pays), color="grey", linestyle=":", linewidth=1)
            ax.annotate(f"pays from {min(pays)}", (min(pays), 1.0), textcoords="offset points", xytext=(4, 8),
                        fontsize=8, color="grey")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("speedup vs recompute (x)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if series:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
