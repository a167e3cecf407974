"""Arguments of kvmesh.start and kvmesh.connect that are not what the README says they take are typed errors naming
the argument ("Bad arguments raise TypeError/ValueError naming the argument"), on the session's real cluster."""

import pytest

import kvmesh

SPEC = kvmesh.KVSpec(model_id="test/public-arguments", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16",
                     chunk_tokens=4)


@pytest.mark.parametrize("config", [{"lease_s": 2.0}, "redis://127.0.0.1:6379/0"])
def test_a_config_that_is_no_kvmeshconfig_is_a_type_error_naming_it(mesh, config):
    """A dict of options passed as `config=` (the options go in **options) raised AttributeError ("'dict' object has
    no attribute 'replace'") out of connect and start, and a URL there a TypeError about str.replace's arguments."""
    with pytest.raises(TypeError, match="config must be a kvmesh.KVMeshConfig"):
        kvmesh.connect(SPEC, config=config)
    with pytest.raises(TypeError, match="config must be a kvmesh.KVMeshConfig"):
        kvmesh.start(config=config)
    client = kvmesh.connect(SPEC)  # the mesh is as it was
    try:
        assert client.lookup(list(range(8))).num_tokens == 0
    finally:
        client.close()


def test_flags_and_token_counts_that_are_not_what_they_say_are_refused(mesh):
    """A flag given as a string ("no" is truthy: allow_split="no" turned splitting on), negative token counts for the
    metrics, and `chunks` that is no sequence of tensors were taken, or failed deep inside without naming them."""
    import torch

    client = kvmesh.connect(SPEC)
    try:
        for kw in ({"allow_split": "no"}, {"cost_model": 0}, {"count": None}):
            with pytest.raises(TypeError, match=next(iter(kw))):
                client.lookup(list(range(8)), **kw)
        m = client.lookup(list(range(8)))
        with pytest.raises(TypeError, match="allow_split"):
            client.plan(m, 8, allow_split="no")
        kv = torch.zeros(SPEC.num_layers, 2, 8, SPEC.num_kv_heads, SPEC.head_dim, dtype=torch.float16)
        with pytest.raises(TypeError, match="handover"):
            client.store(list(range(8)), kv, handover="yes")
        with pytest.raises(TypeError, match="count"):
            client.lookup_keys(m.group or bytes(16), [bytes(16)], count="no")
        for args in ((-1, 0, 0), (0, -1, 0), (0, 0, -5), (0, 0, 1.5), (True, 0, 0)):
            with pytest.raises(ValueError, match="reused_local|reused_peer|recomputed"):
                client.record_request(*args)
        with pytest.raises(TypeError, match="chunks"):
            client.store_keys(bytes(16), [bytes(16)], 5)
        before = client.counts["recomputed_tokens"]
        client.record_request(0, 0, 3)
        assert client.counts["recomputed_tokens"] == before + 3
        assert client.lookup(list(range(8)), allow_split=False, cost_model=True, count=False).num_tokens == 0
    finally:
        client.close()


def test_sizes_models_and_clients_of_the_wrong_kind_are_typed_errors_naming_them(mesh):
    """scratch("x") raised a bare '<' TypeError, fetch_to_device took any min_copy_bytes, and hf's generate and
    spec_for_model an object that is no client or no model (AttributeError from deep inside)."""
    from kvmesh.integrations import hf

    client = kvmesh.connect(SPEC)
    try:
        for bad in ("x", -1, 2.5):
            with pytest.raises(ValueError, match="num_tokens"):
                client.scratch(bad)
        m = client.lookup(list(range(8)))
        with pytest.raises(ValueError, match="min_copy_bytes"):
            client.fetch_to_device(m, "cpu", min_copy_bytes="x")
        with pytest.raises(TypeError, match="model"):
            hf.spec_for_model("llama", model_id="m@1", chunk_tokens=4)
        model = hf.tiny_llama(seed=1, vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
                              intermediate_size=64, initializer_range=0.2)
        with pytest.raises(TypeError, match="client"):
            hf.generate(model, list(range(8)), max_new_tokens=1, client="x")
        assert client.scratch(8).shape[2] >= 8
    finally:
        client.close()


def test_a_device_named_by_bytes_that_are_not_utf8_is_a_value_error_naming_it(mesh):
    """fetch(device=b"\\x80") raised torch's bare UnicodeDecodeError ("'utf-8' codec can't decode byte 0x80 in
    position 24"), naming neither the argument nor what it takes (found by R6's API fuzzing, bench/chaos.py)."""
    client = kvmesh.connect(SPEC)
    try:
        m = client.lookup(list(range(8)))
        for call in (lambda d: client.fetch(m, device=d), lambda d: client.fetch_to_device(m, d)):
            with pytest.raises(ValueError, match="device must be") as e:
                call(b"\x80")
            assert not isinstance(e.value, UnicodeError), e.value
        assert client.fetch(m, device="cpu").shape[2] == 0  # the client is as it was
    finally:
        client.close()
