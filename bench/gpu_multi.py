"""Multi-GPU parts of bench/gpu.py (`--multi-gpu`, issue 20): one KVNode's GPU tier on GPU 0, read by a worker on
GPU 1 of the same host. The node is bench.gpu_node's stand-in process (a real GpuTier, its pool on cuda:0); this
process is the worker: it maps the pool through CUDA IPC and reads into cuda:1, peer to peer where the GPUs allow
(NVLink), else through page-locked host memory. No Ray, no NCCL.

  M1  a cross-GPU GPU-tier hit's bandwidth (slots of the node's pool on GPU 0 -> device buffers on GPU 1) as a
      ratio to a raw torch copy of the same bytes from a cuda:0 tensor to a cuda:1 tensor in this process:
      m1_ratio_to_p2p_copy = median raw copy time / median hit copy time, the two (and the host path, the verified
      reads) interleaved round by round. Goal >= 0.8. Beside it the same read forced through the host
      (`peer=False`), the reads with their device checksums verified, and a store GPU 1 -> the pool on GPU 0.
      Checks: bytes equal the node's own, device sums verified (and equal the reference checksum), a flipped byte
      fails verification on both paths, the stores land verified.
  M2  TTFT at the P2 point (Llama-3.1-8B shape, 32 k-token prefix + 64-token suffix) for a worker on GPU 1 whose
      prefix is held in the node's GPU tier on GPU 0 (bench.gpu's G2: stored there from GPU 1, loaded layer by layer
      into GPU 1 under the suffix prefill, device checksums verified), beside a CPU-tier hit and recompute on the
      same GPU 1. Checks: the GPU-tier hit's logits equal the CPU-tier hit's and the split recompute's bit for bit.

`--multi-gpu-same-device` runs every line of M1 and M2 with both "GPUs" being cuda:0 (a smoke run on a 1-GPU
machine): its figures are same-device copies, not M1/M2, and the JSON says so. With fewer than 2 GPUs (and no
smoke flag) the run writes {"multi_gpu": {"error": ...}} and exits 0.

NVLink multicast stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are
forced in this process's environment before CUDA starts (the node process inherits them), and the JSON lists the
kvmesh/bench sources that name a multicast-object call (none).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

MiB, GiB = 1 << 20, 1 << 30
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ROOT = Path(__file__).resolve().parent.parent


def force_multicast_off() -> dict:
    """Set the multicast-off variables to their values (whatever was there before); returns them as now set."""
    os.environ.update(MULTICAST_OFF)
    return {k: os.environ[k] for k in MULTICAST_OFF}


def multicast_callers() -> list[str]:
    """kvmesh and bench sources that name the driver's call creating a multicast object (the issue: nothing may
    call it). A static scan of our own code; torch's and NCCL's own use is kept off by the variables above."""
    needle = "cuMulticast" + "Create"  # (split, so that this file does not find itself)
    hits = []
    for base in ("kvmesh", "bench"):
        for path in sorted((ROOT / base).rglob("*.py")):
            if needle in path.read_text(errors="replace"):
                hits.append(str(path.relative_to(ROOT)))
    return hits


def _sync(*devices: torch.device) -> None:
    for d in devices:
        torch.cuda.synchronize(d)


def paired(fns: dict[str, Callable[[], object]], devices, repeat: int) -> dict[str, list[float]]:
    """Wall times of each fn over `repeat` rounds, every fn once per round in turn (drift hits all alike), after one
    warm-up call each; both GPUs are synchronized before and after every call (a cross-GPU copy runs on the source
    GPU's stream and ends on the destination's)."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for name, f in fns.items():
            _sync(*devices)
            t0 = time.perf_counter()
            f()
            _sync(*devices)
            times[name].append(time.perf_counter() - t0)
    return times


def peer_access(node_dev: torch.device, reader: torch.device) -> dict:
    """Whether each GPU may access the other's memory directly (what `gpu_ipc._can_peer` decides the path by)."""
    if node_dev == reader:
        return {"same_device": True, "reader_can_access_node": None, "node_can_access_reader": None}
    return {
        "same_device": False,
        "reader_can_access_node": torch.cuda.can_device_access_peer(reader.index, node_dev.index),
        "node_can_access_reader": torch.cuda.can_device_access_peer(node_dev.index, reader.index),
    }


def topology() -> str | None:
    """`nvidia-smi topo -m` (NV# between the two GPUs: NVLink), where nvidia-smi is there."""
    try:
        text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return re.sub(r"\x1b\[[0-9;]*m", "", text)  # (its header is underlined with terminal escapes)


def device_tag(index: int = 0) -> str:
    """'h100', 'h200', ... from the device name (for result file names)."""
    m = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", torch.cuda.get_device_name(index))
    return m.group(1).lower() if m else "gpu"


# -- M1 ------------------------------------------------------------------------------------------------------------
def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def _read_checks(node, mapper_views, slots, sums, dsts, peer) -> dict:
    """One read of the slots into `dsts` by `read_chunks(peer=...)`: its path, its device sums verified, the first
    and last chunk equal to the node's own bytes, and their device sums equal to the reference checksum."""
    from kvmesh.tiers.devsum import device_checksum, reference_checksum
    from kvmesh.tiers.gpu_ipc import read_chunks

    for d in (dsts[0], dsts[-1]):
        d.zero_()
    r = read_chunks(mapper_views, dsts, sums, peer=peer)
    verified = r.verified()
    r.wait()
    equal, ref = True, True
    for i in (0, len(slots) - 1):
        host = node.chunk(slots[i])
        equal &= dsts[i].cpu().numpy().tobytes() == host
        ref &= int(device_checksum(dsts[i])) == reference_checksum(host)
    return {"path": r.path, "verified": verified, "bit_exact": bool(equal), "device_sum_is_reference": bool(ref)}


def _corrupt_detected(node, srcs, slots, sums, dsts) -> dict:
    """Flip a byte of the second chunk in the node's pool: both paths must fail it (good prefix 1), then flip it
    back and the node's own verification must pass again."""
    from kvmesh.tiers.gpu_ipc import read_chunks

    k = min(3, len(slots))
    node.corrupt(slots[1], 4097)
    try:
        out = {}
        for name, peer in (("peer", None), ("host", False)):
            r = read_chunks(srcs[:k], dsts[:k], sums[:k], peer=peer)
            out[name] = (not r.verified()) and r.good_prefix() == 1
    finally:
        node.corrupt(slots[1], 4097)
    return {
        "corrupt_byte_detected": all(out.values()),
        **{f"detected_{p}": v for p, v in out.items()},
        "restored_verified": all(node.verify(slots[:k])),
    }


def m1(
    node_dev: torch.device, reader: torch.device, total_bytes: int, slot_bytes: int = 32 * MiB, repeat: int = 9
) -> dict:
    """M1 (see the module docstring): the node process's pool on `node_dev`, read into `reader` in this process."""
    from bench.gpu_node import GpuNodeProcess
    from bench.gpu_tier import _views
    from kvmesh.tiers import gpu_ipc
    from kvmesh.tiers.gpu_ipc import PoolMapper, read_chunks, write_chunks

    n = max(3, total_bytes // slot_bytes)
    nbytes = n * slot_bytes
    node = GpuNodeProcess(2 * n, slot_bytes, device=str(node_dev))
    mapper = PoolMapper()
    try:
        placed = node.store_random(n, seed=21)
        slots, sums = [s for s, _ in placed], [v for _, v in placed]
        exports = node.exports()
        srcs = _views(mapper, exports, slots, slot_bytes)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=reader)
        dsts = [dst[i * slot_bytes : (i + 1) * slot_bytes] for i in range(n)]
        local = torch.empty(nbytes, dtype=torch.uint8, device=node_dev)  # the raw copy's source: same bytes count
        devices = (node_dev, reader)
        times = paired(
            {
                "raw_copy": lambda: dst.copy_(local, non_blocking=True),
                "hit": lambda: gpu_ipc._copy_all(srcs, dsts, None, None),  # what a hit's data path queues
                "hit_verified": lambda: read_chunks(srcs, dsts, sums).verified(),
                "host": lambda: gpu_ipc._copy_all(srcs, dsts, False, None),
                "host_verified": lambda: read_chunks(srcs, dsts, sums, peer=False).verified(),
            },
            devices,
            repeat,
        )
        med = {k: statistics.median(v) for k, v in times.items()}
        low = {k: min(v) for k, v in times.items()}
        checks = {
            "read_peer_default": _read_checks(node, srcs, slots, sums, dsts, None),
            "read_host": _read_checks(node, srcs, slots, sums, dsts, False),
            **_corrupt_detected(node, srcs, slots, sums, dsts),
        }
        # a store from the worker's GPU into reserved slots of the node's pool, with the device sums of what landed
        wslots = node.reserve(n)
        wviews = _views(mapper, exports, wslots, slot_bytes)
        store = paired({"store": lambda: write_chunks(dsts, wviews).sums()}, devices, max(3, repeat // 3))["store"]
        w = write_chunks(dsts, wviews)
        checks["store_path"] = w.path
        checks["stores_verified"] = all(node.complete_device(wslots, w.sums()))
        node.check_integrity()
        return {
            "node_pool_device": str(srcs[0].device),
            "reader_device": str(reader),
            "bytes": nbytes,
            "chunks": n,
            "slot_bytes": slot_bytes,
            "repeat": repeat,
            "path": checks["read_peer_default"]["path"],
            **{f"{k}_gbps": _gbps(nbytes, v) for k, v in times.items()},
            **{f"{k}_median_s": v for k, v in med.items()},
            "ratio_to_p2p_copy": med["raw_copy"] / med["hit"],
            "ratio_to_p2p_copy_of_best_times": low["raw_copy"] / low["hit"],
            "ratio_verified_to_p2p_copy": med["raw_copy"] / med["hit_verified"],
            "host_path_ratio_to_p2p_copy": med["raw_copy"] / med["host"],
            "host_path_verified_ratio_to_p2p_copy": med["raw_copy"] / med["host_verified"],
            "store_with_sums_gbps": _gbps(nbytes, store),
            "checks": checks,
            "goal": "ratio_to_p2p_copy >= 0.8",
        }
    finally:
        mapper.close()
        node.close()


def m1_ok(r: dict) -> bool:
    c = r["checks"]
    reads = [c["read_peer_default"], c["read_host"]]
    return (
        all(x["verified"] and x["bit_exact"] and x["device_sum_is_reference"] for x in reads)
        and c["read_host"]["path"] == "host"
        and c["corrupt_byte_detected"]
        and c["restored_verified"]
        and c["stores_verified"]
    )


# -- M2 ------------------------------------------------------------------------------------------------------------
def m2(reader: torch.device, shape: str, prompt_tokens: int, suffix_tokens: int) -> dict:
    """M2 (see the module docstring): the model on `reader`; the GPU-tier hit is bench.gpu's G2 (its node process
    holds its pool on cuda:0, the default device of a fresh process)."""
    from bench import gpu as bg
    from kvmesh.tiers import checksum

    model = bg.make_model(shape, reader, torch.bfloat16)
    r = bg.Runner(model, reader)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_tokens + suffix_tokens), generator=g).to(reader)
    chunks = prompt_tokens // r.spec.chunk_tokens
    tier = bg.make_tier((chunks + 1) * r.spec.chunk_bytes, r.spec.chunk_bytes)
    try:
        views, sums = r.stash_prefix(ids, prompt_tokens, tier)
        t_rec = r.timer(lambda: r.recompute(ids), repeat=3)
        t_cpu = r.timer(lambda: r.reuse(ids, views), repeat=3)
        g2 = bg._g2(r, ids, prompt_tokens, views, t_rec, t_cpu)
        return {
            "shape": shape,
            "prompt_tokens": prompt_tokens,
            "suffix_tokens": suffix_tokens,
            "reader_device": str(reader),
            "kv_bytes": chunks * r.spec.chunk_bytes,
            "ttft_s": {
                "gpu_tier_cross_gpu_hit": g2["g2_ttft_gpu_hit_s"],
                "cpu_tier_hit": t_cpu,
                "recompute": t_rec,
                "gpu_tier_cross_gpu_hit_unverified": g2["g2_ttft_gpu_hit_unverified_s"],
            },
            "speedup_gpu_tier_hit": t_rec / g2["g2_ttft_gpu_hit_s"],
            "speedup_cpu_tier_hit": t_rec / t_cpu,
            "timing": "min of 3 after a warm-up (as P2/G2)",
            "cpu_tier_unchanged": [checksum(v) for v in views] == sums,
            **{k.removeprefix("g2_"): v for k, v in g2.items() if not k.startswith("g2_ttft")},
        }
    finally:
        tier.close()
        del model
        torch.cuda.empty_cache()


def m2_ok(r: dict) -> bool:
    keys = ("gpu_hit_stored_verified", "logits_equal_cpu_hit", "logits_equal_split_recompute", "cpu_tier_unchanged")
    return all(r.get(k) is True for k in keys) and r.get("gpu_tier_device") == "cuda:0"


# -- the run -------------------------------------------------------------------------------------------------------
def _part(name: str, fn: Callable[[], dict]) -> dict:
    """Run one part; an exception is recorded in its place (the other part still runs) and printed."""
    try:
        out = fn()
    except Exception as e:
        traceback.print_exc()
        out = {"error": f"{type(e).__name__}: {e}"}
    print(name, out, flush=True)
    return out


def _write(name: str, out: dict) -> None:
    from bench.common import save

    path = save(name, out)
    if os.environ.get("OUT"):
        import shutil

        shutil.copy(path, os.environ["OUT"])


def run(quick: bool, same_device: bool) -> int:
    """The whole `--multi-gpu` run; returns the exit status (1 only when a part raised)."""
    out: dict = {"multicast_off_env": force_multicast_off(), "multicast_create_callers": multicast_callers()}
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < (1 if same_device else 2):
        out["multi_gpu"] = {"error": f"needs >= {1 if same_device else 2} CUDA devices, found {count}"}
        _write("gpu-multi" + ("-smoke" if same_device else ""), out)
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    node_dev = torch.device("cuda", 0)
    reader = torch.device("cuda", 0 if same_device else 1)
    info: dict = {
        "smoke_same_device": same_device,
        "node_device": str(node_dev),
        "reader_device": str(reader),
        "devices": [torch.cuda.get_device_name(i) for i in range(count)],
        "peer_access": peer_access(node_dev, reader),
        "topology": topology(),
    }
    m1_kw = dict(total_bytes=64 * MiB, slot_bytes=4 * MiB) if quick else dict(total_bytes=4 * GiB)
    m2_args = ("tiny", 1024, 16) if quick else ("llama-3.1-8b", 32768, 64)
    with torch.cuda.device(reader):  # as an engine worker on that GPU runs
        info["m1"] = _part("M1", lambda: m1(node_dev, reader, **m1_kw))
        info["m2"] = _part("M2", lambda: m2(reader, *m2_args))
    errors = [k for k in ("m1", "m2") if "error" in info[k]]
    ok = not errors and m1_ok(info["m1"]) and m2_ok(info["m2"])
    out["multi_gpu"] = info
    if same_device:
        out["smoke_same_device"] = True
        out["note"] = (
            "smoke run: node pool and reader are both cuda:0, so every line of M1/M2 ran but the copies "
            "are same-device (path d2d): these are not M1/M2 figures"
        )
        out["smoke_all_checks_pass"] = ok
    else:
        out["all_checks_pass"] = ok
        if "error" not in info["m1"]:
            out["m1_ratio_to_p2p_copy"] = info["m1"]["ratio_to_p2p_copy"]
            out["m1_host_path_ratio_to_p2p_copy"] = info["m1"]["host_path_ratio_to_p2p_copy"]
            out["m1_path"] = info["m1"]["path"]
        if "error" not in info["m2"]:
            out["m2_ttft_s"] = info["m2"]["ttft_s"]
    name = "gpu-multi" + ("-smoke" if same_device else "") + ("-quick" if quick else "") + f"-{device_tag()}"
    _write(name, out)
    return 1 if errors else 0
