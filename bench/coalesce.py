"""What `coalesce_pulls` costs and saves (not run in CI). Two local Ray nodes; node A holds prompts of 16 chunks
of 4 MiB; readers on node B fetch prompts B has never seen, each figure against direct pulls in the same run:

  lone reader       one reader: through its node (pull into the slab, then copy out) vs straight into its tensor
  later reader      a second reader of the same prompt on B: a local hit, vs pulling it again
  concurrent        4 readers (4 processes) of one prompt at once: bytes A sends and the wall time for all four

Both nodes' slabs are filled first, so slots are reused (their pages touched) as on a node that has run a while.

Run: .venv/bin/python bench/coalesce.py [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from bench.common import save  # noqa: E402

MiB = 1 << 20
CHUNKS = 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    import ray
    import torch
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as NA

    import kvmesh
    from kvmesh.local import LocalRayCluster, RedisServer
    from kvmesh.mesh import node_actors

    spec = kvmesh.KVSpec("bench-coalesce", 4, 8, 128, "bfloat16", chunk_tokens=256)  # 4 MiB chunks
    prompts = 2 * args.reps + 4
    tokens = [list(range(s * 10**6, s * 10**6 + CHUNKS * 256)) for s in range(prompts)]
    rs = RedisServer()
    cluster = LocalRayCluster(2, num_cpus=1, object_store_bytes=512 * MiB)
    try:
        mesh = kvmesh.start(rs.url, cpu_bytes=prompts * CHUNKS * spec.chunk_bytes, slot_bytes=spec.chunk_bytes)
        a, b = mesh.node_ids

        @ray.remote(num_cpus=0)
        class Reader:
            def __init__(self):
                torch.set_num_threads(1)
                self.c = {v: kvmesh.connect(spec, coalesce_pulls=v) for v in (False, True)}

            def ready(self):
                return True

            def store(self, toks_list):
                for toks in toks_list:
                    self.c[False].store(toks, torch.randn(spec.kv_shape(len(toks))).to(torch.bfloat16))
                    self.c[False].flush()

            def fetch(self, toks, via, start_at=0.0):
                c = self.c[via]
                m = c.lookup(toks)
                out = torch.zeros(spec.kv_shape(m.num_tokens), dtype=spec.torch_dtype)  # an engine's buffer
                time.sleep(max(0.0, start_at - time.time()))
                t0 = time.perf_counter()
                kv = c.fetch(m, out=out)
                took = time.perf_counter() - t0
                assert kv.shape[2] == CHUNKS * 256
                return took, time.time()

        on = {n: Reader.options(scheduling_strategy=NA(n, soft=False)).remote() for n in (a, b)}
        ray.get(on[a].store.remote(tokens))
        ray.get(on[b].store.remote([[t + 1 for t in toks] for toks in tokens]))  # B's slab full: pages touched
        nbytes = CHUNKS * spec.chunk_bytes
        lone = {False: [], True: []}
        for i in range(args.reps + 1):  # alternate; every fetch is of a prompt B has not seen
            for via in (False, True):
                took, _ = ray.get(on[b].fetch.remote(tokens[2 * i + int(via)], via))
                if i:
                    lone[via].append(took)
        later = [ray.get(on[b].fetch.remote(tokens[1], True))[0] for _ in range(args.reps)]
        direct_again = [ray.get(on[b].fetch.remote(tokens[0], False))[0] for _ in range(args.reps)]
        holder = node_actors()[a]
        readers = [Reader.options(scheduling_strategy=NA(b, soft=False)).remote() for _ in range(4)]
        ray.get([r.ready.remote() for r in readers])  # started and connected before the clock starts
        concurrent = {}
        for via, toks in ((False, tokens[-2]), (True, tokens[-1])):
            sent0 = ray.get(holder.stats.remote())["served_bytes"].get(b, 0)
            at = time.time() + 2.0
            done = ray.get([r.fetch.remote(toks, via, at) for r in readers])
            sent = ray.get(holder.stats.remote())["served_bytes"].get(b, 0) - sent0
            concurrent["via_node" if via else "direct"] = {
                "holder_sent_bytes": sent, "transfers": sent / nbytes,
                "wall_s_all_four": max(t for _, t in done) - at}
    finally:
        kvmesh.stop()
        cluster.shutdown()
        rs.stop()
    med = statistics.median
    save("coalesce", {
        "prompt_bytes": nbytes, "chunk_bytes": spec.chunk_bytes,
        "lone_reader": {"direct_gbps": nbytes / med(lone[False]) / 1e9, "via_node_gbps": nbytes / med(lone[True]) / 1e9,
                        "ratio": med(lone[False]) / med(lone[True])},
        "later_reader": {"via_node_local_hit_gbps": nbytes / med(later) / 1e9,
                         "direct_pull_again_gbps": nbytes / med(direct_again) / 1e9,
                         "ratio": med(direct_again) / med(later)},
        "concurrent_4_readers": concurrent,
        "note": "ratios > 1 favour coalesce_pulls"})


if __name__ == "__main__":
    main()
