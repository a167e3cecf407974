"""vLLM with kvmesh on this CPU (not run in CI): time to first token and prefill tokens computed by engine B for
prompts whose prefix engine A, on another Ray node, served before, with kvmesh and without it, over prefix lengths.

    A        (node 1) vLLM + kvmesh: serves prefix + its own suffix; its prefix chunks go to node 1's CPU tier
    B plain  (node 0) vLLM without kvmesh: the baseline, recomputes prefix + another suffix
    B <mode> (node 0) vLLM + kvmesh (load_mode "async" or "sync"): the same prompt, its prefix pulled from node 1

Each row is the median over `--reps` fresh prefixes (vLLM's own prefix cache never hits); TTFT is the wall time of
`LLM.generate` for one request with max_tokens=1, measured inside the engine's process. Ratios are to the plain
engine of the same run. The first token of every kvmesh run is checked against the plain engine's.

Run: .venv-vllm/bin/python bench/vllm.py [--lengths 512,1024,2048,4096] [--reps 3] [--modes async,sync]
(vLLM cannot run on the project's GPU machine: no network there and the CUDA wheel is too big to carry.)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

# run as a script, this file's directory comes first on sys.path, where it would shadow the vllm package
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from bench.common import plot_speedup, save  # noqa: E402

MiB = 1 << 20
VOCAB, SUFFIX, CHUNK = 4096, 64, 256
MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=8192, initializer_range=0.1)
# KV per token: 8 layers x 2 x 4 heads x 128 x 2 bytes = 16 KiB; a 256-token chunk is 4 MiB (one slot)


class Engine:
    """A vLLM engine in this (Ray actor) process."""

    def __init__(self, model_dir: str, kvmesh: dict | None) -> None:
        from vllm import LLM

        kw = {}
        if kvmesh is not None:
            kw["kv_transfer_config"] = {"kv_connector": "KVMeshConnector", "kv_role": "kv_both",
                                        "kv_connector_module_path": "kvmesh.integrations.vllm",
                                        "kv_connector_extra_config": kvmesh}
        self.llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=8192,
                       enforce_eager=True, disable_log_stats=False, kv_cache_memory_bytes=160 * MiB, seed=0, **kw)

    def _sources(self) -> dict[str, int]:
        return {m.labels["source"]: int(m.value) for m in self.llm.get_metrics()
                if m.name == "vllm:prompt_tokens_by_source"}

    def timed(self, prompt: list[int]) -> dict:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
        before = self._sources()
        t0 = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        ttft = time.perf_counter() - t0
        after = self._sources()
        d = {k: v - before.get(k, 0) for k, v in after.items()}
        return {"ttft_s": ttft, "computed": d.get("local_compute", 0), "external": d.get("external_kv_transfer", 0),
                "first_token": out[0].outputs[0].token_ids[0]}

    def spec(self) -> bytes:
        return self.llm.llm_engine.engine_core.engine_core.scheduler.connector.spec.canonical_bytes()


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def run(lengths: list[int], reps: int, modes: list[str], work: str) -> dict:
    import ray
    import torch
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from transformers import LlamaConfig, LlamaForCausalLM

    import kvmesh
    from kvmesh.local import LocalRayCluster, RedisServer
    from kvmesh.spec import KVSpec

    model_dir = os.path.join(work, "bench-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL, tie_word_embeddings=False)).to(torch.bfloat16).save_pretrained(model_dir)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TMPDIR": work,
           "VLLM_CACHE_ROOT": os.path.join(work, "vllm"), "XDG_CACHE_HOME": os.path.join(work, "xdg"),
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(work, "inductor"), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "PYTHONPATH": os.path.dirname(_HERE),
           "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    redis = RedisServer()
    cluster = LocalRayCluster(2, num_cpus=1, object_store_bytes=256 * MiB)
    try:
        kvmesh.start(redis.url, cpu_bytes=512 * MiB, slot_bytes=4 * MiB, key_prefix="bench-vllm")
        head, other = cluster.node_ids()
        actor = ray.remote(Engine)

        def engine(node: str, cfg: dict | None):
            return actor.options(num_cpus=0, runtime_env={"env_vars": env},
                                 scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
                model_dir, cfg)

        a = engine(other, {})
        plain = engine(head, None)
        meshed = {m: engine(head, {"load_mode": m}) for m in modes}
        everyone = [a, plain, *meshed.values()]
        t0 = time.monotonic()
        ray.get([e.timed.remote(tokens(1, 300)) for e in everyone], timeout=1200)  # start-up and warm-up
        started = time.monotonic() - t0
        watcher = kvmesh.connect(KVSpec.from_canonical_bytes(ray.get(a.spec.remote())))
        rows = []
        for n in lengths:
            samples: dict[str, list[dict]] = {"plain": [], **{m: [] for m in modes}}
            for rep in range(reps):
                prefix = tokens(1000 * n + rep, n)
                ray.get(a.timed.remote(prefix + tokens(7, SUFFIX)))
                deadline = time.monotonic() + 60
                while watcher.lookup(prefix).num_chunks < n // CHUNK and time.monotonic() < deadline:
                    time.sleep(0.05)
                for name, e in [("plain", plain), *meshed.items()]:  # the same prompt, a suffix A did not see
                    samples[name].append(ray.get(e.timed.remote(prefix + tokens(8, SUFFIX))))
            row = {"prefix_tokens": n, "prompt_tokens": n + SUFFIX}
            base = statistics.median(s["ttft_s"] for s in samples["plain"])
            row["plain_ttft_s"] = base
            row["plain_computed_tokens"] = statistics.median(s["computed"] for s in samples["plain"])
            for m in modes:
                ttft = statistics.median(s["ttft_s"] for s in samples[m])
                row[f"{m}_ttft_s"] = ttft
                row[f"{m}_speedup"] = base / ttft
                row[f"{m}_computed_tokens"] = statistics.median(s["computed"] for s in samples[m])
                row[f"{m}_computed_ratio"] = row[f"{m}_computed_tokens"] / row["plain_computed_tokens"]
                row[f"{m}_external_tokens"] = statistics.median(s["external"] for s in samples[m])
                row[f"{m}_same_first_token"] = all(
                    s["first_token"] == p["first_token"] for s, p in zip(samples[m], samples["plain"]))
            rows.append(row)
            print(row, flush=True)
        watcher.close()
        kvmesh.stop()
        return {"engines_started_s": started, "rows": rows}
    finally:
        cluster.shutdown()
        redis.stop()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="512,1024,2048,4096")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--modes", default="async,sync")
    args = p.parse_args(argv)
    from kvmesh._extras import require

    require("matplotlib", "bench", "bench/vllm.py")  # its plot: fail now, not after the run
    lengths = [int(x) for x in args.lengths.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-vllm-") as work:
        result = run(lengths, args.reps, modes, work)
    import vllm

    path = save("vllm", {"vllm": vllm.__version__, "device": "cpu",
                         "model": {**MODEL, "dtype": "bfloat16", "chunk_tokens": CHUNK},
                         "setup": "A on node 1 stores; B (node 0) pulls from node 1 over kvmesh's TCP data path; "
                                  "plain B recomputes", "reps": args.reps, "suffix_tokens": SUFFIX,
                         "modes": modes, **result})
    rows = [{**r, "mode": m, "speedup": r[f"{m}_speedup"]} for r in result["rows"] for m in modes]
    png = path.with_suffix(".png")
    plot_speedup(rows, "prompt_tokens", "speedup", png, "vLLM TTFT speedup with a kvmesh peer hit (CPU)",
                 series="mode")
    print(f"plot {png}")


if __name__ == "__main__":
    main()
