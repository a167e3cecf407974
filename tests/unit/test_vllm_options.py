"""The vLLM connector's options and spec derivation (kvmesh.integrations.vllm_options), with stand-ins for vLLM's
config objects (the module reads them by attribute; the real ones are exercised by tests/vllm)."""

import os
import time
from types import SimpleNamespace as NS

import pytest
import torch

from kvmesh.integrations.identity import local_model_id
from kvmesh.integrations.vllm_options import (
    ConnectorOptions,
    background_save_copy,
    lora_identity,
    model_identity,
    parse_options,
    request_salt,
    spec_for_vllm,
    specs_for_vllm,
)


class FullAttentionSpec(NS):  # vLLM's class name is what the connector checks
    pass


class SlidingWindowSpec(NS):
    pass


class MambaSpec(NS):
    pass


class ChunkedLocalAttentionSpec(NS):
    pass


def vllm_config(model="org/model", revision="abc123", dtype=torch.bfloat16, tp=1, pp=1, cache_dtype="auto",
                **model_kw):
    return NS(model_config=NS(model=model, revision=revision, dtype=dtype, hf_overrides=model_kw.get("overrides"),
                              quantization=model_kw.get("quantization")),
              parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=pp),
              cache_config=NS(calculate_kv_scales=False, cache_dtype=cache_dtype))


def kv_config(block=16, heads=8, head=128, dtype=torch.bfloat16, layers=4, kind=FullAttentionSpec, groups=1,
              window=None):
    spec = kind(block_size=block, num_kv_heads=heads, head_size=head, head_size_v=head, dtype=dtype,
                sliding_window=window)
    group = NS(kv_cache_spec=spec, layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(layers)])
    return NS(kv_cache_groups=[group] * groups)


def hybrid_config(window=512, block=16):
    """Gemma-2-style: even layers sliding-window, odd layers full attention (vLLM's hybrid allocator)."""
    def group(kind, layers, **kw):
        return NS(kv_cache_spec=kind(block_size=block, num_kv_heads=8, head_size=128, head_size_v=128,
                                     dtype=torch.bfloat16, **kw),
                  layer_names=[f"model.layers.{i}.self_attn.attn" for i in layers])
    return NS(kv_cache_groups=[group(SlidingWindowSpec, (0, 2), sliding_window=window),
                               group(FullAttentionSpec, (1, 3), sliding_window=None)])


def test_options_are_type_checked_and_unknown_keys_named():
    o = parse_options({"cache_salt": "t1", "chunk_tokens": 512, "load_mode": "sync", "cost_model": False,
                       "fetch_timeout_s": 2.5, "save_copy": "background"})
    assert o == ConnectorOptions(cache_salt="t1", chunk_tokens=512, load_mode="sync", cost_model=False,
                                 fetch_timeout_s=2.5, save_copy="background")
    assert parse_options(None) == ConnectorOptions()
    for bad, name in (({"chunk_tokns": 256}, "chunk_tokns"), ({"chunk_tokens": 0}, "chunk_tokens"),
                      ({"chunk_tokens": True}, "chunk_tokens"), ({"cost_model": 1}, "cost_model"),
                      ({"load_mode": "eager"}, "load_mode"), ({"cache_salt": ""}, "cache_salt"),
                      ({"cache_salt": "a\x00b"}, "cache_salt"), ({"fetch_timeout_s": -1}, "fetch_timeout_s"),
                      ({"fetch_timeout_s": float("nan")}, "fetch_timeout_s"),
                      ({"fetch_timeout_s": float("inf")}, "fetch_timeout_s"),
                      ({"fetch_timeout_s": 1e6}, "fetch_timeout_s"),
                      ({"save_copy": "later"}, "save_copy"), ({"ray_address": 5}, "ray_address")):
        with pytest.raises(ValueError, match=name):
            parse_options(bad)


def test_salts_keep_tenants_and_salted_engines_apart():
    assert request_salt(None, None) is None
    assert request_salt(None, "t1") == "t1"  # shared with a transformers worker salted "t1"
    assert request_salt("eng", None) == "eng\x00"
    assert request_salt("eng", "t1") == "eng\x00t1"
    assert len({request_salt(e, r) for e in (None, "eng", "eng2") for r in (None, "t1", "t2")}) == 9


def test_the_model_identity_needs_a_revision_or_a_fingerprint(tmp_path):
    o = ConnectorOptions()
    assert model_identity(vllm_config().model_config, o) == "org/model@abc123"
    with pytest.raises(ValueError, match="revision"):
        model_identity(vllm_config(revision=None).model_config, o)
    assert model_identity(vllm_config(revision=None).model_config,
                          ConnectorOptions(model_revision="r2")) == "org/model@r2"
    assert model_identity(vllm_config().model_config, ConnectorOptions(model_id="mine")) == "mine"
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"weights-1")
    first = model_identity(vllm_config(model=str(d), revision=None).model_config, o)
    assert first == local_model_id(str(d)) and first.startswith("tiny@")
    (d / "model.safetensors").write_bytes(b"weights-2")  # new weights, same name: a new identity
    assert model_identity(vllm_config(model=str(d)).model_config, o) != first
    with_overrides = model_identity(vllm_config(overrides={"rope_theta": 1e6}).model_config, o)
    assert with_overrides.startswith("org/model@abc123#hf=")
    assert model_identity(vllm_config(quantization="fp8").model_config, o) == "org/model@abc123#q=fp8"
    with pytest.raises(ValueError, match="hf_overrides"):
        model_identity(vllm_config(overrides=lambda c: c).model_config, o)


def test_the_spec_comes_from_the_kv_cache_config():
    o = ConnectorOptions()
    s = spec_for_vllm(vllm_config(tp=2), kv_config(heads=4), o, tp_rank=1)
    assert (s.model_id, s.num_layers, s.num_kv_heads, s.head_dim, s.dtype, s.chunk_tokens, s.tp_rank, s.tp_size) \
        == ("org/model@abc123", 4, 4, 128, "bfloat16", 256, 1, 2)
    assert spec_for_vllm(vllm_config(), kv_config(block=128), o).chunk_tokens == 256
    assert spec_for_vllm(vllm_config(), kv_config(block=96), o).chunk_tokens == 288  # a multiple of the block
    assert spec_for_vllm(vllm_config(), kv_config(), ConnectorOptions(chunk_tokens=64)).chunk_tokens == 64
    # the same weights in fp32 compute give other KV values, even stored as bf16
    s32 = spec_for_vllm(vllm_config(dtype=torch.float32), kv_config(), o)
    assert s32.model_id == "org/model@abc123#compute=float32" and s32 != spec_for_vllm(vllm_config(), kv_config(), o)
    assert spec_for_vllm(vllm_config(), kv_config(), o, lora_id="ad@1").lora_id == "ad@1"
    # every fp8 KV format is stored as uint8 by vLLM: the same byte is another value in each, so never shared;
    # "fp8" and "fp8_e4m3" are two names of one format (vLLM's kernels take them alike), so they share
    fp8 = {d: spec_for_vllm(vllm_config(cache_dtype=d), kv_config(dtype=torch.uint8), o)
           for d in ("fp8", "fp8_e4m3", "fp8_e5m2")}
    assert fp8["fp8_e5m2"].model_id == "org/model@abc123#compute=bfloat16#kv=fp8_e5m2"
    assert fp8["fp8"].namespace == fp8["fp8_e4m3"].namespace != fp8["fp8_e5m2"].namespace
    for cfg, kv, why in ((vllm_config(), kv_config(groups=2), "more than one KV cache group"),
                         (vllm_config(), kv_config(kind=MambaSpec), "Mamba"),
                         (vllm_config(), kv_config(kind=ChunkedLocalAttentionSpec), "chunked local attention"),
                         (vllm_config(pp=2), kv_config(), "pipeline"),
                         (vllm_config(), kv_config(block=16), "multiple")):
        opts = ConnectorOptions(chunk_tokens=24) if why == "multiple" else o
        with pytest.raises(ValueError, match=why):
            spec_for_vllm(cfg, kv, opts)


def test_hybrid_and_sliding_window_models_get_one_spec_per_group():
    from kvmesh.spec import KVFormat

    o, fmt = ConnectorOptions(), KVFormat("vllm", "cpu:vec:bs16:00", 1)
    swa, full = specs_for_vllm(vllm_config(), hybrid_config(), o, kv_format=fmt)
    assert (swa.group.attention, swa.group.window, swa.group.layers, swa.num_layers) == ("sliding_window", 512,
                                                                                         (0, 2), 2)
    assert (full.group.attention, full.group.layers, full.kv_format) == ("full", (1, 3), fmt)
    assert swa.namespace != full.namespace and swa.model_id == full.model_id
    (mistral,) = specs_for_vllm(vllm_config(), kv_config(kind=SlidingWindowSpec, window=4096), o)
    assert mistral.group.window == 4096 and mistral.kv_format is None
    (plain,) = specs_for_vllm(vllm_config(), kv_config(), o, kv_format=fmt)
    assert plain.group is None and plain.kv_format == fmt  # one full-attention group: a uniform stack
    # "neutral" leaves the format out: the spec a transformers worker with kv_format=None derives
    assert spec_for_vllm(vllm_config(), kv_config(), ConnectorOptions(kv_format="neutral"), kv_format=fmt) == \
        spec_for_vllm(vllm_config(), kv_config(), o)
    with pytest.raises(ValueError, match="2 KV cache groups"):
        spec_for_vllm(vllm_config(), hybrid_config(), o)
    with pytest.raises(ValueError, match="kv_format"):
        parse_options({"kv_format": "raw"})


def test_save_copies_default_to_inline_on_the_cpu_only():
    assert not background_save_copy(ConnectorOptions(), "cpu")
    assert background_save_copy(ConnectorOptions(), "cuda")
    assert background_save_copy(ConnectorOptions(save_copy="background"), "cpu")
    assert not background_save_copy(ConnectorOptions(save_copy="inline"), "cuda")


def test_lora_identity_fingerprints_local_adapters(tmp_path):
    assert lora_identity(None, {}) is None
    assert lora_identity(NS(lora_name="sql", lora_path="hub/sql-lora"), {}) == "sql"
    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text('{"r": 8}')
    (d / "adapter_model.safetensors").write_bytes(b"lora")
    memo = {}
    first = lora_identity(NS(lora_name="sql", lora_path=str(d)), memo)
    assert first.startswith("sql@") and memo == {str(d): first[4:]}
    (d / "adapter_config.json").write_text('{"r": 16}')  # another adapter config: another identity
    assert lora_identity(NS(lora_name="sql", lora_path=str(d)), {}) != first
    assert os.path.isdir(d)


def test_a_model_fingerprint_is_read_from_its_cache_while_the_files_are_unchanged(tmp_path, monkeypatch):
    # hashing every weight byte takes minutes for a large model, in every engine process: kept by the files' stat
    import kvmesh.integrations.identity as identity

    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"w" * 1000)
    old = time.time() - 10  # (files changed in the last CACHE_MIN_AGE_S are never cached: a coarse clock could
    for f in d.iterdir():  # give a rewrite the same timestamp)
        os.utime(f, (old, old))
    first = identity.model_fingerprint(str(d))
    reads = []
    real_open = open

    def counting_open(file, *a, **k):
        reads.append(str(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr("builtins.open", counting_open)
    assert identity.model_fingerprint(str(d)) == first
    assert not any(r.endswith("model.safetensors") for r in reads)  # from the cache
    monkeypatch.setattr("builtins.open", real_open)
    (d / "model.safetensors").write_bytes(b"v" * 1000)  # same size, rewritten just now: hashed again
    assert identity.model_fingerprint(str(d)) != first
    assert identity.model_fingerprint(str(d)) != first
