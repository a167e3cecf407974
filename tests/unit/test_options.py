"""The one option parser of the engine integrations (kvmesh.integrations.options), table by table: the vLLM
connector, the vLLM tier and the SGLang backend. No engine is imported: the tier's `locality` choices (vLLM's
Locality) and the SGLang backend's own entry point are checked in tests/vllm and tests/sglang."""

import dataclasses
import math

import pytest

from kvmesh.integrations.options import (MAX_DEADLINE_S, SGLANG, SGLANG_KEYS, VLLM_CONNECTOR, VLLM_TIER, BOOL, Field,
                                         OptionError, OptionTable, STR)
from kvmesh.integrations.vllm_options import ConnectorOptions, parse_options

TABLES = {"vllm": VLLM_CONNECTOR, "tier": VLLM_TIER, "sglang": SGLANG}
NUMBERS = {"vllm": ("fetch_timeout_s",), "tier": ("fetch_timeout_s", "verdict_ttl_s"),
           "sglang": ("fetch_timeout_s", "generation_refresh_s")}


@pytest.mark.parametrize("table", TABLES)
def test_an_unknown_key_is_an_error_naming_it(table):
    with pytest.raises(OptionError, match="fetch_timeout'") as e:
        TABLES[table].parse({"fetch_timeout": 5})
    assert e.value.key == "fetch_timeout" and isinstance(e.value, ValueError)  # (what callers catch)


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -1, 0, -0.0, 1e12, True, "5"])
def test_numbers_that_are_not_finite_positive_and_in_range_are_refused(table, bad):
    for name in NUMBERS[table]:
        with pytest.raises(OptionError, match=name) as e:
            TABLES[table].parse({name: bad})
        assert e.value.key == name


@pytest.mark.parametrize("table", TABLES)
def test_numbers_in_range_are_taken_as_given(table):
    for name in NUMBERS[table]:
        field = next(f for f in TABLES[table].fields if f.name == name)
        assert math.isfinite(field.max)  # every number of every table has an upper bound
        for good in (0.001, 1, 2.5, field.max):
            assert TABLES[table].parse({name: good})[name] == good
        with pytest.raises(OptionError, match=name):
            TABLES[table].parse({name: field.max * 1.01})


def test_the_deadline_bound_is_the_clients():
    from kvmesh.client import MAX_DEADLINE_S as client_bound

    assert MAX_DEADLINE_S == client_bound


@pytest.mark.parametrize("table", TABLES)
def test_strings_are_non_empty_strings(table):
    for bad in ("", 5, True, b"x", ["a"]):
        with pytest.raises(OptionError, match="redis_url"):
            TABLES[table].parse({"redis_url": bad})
    assert TABLES[table].parse({"redis_url": "redis://127.0.0.1:6379"})["redis_url"] == "redis://127.0.0.1:6379"


def test_bool_is_not_an_int_and_an_int_is_not_a_bool():
    for bad in (True, False, 1.0, "256", 0, -256):
        with pytest.raises(OptionError, match="chunk_tokens"):
            VLLM_CONNECTOR.parse({"chunk_tokens": bad})
    assert VLLM_CONNECTOR.parse({"chunk_tokens": 256})["chunk_tokens"] == 256
    for bad in (1, 0, "true"):
        with pytest.raises(OptionError, match="cost_model"):
            VLLM_CONNECTOR.parse({"cost_model": bad})
    with pytest.raises(OptionError, match="enable_kv_events"):
        VLLM_TIER.parse({"enable_kv_events": 1})
    assert VLLM_CONNECTOR.parse({"cost_model": False})["cost_model"] is False


@pytest.mark.parametrize("table", TABLES)
def test_defaults_are_applied_and_none_is_not_given(table):
    t = TABLES[table]
    expected = {f.name: f.default for f in t.fields if f.default is not None}
    assert t.parse(None) == t.parse({}) == expected
    assert t.parse({f.name: None for f in t.fields}) == expected
    assert {"vllm": {"load_mode": "async", "cost_model": True, "kv_format": "engine"},
            "tier": {"verdict_ttl_s": 10.0}, "sglang": {"generation_refresh_s": 1.0}}[table] == expected


def test_the_connectors_defaults_are_its_options_defaults():
    assert parse_options(None) == ConnectorOptions()
    fields = {f.name: f.default for f in dataclasses.fields(ConnectorOptions)}
    assert fields == {f.name: f.default for f in VLLM_CONNECTOR.fields}


def test_choices_and_forbidden_characters():
    for name, bad in (("load_mode", "eager"), ("save_copy", "later"), ("kv_format", "raw"), ("load_mode", 5)):
        with pytest.raises(OptionError, match=name):
            parse_options({name: bad})
    with pytest.raises(OptionError, match="cache_salt"):
        parse_options({"cache_salt": "a\x00b"})
    tier = VLLM_TIER.with_choices("locality", ("local", "remote"))
    assert tier.parse({"locality": "local"})["locality"] == "local"
    with pytest.raises(OptionError, match="locality"):
        tier.parse({"locality": "far"})
    assert VLLM_TIER.parse({"locality": "far"})["locality"] == "far"  # (the table itself is unchanged)


def test_foreign_keys_are_accepted_by_name_only():
    # the vLLM connector: MultiConnector's own key
    assert parse_options({"connectors": [{"kv_connector": "X"}]}) == ConnectorOptions()
    # SGLang's own keys in its extra_config: the loader's and the cache controller's
    sglang_own = {"backend_name": "kvmesh", "module_path": "kvmesh.integrations.sglang",
                  "class_name": "KVMeshStorage", "interface_v1": 1, "prefetch_threshold": 16,
                  "prefetch_timeout_base": 1, "prefetch_timeout_per_ki_token": 0.25,
                  "hicache_storage_pass_prefix_keys": True}
    assert set(sglang_own) == set(SGLANG_KEYS)
    assert SGLANG.parse({**sglang_own, "fetch_timeout_s": 10}) == {"generation_refresh_s": 1.0, "fetch_timeout_s": 10}
    for near in ("interface_v2", "file_storage_path", "fetch_timeout", "connectors"):
        with pytest.raises(OptionError, match=near):
            SGLANG.parse({**sglang_own, near: 1})
    with pytest.raises(OptionError, match="backend_name"):  # the tier is not given SGLang's keys
        VLLM_TIER.parse({"backend_name": "kvmesh"})


def test_a_table_of_ones_own():
    t = OptionTable("who", "where", (Field("a", STR, "x"), Field("b", BOOL)))
    assert t.parse({"b": True}) == {"a": "x", "b": True}
    with pytest.raises(OptionError, match=r"who: unknown where key\(s\) \['c'\]"):
        t.parse({"c": 1})
    with pytest.raises(OptionError, match=r"who: where\['a'\] must be a non-empty string, got ''"):
        t.parse({"a": ""})
