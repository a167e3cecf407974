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
