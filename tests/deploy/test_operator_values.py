"""Values an operator plausibly sets, rendered as `helm template` would for them: each must reach the pods as
configured (or be refused at render time), never be dropped or rewritten by KubeRay, and never put a password in
plain text into a manifest that is not a Secret."""

from __future__ import annotations

import pytest
import yaml

from kvmesh.config import KVMeshConfig
from tests.deploy import k8s_schema
from tests.deploy.conftest import CHART, by_kind, one
from tests.deploy.test_helm import _rendered_config


def _values(tmp_path, values: dict) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def _problems(docs: list[dict]) -> list[str]:
    problems = [p for d in docs for p in k8s_schema.errors(d)]
    rc = one(docs, "RayCluster")
    for g in [rc["spec"]["headGroupSpec"]] + rc["spec"]["workerGroupSpecs"]:
        problems += k8s_schema.pod_template_errors(g["template"], "RayCluster pod")
    return problems


def _kuberay_desired_replicas(group: dict) -> int:
    """What the KubeRay operator makes of a worker group (ray-operator utils.GetWorkerGroupDesiredReplicas): replicas
    clamped into [minReplicas, maxReplicas], maxReplicas when minReplicas > maxReplicas."""
    lo, hi, n = group["minReplicas"], group["maxReplicas"], group["replicas"]
    if lo > hi:
        return hi
    return min(max(n, lo), hi)


# -- worker counts -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("replicas", [12, 1])
def test_worker_replicas_are_the_pods_kuberay_runs(chart, tmp_path, replicas):
    """Scale out as NOTES.txt and the README say (raise a group's replicas in a values file): without the
    autoscaler, the RayCluster must ask KubeRay for that many pods. KubeRay clamps replicas into [minReplicas,
    maxReplicas] (default 0..8), so replicas: 12 ran 8 pods without a word."""
    group = {"name": "workers", "replicas": replicas, "minReplicas": 2, "maxReplicas": 8}
    docs = chart.template("-f", _values(tmp_path, {"ray": {"workerGroups": [group]}}))
    (g,) = one(docs, "RayCluster")["spec"]["workerGroupSpecs"]
    assert _kuberay_desired_replicas(g) == replicas


@pytest.mark.parametrize("group", [
    {"name": "workers", "replicas": 12, "minReplicas": 0, "maxReplicas": 8},
    {"name": "workers", "replicas": 1, "minReplicas": 2, "maxReplicas": 8},
    {"name": "workers", "replicas": 2, "minReplicas": 4, "maxReplicas": 2},
])
def test_autoscaled_worker_counts_outside_their_bounds_are_refused(chart, tmp_path, group):
    """With the autoscaler the bounds are the operator's, so replicas outside them (which KubeRay clamps) or
    minReplicas > maxReplicas are refused at render time, naming the group."""
    values = {"ray": {"enableInTreeAutoscaling": True, "workerGroups": [group]}}
    p = chart.run("template", "kv", str(CHART), "-f", _values(tmp_path, values), check=False)
    assert p.returncode != 0 and "workers" in p.stderr and "maxReplicas" in p.stderr, p.stderr


# -- extra environment ---------------------------------------------------------------------------------------------
def test_extra_env_values_of_any_yaml_type_render_valid_containers(chart, tmp_path):
    """kvmesh.env is "extra environment (KVMESH_* variables win over the config file)": a numeric or boolean value,
    as `--set kvmesh.env[0].value=4` or a values file writes it, rendered as a YAML number/boolean, which the API
    server refuses (EnvVar.value is a string)."""
    env = [{"name": "KVMESH_IO_THREADS", "value": 4}, {"name": "KVMESH_PROMOTE_ON_HIT", "value": False},
           {"name": "KVMESH_PULL_BATCH_BYTES", "value": 1000000}, {"name": "KVMESH_LEASE_S", "value": 7.5}]
    docs = chart.template("-f", _values(tmp_path, {"kvmesh": {"env": env}}))
    assert _problems(docs) == []
    docs = chart.template("--set", "kvmesh.env[0].name=KVMESH_IO_THREADS", "--set", "kvmesh.env[0].value=4")
    assert _problems(docs) == []
    secrets = {"kv-kvmesh-redis/redis-password": "x" * 32}
    docs = chart.template("-f", _values(tmp_path, {"kvmesh": {"env": env}}))
    for cfg in _rendered_config(docs, tmp_path, secrets):
        assert (cfg.io_threads, cfg.promote_on_hit, cfg.pull_batch_bytes, cfg.lease_s) == (4, False, 1000000, 7.5)


# -- external Redis password ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("url", ["redis://:s3cretPassw0rd@redis.example:6379/0",
                                 "rediss://kvmesh:s3cretPassw0rd@redis.example:6380/0?cluster=1",
                                 "redis://redis.example:6379/0?password=s3cretPassw0rd"])
def test_external_redis_password_is_only_in_a_secret(chart, tmp_path, url):
    """externalRedis.url with a password went as plain text into the RayCluster (and so every pod spec): readable by
    anyone who may read RayClusters or pods, which RBAC grants far more widely than Secrets."""
    docs = chart.template("--set", "redis.enabled=false", "--set", f"externalRedis.url={url}",
                          "--set", "externalRedis.caSecret=ca")
    leaks = [f"{d['kind']}/{d['metadata']['name']}" for d in docs
             if d["kind"] != "Secret" and "s3cretPassw0rd" in yaml.safe_dump(d)]
    assert leaks == []
    assert _problems(docs) == []
    # and the pods still get the URL (with the CA) from that Secret
    import base64

    secrets = {f"{d['metadata']['name']}/{k}": base64.b64decode(v).decode()
               for d in by_kind(docs, "Secret") for k, v in d.get("data", {}).items()}
    want = url + ("&" if "?" in url else "?") + "ssl_ca_certs=/etc/kvmesh-redis-tls/ca.crt"
    for cfg in _rendered_config(docs, tmp_path, secrets):
        assert cfg.redis_url == want
    assert isinstance(KVMeshConfig(redis_url=want), KVMeshConfig)


# -- disk tier -----------------------------------------------------------------------------------------------------
def _mount_of(container: dict, path: str) -> dict | None:
    """The volumeMount that holds `path` (the deepest one), or None: `path` is on the image's own file system."""
    best = None
    for m in container["volumeMounts"]:
        mp = m["mountPath"].rstrip("/")
        if (path == mp or path.startswith(mp + "/")) and (best is None or len(mp) > len(best["mountPath"])):
            best = m
    return best


@pytest.mark.parametrize("extra", [(), ("--set", "kvmesh.diskVolume.hostPath.path=/mnt/nvme0/kvmesh",
                                        "--set", "kvmesh.diskVolume.hostPath.type=DirectoryOrCreate")])
def test_disk_tier_directory_is_a_writable_volume_on_every_ray_pod(chart, tmp_path, extra):
    """The disk tier on: kvmesh.config.disk_dir / disk_bytes reached the config file, but nothing was mounted there,
    so each KVNode had to make disk_dir on the image's root file system (not writable by the Ray image's non-root
    user outside its home; where it is, hundreds of GiB of the container's writable layer, lost with the
    container), and no value could give it a local NVMe."""
    docs = chart.template("--set", "kvmesh.config.disk_dir=/mnt/kvmesh", "--set", "kvmesh.config.disk_bytes=64GiB",
                          *extra)
    assert _problems(docs) == []
    for cfg in _rendered_config(docs, tmp_path, {"kv-kvmesh-redis/redis-password": "x" * 32}):
        assert (cfg.disk_dir, cfg.disk_bytes) == ("/mnt/kvmesh", 64 << 30)
    rc = one(docs, "RayCluster")
    pods = [rc["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in rc["spec"]["workerGroupSpecs"]]
    for pod in pods:
        m = _mount_of(pod["spec"]["containers"][0], "/mnt/kvmesh")
        assert m is not None and not m.get("readOnly"), "disk_dir is on the image's file system"
        (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == m["name"]]
        if extra:
            assert vol["hostPath"] == {"path": "/mnt/nvme0/kvmesh", "type": "DirectoryOrCreate"}
        else:
            assert "emptyDir" in vol and vol["emptyDir"].get("medium") != "Memory"
    # the disk tier off: no such volume
    for pod in [one(chart.template(), "RayCluster")["spec"]["headGroupSpec"]["template"]]:
        assert {v["name"] for v in pod["spec"]["volumes"]} == {"dshm", "kvmesh-config"}
