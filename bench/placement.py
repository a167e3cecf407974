"""Placement benchmark (issue 19, item 5; not run in CI): one request trace through a Ray Serve deployment of 3 HF
replicas (the demo's random-weight Llama, one replica per node of a local 3-node cluster), under three routers:

    kvmesh           kvmesh.integrations.serve: lowest expected TTFT (client.route), bounded load (eps)
    round_robin      each request to the next replica
    prefix_affinity  rendezvous (consistent) hashing of the prompt's first chunk, the next replica on the ring when
                     one is at Serve's max_ongoing_requests: a faithful rendering of a prefix-affinity router (Ray
                     Serve's own PrefixCacheAffinityRouter needs text prompts and ray[llm])

kvmesh pulls are on for all three (every replica is a kvmesh worker: a miss on its node is pulled from a peer
where the cost model says so); each policy gets its own tenant salt, so none starts with another's cache.

The trace (same seed for every policy): `requests` questions about `docs` documents (1-4k tokens) of Zipf
popularity, 4 questions each, plus multi-turn sessions (a 1k-token system prompt) whose prompt grows each turn
(the previous turn, a fixed "answer", the next question), Poisson arrivals at `rate` requests/s. TTFT is
measured from the driver's send to the replica's first token (queueing included).
Reports TTFT p50/p90, prompt tokens prefilled, bytes pulled between nodes, and whether every request's output
tokens are identical under the three routers. Top-level keys: p90_ttft_vs_round_robin,
p90_ttft_vs_prefix_affinity, outputs_identical.

Run: .venv/bin/python bench/placement.py [--rate 2.5 --docs 30 --requests 300 --sessions 6 --turns 4]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1

import numpy as np  # noqa: E402

from bench.common import save  # noqa: E402

CHUNK = 64
MODEL = dict(hidden_size=256, num_layers=4)
POLICIES = ("kvmesh", "round_robin", "prefix_affinity")


# -- routers (module-level classes: Serve imports a router class by its module path) -------------------------------
from ray.serve.request_router import RequestRouter  # noqa: E402

from kvmesh.integrations.serve import request_tokens  # noqa: E402


class RoundRobinRouter(RequestRouter):
    def initialize_state(self, **_) -> None:
        self._next = itertools.count()

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        reps = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        i = next(self._next) % len(reps) if reps else 0
        return [[r] for r in reps[i:] + reps[:i]]


class PrefixAffinityRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas, pending_request=None):
        toks = request_tokens(pending_request) if pending_request is not None else None
        key = np.asarray(toks[:CHUNK] if toks is not None else [], dtype="<u4").tobytes()

        def score(r) -> bytes:  # rendezvous hashing: the replica order is a pure function of the first chunk
            return hashlib.blake2b(key + r.replica_id.unique_id.encode(), digest_size=8).digest()
        return [[r] for r in sorted(candidate_replicas, key=score, reverse=True)]


# -- the replica -----------------------------------------------------------------------------------------------------
def _deployment():
    from ray import serve

    @serve.deployment(num_replicas=3, max_replicas_per_node=1, max_ongoing_requests=16,
                      ray_actor_options={"num_cpus": 0.5})
    class Generator:
        def __init__(self, salt: str, new_tokens: int, threads: int) -> None:
            import torch

            import kvmesh
            from kvmesh.integrations.hf import spec_for_model, tiny_llama
            from kvmesh.integrations.serve import LoadReporter

            torch.set_num_threads(threads)
            self.model = tiny_llama(0, **MODEL)
            self.client = kvmesh.connect(spec_for_model(self.model, chunk_tokens=CHUNK), cache_salt=salt)
            self.load = LoadReporter(self.client)
            self.lock = threading.Lock()
            self.new_tokens = new_tokens

        def __call__(self, tokens: list[int]) -> dict:
            from kvmesh.integrations.hf import generate

            with self.load.request(tokens) as r, self.lock:  # (counts what this node would compute of it)
                start = time.time()
                out = generate(self.model, tokens, self.new_tokens, client=self.client)
                r.prefilled()
            self.client.flush()
            return {"start": start, "ttft_s": out.ttft_s, "tokens": out.tokens, "node": self.client.node_id,
                    "computed": out.computed_tokens, "reused_local": out.reused_local_tokens,
                    "reused_peer": out.reused_peer_tokens}

    return Generator


# -- the trace -------------------------------------------------------------------------------------------------------
def make_trace(seed: int, docs: int, requests: int, sessions: int, turns: int, rate: float,
               min_chunks: int = 16, max_chunks: int = 64) -> list[tuple[float, list[int]]]:
    """(arrival time s, prompt tokens), sorted by arrival. `requests` document questions: the document drawn by
    Zipf popularity (s = 1.1) over `docs` documents of `min_chunks`..`max_chunks` chunks, the question one of its
    4; then `sessions` sessions of `turns` turns spliced in, 4 requests apart."""
    rng = np.random.default_rng(seed)
    vocab = 4096
    doc_toks = [rng.integers(1, vocab, int(rng.integers(min_chunks, max_chunks + 1)) * CHUNK).tolist()
                for _ in range(docs)]
    questions = [[rng.integers(1, vocab, 24).tolist() for _ in range(4)] for _ in range(docs)]
    pop = 1.0 / np.arange(1, docs + 1) ** 1.1  # Zipf popularity
    pop /= pop.sum()
    items = [doc_toks[d] + questions[d][int(rng.integers(4))] for d in rng.choice(docs, size=requests, p=pop)]
    # sessions: a system prompt, then each turn adds the previous answer and a new question
    for _ in range(sessions):
        p = rng.integers(1, vocab, 16 * CHUNK).tolist()
        at = int(rng.integers(0, max(1, len(items) - turns * 4)))
        for t in range(turns):
            p = p + rng.integers(1, vocab, 40).tolist()
            items.insert(min(len(items), at + 4 * t), list(p))
            p = p + rng.integers(1, vocab, 40).tolist()  # the "answer": fixed, so every policy sees one trace
    gaps = rng.exponential(1.0 / rate, len(items))
    return list(zip(np.cumsum(gaps).tolist(), items))


def run_policy(policy: str, trace, new_tokens: int, threads: int, eps: float, tps: float) -> list[dict]:
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvmesh.integrations.hf import spec_for_model, tiny_llama
    from kvmesh.integrations.serve import router_config

    salt = f"placement-{policy}-{time.time_ns()}"
    if policy == "kvmesh":
        spec = spec_for_model(tiny_llama(0, **MODEL), chunk_tokens=CHUNK)
        cfg = router_config(spec, eps=eps, cache_salt=salt, prefill_tokens_per_s=tps)
    else:
        cls = RoundRobinRouter if policy == "round_robin" else PrefixAffinityRouter
        cfg = RequestRouterConfig(request_router_class=cls)
    app = _deployment().options(request_router_config=cfg).bind(salt, new_tokens, threads)
    handle = serve.run(app, name=f"placement-{policy}", route_prefix=None)
    for i in range(6):  # warm every replica's torch up, on prompts outside the trace
        handle.remote(list(range(1000 + i, 1000 + i + 100))).result()
    t0 = time.time()
    sent = []
    for at, toks in trace:
        delay = t0 + at - time.time()
        if delay > 0:
            time.sleep(delay)
        sent.append((time.time(), handle.remote(toks)))
    rows = []
    for (ts, resp), (_, toks) in zip(sent, trace):
        r = resp.result(timeout_s=600)
        rows.append({**r, "ttft_s": r["start"] + r["ttft_s"] - ts, "prompt_tokens": len(toks)})
    serve.delete(f"placement-{policy}")
    return rows


def summarize(rows: list[dict], chunk_bytes: int) -> dict:
    ttft = np.array([r["ttft_s"] for r in rows])
    nodes = sorted({r["node"] for r in rows})
    return {"requests": len(rows), "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p90_s": float(np.percentile(ttft, 90)), "ttft_mean_s": float(ttft.mean()),
            "prefill_tokens": int(sum(r["computed"] for r in rows)),
            "reused_local_tokens": int(sum(r["reused_local"] for r in rows)),
            "reused_peer_tokens": int(sum(r["reused_peer"] for r in rows)),
            "bytes_between_nodes": int(sum(r["reused_peer"] for r in rows) // CHUNK * chunk_bytes),
            "requests_per_node": {n: sum(r["node"] == n for r in rows) for n in nodes},
            # per request, in trace order: "ttft s, tokens computed, reused from this node, pulled, node index"
            "per_request": [f'{r["ttft_s"]:.4f},{r["computed"]},{r["reused_local"]},{r["reused_peer"]},'
                            f'{nodes.index(r["node"])}' for r in rows]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=2.5, help="Poisson arrivals, requests/s")
    p.add_argument("--docs", type=int, default=30)
    p.add_argument("--requests", type=int, default=300, help="document questions (sessions come on top)")
    p.add_argument("--min-chunks", type=int, default=16, help="document length, chunks of 64 tokens")
    p.add_argument("--max-chunks", type=int, default=64)
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--eps", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=",".join(POLICIES))
    args = p.parse_args(argv)

    import ray
    import torch
    from ray import serve

    import kvmesh
    from kvmesh.integrations.hf import _forward, _new_cache, spec_for_model, tiny_llama
    from kvmesh.local import LocalRayCluster, RedisServer

    # the router's prefill prior: this model's rate here, measured once in the driver
    torch.set_num_threads(args.threads)
    model = tiny_llama(0, **MODEL)
    ids = torch.randint(1, 4096, (1, 1024))
    with torch.inference_mode():
        _forward(model, ids, _new_cache(), logits_to_keep=1)
        t = time.perf_counter()
        _forward(model, ids, _new_cache(), logits_to_keep=1)
        tps = 1024 / (time.perf_counter() - t)
    chunk_bytes = spec_for_model(model, chunk_tokens=CHUNK).chunk_bytes
    trace = make_trace(args.seed, args.docs, args.requests, args.sessions, args.turns, args.rate, args.min_chunks,
                       args.max_chunks)
    print(f"trace: {len(trace)} requests over {trace[-1][0]:.0f} s; prefill here {tps:.0f} tokens/s", flush=True)

    results: dict[str, dict] = {}
    outputs: dict[str, list] = {}
    with RedisServer() as redis_server:
        cluster = LocalRayCluster(3, num_cpus=2, object_store_bytes=200 << 20)
        try:
            kvmesh.start(redis_server.url, cpu_bytes=256 << 20, slot_bytes=1 << 20)
            serve.start(http_options={"location": "NoServer"})
            for policy in args.policies.split(","):
                rows = run_policy(policy, trace, args.new_tokens, args.threads, args.eps, tps)
                results[policy] = summarize(rows, chunk_bytes)
                outputs[policy] = [r["tokens"] for r in rows]
                print(policy, {k: v for k, v in results[policy].items() if k != "per_request"}, flush=True)
            serve.shutdown()
            kvmesh.stop()
        finally:
            ray.shutdown()
            cluster.shutdown()
    ref = next(iter(outputs.values()))
    out = {"outputs_identical": all(o == ref for o in outputs.values())}
    if "kvmesh" in results:
        k = results["kvmesh"]["ttft_p90_s"]
        for base in ("round_robin", "prefix_affinity"):
            if base in results:
                out[f"p90_ttft_vs_{base}"] = k / results[base]["ttft_p90_s"]
    save("placement", {**out, "goals": {"p90_ttft_vs_round_robin": "<= 0.5", "p90_ttft_vs_prefix_affinity": "<= 0.8"},
                       "args": vars(args), "prefill_tokens_per_s": tps, "trace_requests": len(trace),
                       "policies": results})


if __name__ == "__main__":
    main()
