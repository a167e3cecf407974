"""cluster/ray-up.yaml against Ray's own cluster-config schema (ray/autoscaler/ray-schema.json, shipped in the ray
package) and through the launcher's own preparation and validation (what `ray up` does before it contacts a
machine), and cluster/bare-metal.sh, which its commands run."""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.commands import _bootstrap_config
from ray.autoscaler._private.util import validate_config

from kvmesh.config import KVMeshConfig
from tests.deploy.conftest import ROOT

RAY_UP = ROOT / "cluster" / "ray-up.yaml"
BARE = ROOT / "cluster" / "bare-metal.sh"
RAY_SCHEMA = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def config() -> dict:
    return yaml.safe_load(RAY_UP.read_text())


def test_ray_up_yaml_matches_rays_schema():
    jsonschema.Draft7Validator(RAY_SCHEMA).validate(config())
    validate_config(config())


def test_ray_up_yaml_survives_the_launchers_bootstrap():
    """prepare_config (the on-premise provider's node type, defaults), validate_config and the provider's own
    bootstrap_config: the steps of `ray up` before it reaches for the machines."""
    resolved = _bootstrap_config(config(), no_config_cache=True)
    validate_config(resolved)
    (node_type,) = resolved["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == 2 == resolved["max_workers"]
    assert resolved["head_start_ray_commands"] == config()["head_start_ray_commands"]
    assert resolved["setup_commands"] == ["bash ~/kvmesh/cluster/bare-metal.sh install"]


@pytest.mark.parametrize("mutate", [
    lambda c: c.update(setup_comands=[]),
    lambda c: c.update(head_start_ray_commands="ray start --head"),
    lambda c: c["provider"].pop("type"),
    lambda c: c.update(idle_timeout_minutes="five"),
])
def test_schema_check_can_fail(mutate):
    c = copy.deepcopy(config())
    mutate(c)
    with pytest.raises(jsonschema.ValidationError):
        validate_config(c)


def test_commands_run_the_bare_metal_script_that_the_file_mounts_carry():
    c = config()
    assert c["file_mounts"] == {"~/kvmesh": "."}  # `ray up` from the repository root
    assert ".venv" in c["rsync_exclude"]
    lines = c["setup_commands"] + c["head_start_ray_commands"] + c["worker_start_ray_commands"]
    used = {m.group(1) for line in lines for m in re.finditer(r"~/kvmesh/(\S+)", line)}
    assert used == {"cluster/bare-metal.sh"} and BARE.is_file()
    head = " ".join(c["head_start_ray_commands"])
    assert "bare-metal.sh head --autoscaling-config=~/ray_bootstrap_config.yaml" in head
    assert "bare-metal.sh worker $RAY_HEAD_IP" in " ".join(c["worker_start_ray_commands"])
    for line in lines:
        subprocess.run(["bash", "-n", "-c", line], check=True)
    # the KVMESH_* options on the head's start line are valid kvmesh options
    env = dict(w.split("=", 1) for line in c["head_start_ray_commands"]
               for w in shlex.split(line.replace(";", " ")) if w.startswith("KVMESH_"))
    assert env and KVMeshConfig.load(env=env).cpu_bytes == 8 << 30


def test_bare_metal_script_parses_and_prints_its_usage():
    subprocess.run(["bash", "-n", str(BARE)], check=True)
    p = subprocess.run(["bash", str(BARE)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "bare-metal.sh head" in p.stdout and "bare-metal.sh worker HEAD_IP" in p.stdout


def test_bare_metal_settings_are_not_read_as_kvmesh_options():
    """KVMeshConfig.load refuses unknown KVMESH_* variables: the script's own settings must use another prefix."""
    text = BARE.read_text()
    assert {m.group(1) for m in re.finditer(r"\$\{?(KVMESH_[A-Z_]+)", text)} == {"KVMESH_REDIS_URL"}
    assert set(re.findall(r"\$\{(KV_[A-Z_]+)", text)) == {
        "KV_VENV", "KV_HOME", "KV_REDIS_PORT", "KV_RAY_PORT", "KV_DASHBOARD_HOST", "KV_DASHBOARD_PORT",
        "KV_NODE_IP", "KV_PIP_ARGS"}
    KVMeshConfig.load(env={"KV_VENV": "x", "KV_HOME": "y", "KVMESH_REDIS_URL": "redis://h:6380/0"})


def test_dockerfile_installs_kvmesh_with_its_dependencies():
    """No --no-deps and no list of kvmesh's dependencies to keep in step: pip installs kvmesh with them, beside the
    base image's torch (kvmesh asks only torch>=2.4)."""
    text = (ROOT / "cluster" / "docker" / "Dockerfile").read_text()
    assert "--no-deps" not in text
    assert 'pip install --no-cache-dir "/opt/kvmesh${EXTRAS:+[$EXTRAS]}"' in text
