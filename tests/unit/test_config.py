"""KVMeshConfig: what a config file, the environment or another process's config may say, and what is refused."""

import math

import msgpack
import pytest

from kvmesh.config import KVMeshConfig

DURATIONS = ["lease_s", "heartbeat_s", "pin_ttl_s", "fetch_timeout_s", "lookup_timeout_s", "node_refresh_s",
             "replicate_window_s"]


@pytest.mark.parametrize("name,text", [(n, t) for n in DURATIONS for t in ("nan", "inf", "1e12")]
                         + [("last_copy_window_s", "nan"), ("last_copy_window_s", "inf")])
def test_a_duration_that_is_no_number_of_seconds_is_refused_naming_the_option(name, text):
    """Before, nan and inf loaded: a KVNode then died at start (OverflowError turning a lease into milliseconds),
    `pin_ttl_s=inf` killed every data-server connection (`settimeout(inf)`: 0 % peer reuse, silently), and an
    infinite lookup timeout raised out of connect."""
    with pytest.raises(ValueError, match=name):
        KVMeshConfig.load(env={f"KVMESH_{name.upper()}": text})
    with pytest.raises(ValueError, match=name):
        KVMeshConfig(**{name: float(text)})


def test_durations_up_to_a_day_are_taken():
    cfg = KVMeshConfig(pin_ttl_s=86400.0, fetch_timeout_s=86400, lease_s=600, last_copy_window_s=0)
    assert cfg.pin_ttl_s == 86400.0 and not math.isinf(cfg.fetch_timeout_s)


@pytest.mark.parametrize("option", ["shm_dir", "key_prefix", "disk_dir", "cpu_bytes", "lease_s"])
def test_an_option_left_empty_in_the_config_file_is_refused_naming_it(tmp_path, option):
    """`shm_dir:` with nothing after it is YAML's null. It read as the string "None": the slab went to ./None
    (on disk, not in shared memory), the keys to prefix "None:" (where `kvmesh status` sees nothing)."""
    path = tmp_path / "kvmesh.yaml"
    path.write_text(f"{option}:\n")
    with pytest.raises(ValueError, match=f"{option}.*no value"):
        KVMeshConfig.load(str(path), env={})


def test_a_rate_in_bytes_takes_units():
    cfg = KVMeshConfig.load(env={"KVMESH_RECOMPUTE_BYTES_PER_S": "256MiB"})
    assert cfg.recompute_bytes_per_s == 256 << 20


def test_a_config_of_a_later_release_with_more_options_is_read(caplog):
    """An engine's kvmesh one release behind the cluster's: the KVNode's hello carries its whole config, and an
    option added since made `NodeHello.unpack` raise TypeError out of `kvmesh.connect`. Readers leave out what
    they do not know (the wire's rule), and say so once."""
    from kvmesh.handle import NodeHello
    from kvmesh.wire import NodeInfo

    cfg = KVMeshConfig(cpu_bytes=8 << 20, slot_bytes=1 << 20)
    info = NodeInfo("n" * 32, "kvnode-n", "/dev/shm/x", 8 << 20, 1 << 20, "127.0.0.1:1", incarnation=3)
    o = msgpack.unpackb(NodeHello(info, cfg).pack(), raw=False)
    o[3]["an_option_of_the_next_release"] = 1
    with caplog.at_level("WARNING", logger="kvmesh"):
        hello = NodeHello.unpack(msgpack.packb(o, use_bin_type=True))
    assert hello.config == cfg and hello.info.incarnation == 3
    assert "an_option_of_the_next_release" in caplog.text


@pytest.mark.parametrize("text,option", [("io_threads: 2.5", "io_threads"), ("io_threads: true", "io_threads"),
                                         ("pin_ttl_s: true", "pin_ttl_s"), ("key_prefix: [a]", "key_prefix"),
                                         ("shm_dir: {a: 1}", "shm_dir"), ("redis_url: false", "redis_url"),
                                         ("cpu_bytes: true", "cpu_bytes")])
def test_a_config_file_value_of_the_wrong_type_is_refused_not_coerced(tmp_path, text, option):
    """`io_threads: 2.5` loaded as 2, `pin_ttl_s: true` as 1.0 and `key_prefix: [a]` as the prefix "['a']" (every
    key then under `['a']:`, where `kvmesh status --key-prefix a` finds nothing): the constructor refuses a bool
    or a string of the wrong type, the file did not."""
    path = tmp_path / "kvmesh.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError, match=option):
        KVMeshConfig.load(str(path), env={})


def test_a_config_file_of_well_typed_values_still_loads(tmp_path):
    path = tmp_path / "kvmesh.yaml"
    path.write_text("io_threads: 4\nlease_s: 6\nheartbeat_s: 1.5\ncpu_bytes: 1.5GiB\nkey_prefix: 123\n"
                    "promote_on_hit: no\ncoalesce_pulls: true\nslot_bytes: 1048576\nio_threads: 3.0\n")
    cfg = KVMeshConfig.load(str(path), env={})
    assert (cfg.io_threads, cfg.lease_s, cfg.cpu_bytes, cfg.key_prefix) == (3, 6.0, 3 << 29, "123")
    assert cfg.promote_on_hit is False and cfg.coalesce_pulls is True and cfg.slot_bytes == 1 << 20
