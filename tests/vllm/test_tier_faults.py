"""Faults between vLLM's calls to KVMeshTier (lookup, then a load job for the hits) and inside them."""

import mmap
import os
import time

import pytest
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tests.conftest import reachable, wait_until
from tests.vllm.engines import REPO, engine_env, make_model, tokens
from tests.vllm.test_tier import CHUNK, PROMPT, TierEngine

pytestmark = pytest.mark.timeout(600)


class FaultTier(TierEngine):
    _jobs = 10_000

    def tier_lookup(self, req_id: str, prompt: list[int], timeout_s: float = 20.0) -> list[str]:
        """KVMeshTier.lookup of each key, stepping until none is RETRY."""
        from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

        ctx = ReqContext(req_id=req_id)
        keys = self.keys(prompt)
        limit = time.monotonic() + timeout_s
        while True:
            res = [self.tier.lookup(k, ctx) for k in keys]
            self.tier.on_schedule_end(ScheduleEndContext((), ()))
            if all(r is not LookupResult.RETRY for r in res) or time.monotonic() > limit:
                return [r.name for r in res]
            time.sleep(0.02)

    def tier_load(self, req_id: str, prompt: list[int], first_row: int = 40, timeout_s: float = 30.0) -> dict:
        """A load job of all the prompt's keys into primary rows first_row.., polled until it ends."""
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.tiering.base import TransferJob
        import numpy as np

        keys = self.keys(prompt)
        ids = np.arange(first_row, first_row + len(keys))
        for c in ids:
            self.rows[int(c)].zero_()
        FaultTier._jobs += 1
        job = FaultTier._jobs
        t0 = time.monotonic()
        self.tier.submit_load(TransferJob(job, keys, ids, True, ReqContext(req_id=req_id)))
        res = None
        while res is None and time.monotonic() - t0 < timeout_s:
            for r in self.tier.get_finished_jobs():
                if r.job_id == job:
                    res = r
            time.sleep(0.01)
        took = time.monotonic() - t0
        ok = None if res is None else (len(keys) if res.success else
                                       len(res.successful_keys or ()))
        if res is not None and res.successful_keys:
            assert list(res.successful_keys) == keys[:ok]
        return {"done": res is not None, "ok": ok, "seconds": took,
                "rows": [self.rows[int(c)].numpy().tobytes() for c in ids],
                "counts": dict(self.tier.counts), "fetch": self.tier.client.last_fetch}

    def slab(self) -> str:
        return self.tier.client._slab_path


def engine_on(node_id: str, work: str, *args, **kw):
    return ray.remote(FaultTier).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        runtime_env={"env_vars": {**engine_env(work), "PYTHONPATH": REPO}}).remote(*args, **kw)


def kill_node(node_id: str, no_restart: bool = False) -> None:
    from kvmesh.handle import NAMESPACE, NodeHello, actor_name

    actor = ray.get_actor(actor_name(node_id), namespace=NAMESPACE)
    addr = NodeHello.unpack(ray.get(actor.hello.remote(), timeout=30)).info.data_addr
    ray.kill(actor, no_restart=no_restart)
    wait_until(lambda: not reachable(addr), 30)


def corrupt(slab_path: str, row: bytes, nbytes: int) -> None:
    fd = os.open(slab_path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED)
        at = mm.find(row[:nbytes])
        assert at >= 0
        mm[at + 64:at + 72] = b"\xff" * 8
        mm.close()
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def tiers(vllm_mesh, tmp_path_factory):
    cluster, _ = vllm_mesh
    h, n1, n2 = cluster.node_ids()
    work = str(tmp_path_factory.mktemp("vllm-tier-faults"))
    model = make_model(os.path.join(work, "tiny-llama"))
    es = {"H": engine_on(h, work, "f-h", model), "A": engine_on(n1, work, "f-a", model),
          "B": engine_on(n2, work, "f-b", model)}
    assert ray.get([e.node.remote() for e in es.values()], timeout=300) == [h, n1, n2]
    es["nodes"] = {"H": h, "A": n1, "B": n2}
    yield es
    for k in "HAB":
        ray.kill(es[k])


def leading_exact(got: dict, want: list[bytes]) -> int:
    assert got["done"], got
    n = got["ok"]
    assert got["rows"][:n] == want[:n]
    return n


def test_corrupt_row_between_lookup_and_load(tiers):
    a, b = tiers["A"], tiers["B"]
    p = tokens(100, PROMPT)
    assert ray.get(a.store.remote("a1", p), timeout=120)["stored"] == 8
    assert ray.get(b.tier_lookup.remote("b1", p), timeout=60) == ["HIT"] * 8
    want = ray.get(a.rows_of.remote(p))
    corrupt(ray.get(a.slab.remote()), want[5], 4096)
    got = ray.get(b.tier_load.remote("b1", p), timeout=120)
    print("\ncorrupt:", got["ok"], got["seconds"], got["fetch"])
    assert leading_exact(got, want) == 5


def test_split_holder_killed_between_lookup_and_load(tiers):
    h, a, b = tiers["H"], tiers["A"], tiers["B"]
    p = tokens(110, PROMPT)
    assert ray.get(a.store.remote("a2", p[:4 * CHUNK]), timeout=120)["stored"] == 4
    assert ray.get(h.store.remote("h2", p), timeout=120)["counts"]["vllm_tier_stored_chunks"] == 4
    assert ray.get(b.tier_lookup.remote("b2", p), timeout=60) == ["HIT"] * 8
    # the rows A stored (of its 4-chunk prompt: a CPU's kernels may round the same tokens' KV a few ulps apart in a
    # prompt of another length, so H's rows of p are not the bytes to expect from A)
    want = ray.get(a.rows_of.remote(p[:4 * CHUNK]))
    kill_node(tiers["nodes"]["H"])
    got = ray.get(b.tier_load.remote("b2", p), timeout=120)
    print("\nsplit:", got["ok"], got["seconds"], got["fetch"])
    assert leading_exact(got, want) == 4 and got["seconds"] < 7


def test_flushall_between_lookup_and_load(tiers, private_redis):
    import redis

    a, b = tiers["A"], tiers["B"]
    p = tokens(120, PROMPT)
    assert ray.get(a.store.remote("a3", p), timeout=120)["stored"] == 8
    assert ray.get(b.tier_lookup.remote("b3", p), timeout=60) == ["HIT"] * 8
    want = ray.get(a.rows_of.remote(p))
    r = redis.Redis.from_url(private_redis.url)
    r.flushall()
    r.close()
    got = ray.get(b.tier_load.remote("b3", p), timeout=120)
    print("\nflushall:", got["ok"], got["seconds"], got["fetch"])
    leading_exact(got, want)
    wait_until(lambda: ray.get(b.tier_lookup.remote("b3-again", p), timeout=60) == ["HIT"] * 8, 60)
    got = ray.get(b.tier_load.remote("b3-again", p), timeout=120)
    assert got["ok"] == 8 and got["rows"] == want
