"""KVSpec: validation names the field; every field is part of the identity."""

import dataclasses

import pytest

from kvmesh import KVSpec

BASE = dict(model_id="llama@rev1", num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16")


def test_defaults_and_sizes():
    s = KVSpec(**BASE)
    assert (s.chunk_tokens, s.tp_rank, s.tp_size, s.lora_id) == (256, 0, 1, None)
    assert s.chunk_shape == (4, 2, 256, 8, 128)
    assert s.chunk_bytes == 4 * 2 * 256 * 8 * 128 * 2
    assert len(s.namespace) == 16


@pytest.mark.parametrize("field,value", [
    ("num_layers", -1), ("num_layers", 0), ("num_kv_heads", -8), ("head_dim", 0), ("chunk_tokens", 0),
    ("chunk_tokens", -256), ("chunk_tokens", 2.5), ("chunk_tokens", "256"), ("chunk_tokens", True),
    ("dtype", "bf16"), ("dtype", "float64x"), ("tp_size", 0), ("tp_rank", -1), ("model_id", ""),
    ("lora_id", ""), ("layout_version", 99),
])
def test_invalid_fields_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        KVSpec(**{**BASE, field: value})


def test_tp_rank_must_be_below_tp_size():
    with pytest.raises(ValueError, match="tp_rank"):
        KVSpec(**BASE, tp_rank=2, tp_size=2)


@pytest.mark.parametrize("field,value", [
    ("model_id", "llama@rev2"), ("num_layers", 5), ("num_kv_heads", 4), ("head_dim", 64), ("dtype", "float16"),
    ("chunk_tokens", 128), ("tp_rank", 1), ("lora_id", "adapter-a"),
])
def test_every_field_changes_the_namespace(field, value):
    base = KVSpec(**BASE, tp_size=2)
    other = KVSpec(**{**BASE, "tp_size": 2, field: value})
    assert other != base and other.namespace != base.namespace


def test_equal_specs_are_equal_and_frozen():
    a, b = KVSpec(**BASE), KVSpec(**BASE)
    assert a == b and a.namespace == b.namespace and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.num_layers = 3


def test_config_loads_yaml_then_environment_with_units(tmp_path):
    from kvmesh.config import KVMeshConfig

    f = tmp_path / "kvmesh.yaml"
    f.write_text("cpu_bytes: 512MiB\nlease_s: 4\nwrite_policy: write_through\n")
    c = KVMeshConfig.load(str(f), env={"KVMESH_LEASE_S": "6", "KVMESH_PROMOTE_ON_HIT": "false"})
    assert (c.cpu_bytes, c.lease_s, c.write_policy, c.promote_on_hit) == (512 << 20, 6.0, "write_through", False)
    f.write_text("cpu_bites: 1\n")
    with pytest.raises(ValueError, match="cpu_bites"):
        KVMeshConfig.load(str(f), env={})


# -- KV cache groups and the KV format ---------------------------------------------------------------------------
from kvmesh.spec import KVFormat, KVGroup, group_specs  # noqa: E402

FMT = KVFormat("vllm", "cpu:vec:0123abcd", 1)


def test_a_plain_spec_encodes_as_before_groups_and_formats_existed():
    import msgpack

    s = KVSpec(**BASE)
    assert msgpack.unpackb(s.canonical_bytes()) == [b"kvmesh-spec", 1, "llama@rev1", 4, 8, 128, "bfloat16", 256, 0,
                                                   1, "", 1]
    assert KVSpec(**BASE, group=None, kv_format=None).namespace == s.namespace


@pytest.mark.parametrize("extra", [
    dict(kv_format=FMT), dict(kv_format=KVFormat("vllm", "cpu:vec:0123abcd", 2)),
    dict(kv_format=KVFormat("vllm", "gpu:headmajor", 1)), dict(kv_format=KVFormat("sglang", "cpu:vec:0123abcd", 1)),
    dict(group=KVGroup(0, "sliding_window", 512, (0, 1, 2, 3))), dict(group=KVGroup(1, "full", 0, (4, 5, 6, 7))),
    dict(group=KVGroup(0, "sliding_window", 1024, (0, 1, 2, 3))), dict(group=KVGroup(0, "full")),
])
def test_the_group_and_the_format_are_part_of_the_identity_and_round_trip(extra):
    plain = KVSpec(**BASE)
    s = KVSpec(**BASE, **extra)
    assert s != plain and s.namespace != plain.namespace
    assert KVSpec.from_canonical_bytes(s.canonical_bytes()) == s
    others = [KVSpec(**BASE, kv_format=FMT), KVSpec(**BASE, group=KVGroup(0, "sliding_window", 512, (0, 1, 2, 3)))]
    assert sum(o.namespace == s.namespace for o in others) <= 1  # equal only to itself


@pytest.mark.parametrize("kw,name", [
    (dict(index=-1), "index"), (dict(index=0, attention="local"), "attention"),
    (dict(index=0, attention="sliding_window"), "window"), (dict(index=0, window=4), "window"),
    (dict(index=0, layers=[0, 1]), "layers"), (dict(index=0, layers=(0, 0)), "layers"),
])
def test_bad_groups_are_refused_naming_the_field(kw, name):
    with pytest.raises(ValueError, match=name):
        KVGroup(**kw)


def test_bad_formats_and_state_groups_are_refused():
    for kw, name in ((("", "x", 1), "engine"), (("vllm", "", 1), "layout"), (("vllm", "x", 0), "version")):
        with pytest.raises(ValueError, match=name):
            KVFormat(*kw)
    with pytest.raises(ValueError, match="state"):
        KVSpec(**BASE, group=KVGroup(0, "state", 0, (0, 1, 2, 3)))
    with pytest.raises(ValueError, match="layers"):
        KVSpec(**BASE, group=KVGroup(0, "full", 0, (0, 1)))  # 2 layers listed, num_layers 4


def test_group_specs_split_a_hybrid_model_and_leave_a_uniform_one_alone():
    base = KVSpec(**{**BASE, "num_layers": 4}, kv_format=FMT)
    assert group_specs(base, [KVGroup(0, "full", 0, (0, 1, 2, 3))]) == (base,)  # one full group: a plain stack
    swa, full = group_specs(base, [KVGroup(0, "sliding_window", 300, (0, 2)), KVGroup(1, "full", 0, (1, 3))])
    assert (swa.num_layers, full.num_layers, swa.window, full.window) == (2, 2, 300, 0)
    assert len({base.namespace, swa.namespace, full.namespace}) == 3  # the groups never share a chunk key
    (mistral,) = group_specs(base, [KVGroup(0, "sliding_window", 300, (0, 1, 2, 3))])
    assert mistral.group.window == 300 and mistral.num_layers == 4
    with pytest.raises(ValueError, match="more than one"):
        group_specs(base, [KVGroup(0, "full", 0, (0, 1)), KVGroup(1, "sliding_window", 9, (1, 2))])
    with pytest.raises(ValueError, match="distinct"):
        group_specs(base, [KVGroup(0, "full", 0, (0,)), KVGroup(0, "full", 0, (1,))])


def test_window_start_chunk_is_the_chunk_of_the_oldest_token_attended():
    s = KVSpec(**BASE, chunk_tokens=256, group=KVGroup(0, "sliding_window", 300, (0, 1, 2, 3)))
    # computing from token 1024 on attends to tokens 725..1024: chunks 2 (512-767) and 3
    assert [s.window_start_chunk(b) for b in (0, 256, 512, 768, 1024, 1280)] == [0, 0, 0, 1, 2, 3]
    assert KVSpec(**BASE).window_start_chunk(4096) == 0
    w256 = KVSpec(**BASE, chunk_tokens=256, group=KVGroup(0, "sliding_window", 256, (0, 1, 2, 3)))
    assert w256.window_start_chunk(1024) == 3  # tokens 769..1024: chunk 3 only
