"""The real SGLang engine (0.5.23, CPU, HiCache) with kvmesh as its L3 backend under settings the other engine tests
never use: a device pool smaller than three prompts with a small chunked-prefill size, page size 8, the write-back
policy and the timeout prefetch policy; and weights updated in place (`update_weights_from_disk`). Each engine is
tests/sglang/engine_driver.py in its own process on its own Ray node; reuse must give the tokens a recompute gives.
"""

import os
import shutil

import pytest

from tests.sglang.conftest import sgl_mesh
from tests.sglang.test_engine import EngineProcess, make_model, prompt

pytestmark = pytest.mark.timeout(900)
MiB = 1 << 20
# (with write-back, a device page leaves only once its host copy exists, and a host page only once its storage
# copy does: when stores are slower than prefill, pages waiting for their storage copy fill the host pool, nothing
# can leave the device, and SGLang aborts the request for want of room and dies ("Prefill out of memory"). Seen in
# CI twice, with a 704- and then a 1,024-token pool; reproduced here with each store slowed by 3 s. The test feeds
# the engine as a paced client would: the next prompt once SGLang is idle, its backups to storage done (`settle`))
PRESSURE = dict(page_size=8, max_total_tokens=1024, chunked_prefill_size=64, hicache_ratio=2.0,
                hicache_write_policy="write_back", hicache_storage_prefetch_policy="timeout")
# the timeout policy's deadline: SGLang's 1 s (+0.25 s a 1k tokens) default cut every read short on a loaded
# machine (then nothing reads from storage and the test proves nothing)
PRESSURE_EXTRA = dict(prefetch_timeout_base=30)


@pytest.fixture(scope="module")
def sgl_cluster(redis_server):
    """conftest's cluster with room for every page these tests write (an 8-token page of the llama model is 8 KiB:
    64 KiB slots held too few of them, and LRU evictions would hide what is tested)."""
    with sgl_mesh(redis_server.url, cpu_bytes=32 * MiB, slot_bytes=16 * 1024, key_prefix="sglp") as both:
        yield both


def perturbed(src: str, dst: str) -> None:
    """A copy of the model at `src` whose matrices are nudged: the same architecture, other weights."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    g = torch.Generator().manual_seed(1)
    w = {k: v + 0.05 * torch.randn(v.shape, generator=g).to(v.dtype) if v.dim() == 2 else v
         for k, v in load_file(path).items()}
    save_file(w, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def engines(sgl_cluster, tmp_path_factory):
    """"W" (conftest's engine settings) on node 1 and "P" (PRESSURE) on node 2, started at once; models m1 and m2
    (m1 with other weights)."""
    cluster, _ = sgl_cluster
    work = str(tmp_path_factory.mktemp("sgl-pressure"))
    m1, m2 = os.path.join(work, "m1"), os.path.join(work, "m2")
    make_model(m1, "llama")
    perturbed(m1, m2)
    _, a, b = cluster.node_ids()
    procs = {"W": EngineProcess(m1, a, cluster.address, work),
             "P": EngineProcess(m1, b, cluster.address, work, engine_args=PRESSURE, **PRESSURE_EXTRA)}
    try:
        for p in procs.values():
            assert p.wait(400) == {"ready": True}
        yield {**procs, "m1": m1, "m2": m2}
    finally:
        for p in procs.values():
            p.close()


def paced(e: EngineProcess, ids: list[int]) -> dict:
    """A generate, then a wait until SGLang is idle again (see PRESSURE)."""
    out = e.generate(ids)
    assert e.call("settle") == {"ok": True}
    return out


def full(e: EngineProcess, ids: list[int]) -> dict:
    """A generate that computes the whole prompt (prompt logprobs from its first token: no prefix is reused)."""
    out = e.call("generate", batch=[ids], return_logprob=True, logprob_start_len=0)["outs"][0]
    assert out["cached_tokens"] == 0
    return out


def test_after_a_weight_update_the_engine_reads_and_writes_the_new_weights_pages(engines):
    e, m1, m2 = engines["W"], engines["m1"], engines["m2"]
    p, q = prompt(301), prompt(302)
    on_m1 = e.generate(p)  # m1's pages of p go to kvmesh
    assert e.call("update_weights", model_path=m2)["ok"]  # (SGLang flushes its own tiers after)
    p_m2 = full(e, p)
    assert p_m2["ids"] != on_m1["ids"]  # the weights differ
    assert e.call("flush") == {"ok": True}
    again = e.generate(p)
    # (a backend that did not follow the update read m1's pages of p for m2 here: 496 of them, other tokens)
    assert again["ids"] == p_m2["ids"]
    assert again["cached"]["storage"] == 496  # m2's own pages of p, written by the full compute
    q_m2 = e.generate(q)  # m2's pages of q go to kvmesh
    # back to m1: m2's pages are not m1's (m2's pages of q were read for m1), m1's are again
    assert e.call("update_weights", model_path=m1)["ok"]
    q_m1 = full(e, q)
    assert q_m1["ids"] != q_m2["ids"]
    assert e.call("flush") == {"ok": True}
    assert e.generate(q)["ids"] == q_m1["ids"]
    back = e.generate(p)
    assert back["ids"] == on_m1["ids"] and back["cached"]["storage"] == 496


def test_a_small_device_pool_write_back_and_the_timeout_policy_reuse_with_the_tokens_of_a_recompute(engines):
    """Prompts of a page multiple, one more, one less, under a page; evicted from device and host by others, then
    from both of SGLang's tiers by a flush: each reuse (storage, through 64-token prefill chunks) gives the tokens
    the first compute gave; so do prompt logprobs (a full prefill) and a batch sharing a prefix."""
    e = engines["P"]
    prompts = {n: prompt(400 + n, n) for n in (512, 513, 511, 72, 5)}
    first = {n: paced(e, p) for n, p in prompts.items()}
    for i in range(7):  # 3,584 tokens through a 1,024-token device pool and a 2,048-token host pool
        paced(e, prompt(450 + i))
    for tag in ("evicted", "flushed"):  # (write-back: SGLang backs a page up once it left the device, in time)
        if tag == "flushed":
            assert e.call("flush") == {"ok": True}
        hits = 0
        for n, p in prompts.items():
            again = paced(e, p)
            assert again["ids"] == first[n]["ids"], (tag, n)
            # (whole pages, at most all but the last token's; fewer when a slow store had backed up only the
            # first pages by the time SGLang dropped the rest from its host pool)
            got = again["cached"].get("storage", 0)
            assert got % 8 == 0 and got <= (n - 1) // 8 * 8, (tag, n, again)
            hits += got
        assert hits, tag  # (each run here: every prompt of 72 tokens or more, from storage)
    q = prompt(460)
    ref = full(e, q)
    assert e.call("flush") == {"ok": True}
    assert full(e, q)["input_token_logprobs"] == ref["input_token_logprobs"]
    batch = [prompt(461, 300) + prompt(462 + j, 40 + j) for j in range(3)]
    refs = e.call("generate", batch=batch)["outs"]
    assert e.call("flush") == {"ok": True}
    got = e.call("generate", batch=batch)["outs"]
    assert [r["ids"] for r in got] == [r["ids"] for r in refs]
