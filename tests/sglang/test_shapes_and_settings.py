"""KVMeshStorage with other host pools and settings than test_direct_drive's: every MHA host-pool layout SGLang
0.5.23 has, page sizes and geometries that are not powers of two, fp8 pools, re-registration, and the parallel
and speculative settings that change what a page holds. SGLang's own pools and factory; the backends run in the
driver process (its node's KVNode) of a real 3-node Ray cluster, against a real redis-server.
"""

import hashlib
import os
from dataclasses import replace
from types import SimpleNamespace as NS

import pytest
import redis
import torch

from tests.conftest import wait_until


def extra(**kw) -> dict:
    return {"backend_name": "kvmesh", "module_path": "kvmesh.integrations.sglang", "class_name": "KVMeshStorage",
            "interface_v1": 1, "generation_refresh_s": 0.2, **kw}


def keys_for(tag: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


def storage_config(**kw):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    base = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                enable_storage_metrics=False, is_page_first_layout=False, model_name="tiny", extra_config={})
    return HiCacheStorageConfig(**{**base, **kw})


def host_pool(layout="layer_first", page=16, heads=2, head_dim=64, layers=2, dtype=torch.bfloat16, drafts=0):
    """SGLang's host pool over its device pool (and `drafts` packed one-layer NextN draft pools)."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    def device(n):
        return MHATokenToKVPool(size=max(256, 16 * page), page_size=page, dtype=dtype, head_num=heads,
                                head_dim=head_dim, layer_num=n, device="cpu", enable_memory_saver=False,
                                enable_alt_stream=False)

    cls, info, kw = _mha_host_inputs(device(layers), tuple(device(1) for _ in range(drafts)))
    return cls(info, 2.0, 0, page, layout, **kw)


def backend(host, config=None, **options):
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    config = config or storage_config(extra_config=extra(**options))
    be = StorageBackendFactory.create_backend("dynamic", config, host)
    be.register_mem_pool_host(host)
    return be


def fill(host, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    raw = host.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def page_bytes(host, index) -> torch.Tensor:
    return host.get_data_page(int(index), flat=True).view(torch.uint8).clone()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
@pytest.mark.parametrize("geometry", [dict(page=1, heads=3, head_dim=80, layers=3),
                                      dict(page=7, heads=5, head_dim=24, layers=1, dtype=torch.float8_e5m2)],
                         ids=["p1-3x80-3L", "p7-5x24-1L-fp8"])
def test_every_layout_round_trips_a_partial_batch_bit_exact(sgl_cluster, layout, geometry):
    host = host_pool(layout, **geometry)
    tag = f"{layout}-{'-'.join(map(str, geometry.values()))}"
    options = {"kv_cache_dtype": "fp8_e5m2"} if host.dtype == torch.uint8 else {}
    be = backend(host, model_id=f"shape-{tag}@r1", **options)
    P = host.page_size
    fill(host, 1)
    keys = keys_for(tag, 5)
    idx = host.alloc(5 * P)
    assert be.batch_set_v1(keys[:3], idx[: 3 * P]) == [True] * 3
    pages = [page_bytes(host, idx[i * P]) for i in range(3)]
    host.kv_buffer.zero_()
    assert be.batch_exists(keys) == 3
    other = host.alloc(5 * P)  # other slots than the pages were written from
    assert be.batch_get_v1(keys, other) == [True] * 3 + [False] * 2
    assert all(torch.equal(page_bytes(host, other[i * P]), pages[i]) for i in range(3))
    assert not any(page_bytes(host, other[i * P]).any() for i in range(3, 5))  # the misses are left alone
    # the older interface reads the same pages, in the pool's flat page layout
    got = be.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    assert [g is not None for g in got] == [True] * 3 + [False] * 2
    assert all(torch.equal(got[i].view(torch.uint8), pages[i]) for i in range(3))
    be.close()


def test_re_registering_another_pool_reads_it_and_leaves_other_specs_alone(sgl_cluster, redis_server):
    # the backend connects anew when SGLang hands it a pool of another geometry: its read buffer was the old
    # chunk shape (every read of the new pool failed), and the generation it knew of the old spec was put into
    # the new spec's counter (a clear for every engine of the new spec: their pages vanished)
    small, big = host_pool(heads=2, head_dim=64), host_pool(heads=3, head_dim=32)
    other = backend(host_pool(heads=3, head_dim=32), model_id="rereg@r1")  # an engine of the new spec
    fill(other.mem_pool_host, 2)
    theirs = keys_for("rereg-theirs", 2)
    assert other.batch_set_v1(theirs, other.mem_pool_host.alloc(32)) == [True, True]
    be = backend(small, model_id="rereg@r1")
    r = redis.Redis.from_url(redis_server.url)
    try:
        r.set(be.generation_key(), 1 << 50)  # (the old spec's generation, higher than any start of a new counter)
        be._refresh_generation(force=True)
        idx = small.alloc(32)
        assert be.batch_set_v1(keys_for("rereg-small", 2), idx) == [True, True]
        assert be.batch_get_v1(keys_for("rereg-small", 2), idx) == [True, True]
        be.register_mem_pool_host(big)
        fill(big, 3)
        idx = big.alloc(32)
        mine = keys_for("rereg-big", 2)
        assert be.batch_set_v1(mine, idx) == [True, True]
        pages = [page_bytes(big, idx[i * 16]) for i in range(2)]
        big.kv_buffer.zero_()
        assert be.batch_get_v1(mine, idx) == [True, True]
        assert all(torch.equal(page_bytes(big, idx[i * 16]), pages[i]) for i in range(2))
        wait_until(lambda: other.batch_exists(theirs) == 2 and be.batch_exists(theirs) == 2, 2)
    finally:
        r.close()
        be.close()
        other.close()


def test_context_parallel_ranks_share_pages_unless_the_kv_is_sharded(sgl_cluster):
    # dense-MHA attention CP (SGLang 0.5.23's zigzag strategy) all-gathers K/V and writes the whole KV into every
    # CP rank's pool: the same page under the same key, shared like any other. Only KV cache sharding (a
    # page-interleaved pool, refused with a storage backend in 0.5.23) gives each CP rank its own part
    from kvmesh.integrations.sglang import spec_for_pool

    host = host_pool()
    fill(host, 4)
    config = storage_config(extra_config=extra(model_id="cp@r1"))
    ranks = [backend(host, replace(config, attn_cp_rank=i, attn_cp_size=2)) for i in range(2)]
    keys = keys_for("cp", 3)
    assert ranks[0].batch_set_v1(keys, host.alloc(48)) == [True] * 3
    assert [be.batch_exists(keys) for be in ranks] == [3, 3]
    for be in ranks:
        be.close()
    opts = {"model_id": "cp@r1"}
    plain = spec_for_pool(storage_config(), host, opts)
    assert spec_for_pool(replace(config, attn_cp_rank=1, attn_cp_size=2), host, opts) == plain
    sharded = NS(**{k: getattr(host, k) for k in ("layout", "kv_buffer", "head_dim", "head_num", "layer_num",
                                                    "dtype", "page_size")}, shard_size=2)
    assert len({spec_for_pool(replace(config, attn_cp_rank=i, attn_cp_size=2), sharded, opts).namespace
                for i in range(2)}) == 2


ARGS = dict(kv_cache_dtype="auto", quantization=None, json_model_override_args="{}", dtype="auto",
            model_path="/models/glm", speculative_algorithm="EAGLE", speculative_draft_model_path=None,
            speculative_draft_model_revision=None)


def test_a_packed_draft_model_is_part_of_the_identity():
    # SGLang packs a NextN (MTP) draft model's layers into the target's host pool, after the target's: a page
    # then holds draft-layer KV, which another draft checkpoint computes otherwise
    from kvmesh.integrations.sglang import spec_for_pool

    config, opts = storage_config(), {"model_id": "glm@r1"}
    packed = host_pool(drafts=1)
    assert packed.layer_num == 3
    own = spec_for_pool(config, packed, opts, NS(**ARGS))  # the draft layers of the target's checkpoint
    assert own == spec_for_pool(config, packed, opts, NS(**{**ARGS, "speculative_draft_model_path": "/models/glm"}))
    drafts = [spec_for_pool(config, packed, opts, NS(**{**ARGS, **change})).namespace
              for change in ({"speculative_draft_model_path": "org/nextn-a", "speculative_draft_model_revision": "1"},
                             {"speculative_draft_model_path": "org/nextn-a", "speculative_draft_model_revision": "2"},
                             {"speculative_draft_model_path": "org/nextn-b", "speculative_draft_model_revision": "1"})]
    assert len({own.namespace, *drafts}) == 4
    # a pool without draft layers is not changed by the draft's settings
    plain = host_pool()
    assert spec_for_pool(config, plain, opts, NS(**ARGS)) == spec_for_pool(
        config, plain, opts, NS(**{**ARGS, "speculative_draft_model_path": "org/nextn-a"}))


def test_a_kv_cache_dtype_option_that_contradicts_the_server_is_refused():
    # fp8 pools are uint8: the option labelled an e5m2 engine's pages as e4m3, and e4m3 engines read them
    from kvmesh.integrations.sglang import spec_for_pool

    pool = host_pool(dtype=torch.float8_e5m2)
    args = NS(**{**ARGS, "kv_cache_dtype": "fp8_e5m2"})
    with pytest.raises(ValueError, match="kv-cache-dtype 'fp8_e5m2'"):
        spec_for_pool(storage_config(), pool, {"model_id": "m@r1", "kv_cache_dtype": "fp8_e4m3"}, args)
    agreed = spec_for_pool(storage_config(), pool, {"model_id": "m@r1", "kv_cache_dtype": "fp8_e5m2"}, args)
    assert agreed == spec_for_pool(storage_config(), pool, {"model_id": "m@r1"}, args)


def test_dummy_weights_are_not_the_checkpoints():
    # `--load-format dummy` (SGLang's profiling mode) computes KV from random weights, not the model directory's
    from kvmesh.integrations.sglang import spec_for_pool

    pool, config, opts = host_pool(), storage_config(), {"model_id": "m@r1"}
    real = spec_for_pool(config, pool, opts, NS(**{**ARGS, "load_format": "auto"}))
    assert real.namespace != spec_for_pool(config, pool, opts, NS(**{**ARGS, "load_format": "dummy"})).namespace
    assert real == spec_for_pool(config, pool, opts, NS(**{**ARGS, "load_format": "safetensors"}))


def test_weights_loaded_at_run_time_replace_the_identity_and_the_dummy_load_format():
    # an engine started with `--load-format dummy` that loads a checkpoint (update_weights_from_disk, as RL rollout
    # engines do) computes that checkpoint's KV: the checkpoint's identity, not "#weights=dummy"
    from kvmesh.integrations.sglang import spec_for_pool

    pool, config, opts = host_pool(), storage_config(), {"model_id": "m@r1"}
    dummy, real = NS(**{**ARGS, "load_format": "dummy"}), NS(**{**ARGS, "load_format": "auto"})
    assert spec_for_pool(config, pool, opts, dummy, loaded="m@r2") == spec_for_pool(config, pool, {"model_id": "m@r2"},
                                                                                     real)
    assert spec_for_pool(config, pool, opts, real, loaded="m@r2").namespace != spec_for_pool(config, pool, opts,
                                                                                             real).namespace
