"""`kvmesh demo`: the main job. An embedded Redis and a local Ray cluster of N nodes on this machine, a KVNode on
each, and one worker per node running the same small random-weight Llama on the CPU. A few long documents ×
several questions are answered round-robin, so most prefixes were first computed on another node. The same
requests run once without kvmesh and once with it, in the same run, and the outputs are compared token for token.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh.client import KVMeshClient

MiB = 1 << 20


@dataclass
class DemoOptions:
    nodes: int = 3
    docs: int = 3
    questions: int = 4
    doc_tokens: int = 2048
    question_tokens: int = 32
    new_tokens: int = 16
    chunk_tokens: int = 256
    cpu_mib: int = 512
    hidden_size: int = 512
    layers: int = 8
    seed: int = 0
    threads: int = 2
    port: int = 0  # live page port (0: any free one)
    linger: int = 0  # keep the live page up this many seconds after the run


class DemoWorker:
    """One inference process, pinned to one Ray node."""

    def __init__(self, opts: dict) -> None:
        import torch

        from kvmesh.integrations.hf import spec_for_model, tiny_llama

        self.opts = DemoOptions(**opts)
        torch.set_num_threads(self.opts.threads)
        o = self.opts
        self.model = tiny_llama(
            o.seed,
            hidden_size=o.hidden_size,
            num_layers=o.layers,
            intermediate_size=o.hidden_size * 11 // 4,
            max_position_embeddings=16384,
        )
        self.spec = spec_for_model(self.model, chunk_tokens=o.chunk_tokens)
        self.client: KVMeshClient | None = None  # set by connect()

    def connect(self) -> str | None:
        import kvmesh

        self.client = kvmesh.connect(self.spec)
        return self.client.node_id

    def run(self, prompt: list[int], use_kvmesh: bool) -> dict:
        from kvmesh.integrations.hf import generate

        r = generate(self.model, prompt, self.opts.new_tokens, client=self.client if use_kvmesh else None)
        if use_kvmesh:
            assert self.client is not None, "connect() first"
            self.client.flush()  # make the demo deterministic: the next request sees this one's chunks
        return {k: v for k, v in asdict(r).items() if k != "first_logits"}


def make_requests(o: DemoOptions) -> list[tuple[int, int, list[int]]]:
    """(doc, question, prompt tokens), ordered question-major so each document moves from node to node."""
    import numpy as np

    rng = np.random.default_rng(o.seed + 1)
    docs = [rng.integers(0, 4096, o.doc_tokens).tolist() for _ in range(o.docs)]
    qs = [[rng.integers(0, 4096, o.question_tokens).tolist() for _ in range(o.questions)] for _ in range(o.docs)]
    return [(d, q, docs[d] + qs[d][q]) for q in range(o.questions) for d in range(o.docs)]


def run_demo(o: DemoOptions, out=print) -> dict:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import kvmesh
    from kvmesh.integrations.hf import spec_for_model, tiny_llama  # kvmesh[hf]: fails here, before anything starts
    from kvmesh.local import LocalRayCluster, RedisServer

    t_start = time.perf_counter()
    redis_server = RedisServer()  # kvmesh[local]'s redis-server
    cluster = dashboard = None
    try:
        out(f"starting: redis-server on {redis_server.url}, a {o.nodes}-node local Ray cluster ...")
        cluster = LocalRayCluster(o.nodes, num_cpus=1)
        spec = spec_for_model(
            tiny_llama(
                o.seed, hidden_size=o.hidden_size, num_layers=o.layers, intermediate_size=o.hidden_size * 11 // 4
            ),
            chunk_tokens=o.chunk_tokens,
        )
        mesh = kvmesh.start(redis_server.url, cpu_bytes=o.cpu_mib * MiB, slot_bytes=spec.chunk_bytes)
        out(
            f"kvmesh: {len(mesh.nodes)} KVNodes, {o.cpu_mib} MiB CPU tier each; model {spec.model_id}, "
            f"{spec.chunk_bytes / MiB:.1f} MiB per {spec.chunk_tokens}-token chunk"
        )
        from kvmesh.dashboard import Dashboard

        dashboard = Dashboard(redis_server.url, port=o.port).start()
        out(f"live page: {dashboard.url}")
        worker_cls = ray.remote(DemoWorker)
        workers = [
            worker_cls.options(num_cpus=1, scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(
                asdict(o)
            )
            for n in mesh.node_ids
        ]
        ray.get([w.connect.remote() for w in workers])
        requests = make_requests(o)
        # warm up every worker (first-call allocations), outside the measurement and outside kvmesh
        ray.get([w.run.remote(requests[0][2][:64], False) for w in workers])

        def serve(use_kvmesh: bool) -> tuple[list[dict], float]:
            t0 = time.perf_counter()
            res = []
            for d, q, prompt in requests:  # document d's q-th question goes to worker d + q: a new node each time
                res.append(ray.get(workers[(d + q) % len(workers)].run.remote(prompt, use_kvmesh)))
            return res, time.perf_counter() - t0

        base, base_s = serve(False)
        out(f"baseline (no kvmesh): {len(requests)} requests in {base_s:.2f} s")
        mesh_res, mesh_s = serve(True)
        out(f"with kvmesh:          {len(requests)} requests in {mesh_s:.2f} s")
        identical = all(a["tokens"] == b["tokens"] for a, b in zip(base, mesh_res))
        summary = {
            "requests": len(requests),
            "prompt_tokens": sum(r["prompt_tokens"] for r in mesh_res),
            "reused_tokens": sum(r["reused_tokens"] for r in mesh_res),
            "reused_local_tokens": sum(r["reused_local_tokens"] for r in mesh_res),
            "reused_peer_tokens": sum(r["reused_peer_tokens"] for r in mesh_res),
            "recomputed_tokens": sum(r["computed_tokens"] for r in mesh_res),
            "baseline_s": base_s,
            "kvmesh_s": mesh_s,
            "speedup": base_s / mesh_s,
            "baseline_ttft_s": sum(r["ttft_s"] for r in base) / len(base),
            "kvmesh_ttft_s": sum(r["ttft_s"] for r in mesh_res) / len(mesh_res),
            "outputs_identical": identical,
            "options": asdict(o),
        }
        out(format_table(summary))
        summary["wall_s"] = time.perf_counter() - t_start
        if o.linger:
            out(f"the live page stays up for {o.linger} s (Enter ends it): {dashboard.url}")
            _linger(o.linger)
        return summary
    finally:
        if dashboard is not None:
            dashboard.stop()
        try:
            if cluster is not None:
                kvmesh.stop()
        finally:
            if cluster is not None:
                cluster.shutdown()
            redis_server.stop()


def _linger(seconds: float) -> None:
    """Sleep `seconds`, or until a line arrives on stdin (an end of input, as from /dev/null, does not count)."""
    done = threading.Event()

    def wait_for_enter() -> None:
        try:
            if sys.stdin is not None and sys.stdin.readline():
                done.set()
        except (OSError, ValueError):
            pass

    threading.Thread(target=wait_for_enter, daemon=True).start()
    done.wait(seconds)


def format_table(s: dict) -> str:
    rows = [
        ("requests", f"{s['requests']}"),
        ("prompt tokens", f"{s['prompt_tokens']}"),
        ("prefix tokens reused", f"{s['reused_tokens']} ({100 * s['reused_tokens'] / s['prompt_tokens']:.1f} %)"),
        ("  from this node", f"{s['reused_local_tokens']}"),
        ("  from a peer node", f"{s['reused_peer_tokens']}"),
        ("tokens recomputed", f"{s['recomputed_tokens']}"),
        ("wall time without kvmesh", f"{s['baseline_s']:.2f} s"),
        ("wall time with kvmesh", f"{s['kvmesh_s']:.2f} s  ({s['speedup']:.2f}x)"),
        ("mean time to first token", f"{s['baseline_ttft_s'] * 1000:.0f} ms -> {s['kvmesh_ttft_s'] * 1000:.0f} ms"),
        ("output check", "identical" if s["outputs_identical"] else "DIFFERENT"),
    ]
    w = max(len(k) for k, _ in rows)
    line = "+" + "-" * (w + 2) + "+" + "-" * 34 + "+"
    body = [f"| {k:<{w}} | {v:<32} |" for k, v in rows]
    return "\n".join([line, *body, line])


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoOptions()
    p.add_argument("--nodes", type=int, default=d.nodes, help="Ray nodes (raylets) to start on this machine")
    p.add_argument("--docs", type=int, default=d.docs, help="long documents (shared prefixes)")
    p.add_argument("--questions", type=int, default=d.questions, help="questions per document")
    p.add_argument("--doc-tokens", type=int, default=d.doc_tokens, help="tokens per document")
    p.add_argument("--question-tokens", type=int, default=d.question_tokens, help="tokens per question")
    p.add_argument("--new-tokens", type=int, default=d.new_tokens, help="tokens generated per request")
    p.add_argument("--chunk-tokens", type=int, default=d.chunk_tokens, help="tokens per kvmesh chunk")
    p.add_argument("--cpu-mib", type=int, default=d.cpu_mib, help="CPU tier per node, MiB")
    p.add_argument("--hidden-size", type=int, default=d.hidden_size, help="model hidden size")
    p.add_argument("--layers", type=int, default=d.layers, help="model layers")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per worker")
    p.add_argument("--port", type=int, default=d.port, help="port of the live page (default: any free one)")
    p.add_argument(
        "--linger",
        type=int,
        default=d.linger,
        help="keep the live page up this many seconds after the run (Enter ends it)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON here")


def main(args: argparse.Namespace) -> int:
    opts = DemoOptions(**{k: getattr(args, k) for k in asdict(DemoOptions())})
    for k, v in asdict(opts).items():
        if v <= 0 and k not in ("seed", "port", "linger"):
            print(f"kvmesh demo: --{k.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    summary = run_demo(opts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["outputs_identical"] else 1
