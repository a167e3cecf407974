"""The Helm chart, checked without a cluster: `helm lint`, `helm template` for the default values and the examples,
every rendered manifest against its schema (KubeRay's and the Prometheus Operator's CRDs, vendored; Kubernetes'
built-in kinds through kubernetes-validate), values.schema.json, and the rendered kvmesh configuration read by
kvmesh's own loader."""

from __future__ import annotations

import base64
import json
import re
import subprocess
from pathlib import Path

import pytest
import redis
import yaml

from kvmesh import redisconn
from kvmesh.config import KVMeshConfig
from tests.deploy import k8s_schema
from tests.deploy.conftest import CHART, ROOT, by_kind, one

EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
GPU_EXAMPLE = CHART / "examples" / "gpu-external-redis-tls.yaml"
TLS_EXAMPLE = CHART / "examples" / "internal-redis-tls-persistent.yaml"
PODMONITOR_API = ("--api-versions", "monitoring.coreos.com/v1/PodMonitor")

SCENARIOS = {
    "default": (),
    "gpu-external-redis-tls": ("-f", str(GPU_EXAMPLE)),
    "internal-redis-tls-persistent": ("-f", str(TLS_EXAMPLE)),
    "prometheus-operator-present": PODMONITOR_API,
    "no-auth-external-url": ("--set", "redis.enabled=false", "--set", "externalRedis.url=redis://10.0.0.5:6379/2",
                             "--set", "externalRedis.caSecret=ca", "--set", "ray.enableInTreeAutoscaling=true"),
    "gcs-ft-elsewhere": ("--set", "ray.gcsFaultToleranceOptions.redisAddress=redis://gcs-redis:6379",
                         "--set", "ray.gcsFaultToleranceOptions.externalStorageNamespace=ray-gcs"),
}


def ray_containers(rc: dict) -> list[dict]:
    spec = rc["spec"]
    pods = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    return [p["spec"]["containers"][0] for p in pods]


def env_of(container: dict) -> dict:
    return {e["name"]: e for e in container["env"]}


def resolve_env(container: dict, secrets: dict[str, str]) -> dict[str, str]:
    """The environment a container would see: secretKeyRefs from `secrets`, $(VAR) references expanded."""
    out: dict[str, str] = {}
    for e in container["env"]:
        if "valueFrom" in e:
            ref = e["valueFrom"]["secretKeyRef"]
            out[e["name"]] = secrets[f"{ref['name']}/{ref['key']}"]
        else:
            out[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out[m.group(1)], e["value"])
    return out


def test_helm_from_the_registry_is_the_pinned_release(chart):
    from tests.deploy.get_helm import HELM_VERSION

    assert chart.run("version", "--short").stdout.startswith(HELM_VERSION)


@pytest.mark.parametrize("values", [None, *EXAMPLES], ids=lambda p: p.name if p else "default")
def test_helm_lint(chart, values):
    args = ["lint", "--strict", str(CHART)] + (["-f", str(values)] if values else [])
    out = chart.run(*args).stdout
    assert "1 chart(s) linted, 0 chart(s) failed" in out


@pytest.mark.parametrize("name", SCENARIOS)
def test_rendered_manifests_pass_schema_validation(chart, name):
    docs = chart.template(*SCENARIOS[name])
    assert docs
    problems = [p for d in docs for p in k8s_schema.errors(d)]
    rc = one(docs, "RayCluster")
    groups = [("head", rc["spec"]["headGroupSpec"])] + [(g["groupName"], g) for g in rc["spec"]["workerGroupSpecs"]]
    for where, g in groups:
        problems += k8s_schema.pod_template_errors(g["template"], f"RayCluster {where}")
    assert problems == []


def test_schema_checks_can_fail(chart):
    """The validators reject what the API server would: unknown fields (strict), wrong types, missing fields."""
    docs = chart.template(*PODMONITOR_API)
    rc, sts, pm = (one(docs, k) for k in ("RayCluster", "StatefulSet", "PodMonitor"))
    cm = by_kind(docs, "ConfigMap")[0]
    rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    rc["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    assert len(k8s_schema.errors(rc)) == 2
    del rc["spec"]["headGroupSpec"]
    assert any("headGroupSpec" in e for e in k8s_schema.errors(rc))
    sts["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "6379"
    assert k8s_schema.errors(sts)
    cm["data"]["x"] = 1
    assert k8s_schema.errors(cm)
    pm["spec"]["podMetricsEndpoints"][0]["portt"] = "metrics"
    assert k8s_schema.errors(pm)
    tmpl = one(chart.template(), "RayCluster")["spec"]["headGroupSpec"]["template"]
    tmpl["spec"]["volumes"][0]["emptyDir"]["medium"] = {"not": "a string"}
    assert k8s_schema.pod_template_errors(tmpl, "head")


def test_default_values_render_redis_and_raycluster(chart):
    docs = chart.template()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "ConfigMap", "RayCluster", "Secret", "Service", "Service", "Service",
                     "StatefulSet"]
    rc = one(docs, "RayCluster")
    assert rc["apiVersion"] == "ray.io/v1" and rc["metadata"]["name"] == "kv-kvmesh"
    assert by_kind(docs, "PodMonitor") == []  # no Prometheus Operator in a plain `helm template`
    secret = one(docs, "Secret")
    password = base64.b64decode(secret["data"]["redis-password"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{32}", password)  # URL-safe: it goes into redis://:<password>@
    sts = one(docs, "StatefulSet")
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert '--requirepass "$REDIS_PASSWORD"' in args and "--tls-port" not in args
    assert "volumeClaimTemplates" not in sts["spec"]


def test_head_runs_the_keeper_then_kuberays_ray_start(chart):
    docs = chart.template()
    rc = one(docs, "RayCluster")
    head = rc["spec"]["headGroupSpec"]["template"]
    assert head["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    c = head["spec"]["containers"][0]
    script = c["args"][0]
    assert c["command"] == ["/bin/bash", "-c", "--"]
    assert "python /etc/kvmesh/kvmesh_keeper.py --address auto" in script
    assert script.rstrip().endswith('exec /bin/bash -c "$KUBERAY_GEN_RAY_START_CMD"')
    subprocess.run(["bash", "-n", "-c", script], check=True)  # the shell script parses
    cm = next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == "kv-kvmesh-config")
    assert cm["data"]["kvmesh_keeper.py"] == (ROOT / "cluster" / "kvmesh_keeper.py").read_text()
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts["/etc/kvmesh"] == "kvmesh-config" and mounts["/dev/shm"] == "dshm"
    # workers keep KubeRay's own command
    for g in rc["spec"]["workerGroupSpecs"]:
        assert "command" not in g["template"]["spec"]["containers"][0]


def test_services_and_podmonitor_point_at_declared_ports(chart):
    docs = chart.template(*PODMONITOR_API)
    rc = one(docs, "RayCluster")
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    dash = next(s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "kv-kvmesh-dashboard")
    assert dash["spec"]["selector"] == {"ray.io/cluster": "kv-kvmesh", "ray.io/node-type": "head"}
    head_ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert head_ports[dash["spec"]["ports"][0]["targetPort"]] == 8266
    pm = one(docs, "PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"] == {"ray.io/cluster": "kv-kvmesh"}
    for c in ray_containers(rc):  # every Ray pod exports Ray's (and so kvmesh's) metrics on the scraped port
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"] == 8080
    for g in [rc["spec"]["headGroupSpec"]] + rc["spec"]["workerGroupSpecs"]:
        assert g["rayStartParams"]["metrics-export-port"] == "8080"
    redis_svc = next(s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "kv-kvmesh-redis")
    sts = one(docs, "StatefulSet")
    assert redis_svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert sts["spec"]["selector"]["matchLabels"] == redis_svc["spec"]["selector"]
    assert sts["spec"]["serviceName"] == "kv-kvmesh-redis-headless"


def test_podmonitor_follows_the_prometheus_operator(chart):
    assert by_kind(chart.template(), "PodMonitor") == []
    assert len(by_kind(chart.template(*PODMONITOR_API), "PodMonitor")) == 1
    assert by_kind(chart.template(*PODMONITOR_API, "--set", "metrics.podMonitor.enabled=false"), "PodMonitor") == []
    assert len(by_kind(chart.template("--set", "metrics.podMonitor.enabled=true"), "PodMonitor")) == 1


def test_grafana_dashboard_configmap_is_the_generated_dashboard(chart):
    chart_copy = CHART / "files" / "grafana" / "kvmesh.json"
    source = ROOT / "cluster" / "grafana" / "kvmesh.json"
    assert chart_copy.read_bytes() == source.read_bytes(), \
        "helm/kvmesh/files/grafana/kvmesh.json differs from cluster/grafana/kvmesh.json: copy it over"
    cm = next(d for d in by_kind(chart.template(), "ConfigMap") if d["metadata"]["name"].endswith("grafana-dashboard"))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvmesh.json"]) == json.loads(source.read_text())
    off = chart.template("--set", "metrics.grafanaDashboard.enabled=false")
    assert not [d for d in by_kind(off, "ConfigMap") if d["metadata"]["name"].endswith("grafana-dashboard")]


def test_keeper_copy_in_the_chart_equals_cluster_keeper():
    assert (CHART / "files" / "kvmesh_keeper.py").read_bytes() == (ROOT / "cluster" / "kvmesh_keeper.py").read_bytes(), \
        "helm/kvmesh/files/kvmesh_keeper.py differs from cluster/kvmesh_keeper.py: copy it over"


def _rendered_config(docs: list[dict], tmp_path: Path, secrets: dict[str, str]) -> list[KVMeshConfig]:
    cm = next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-config"))
    path = tmp_path / "kvmesh.yaml"
    path.write_text(cm["data"]["kvmesh.yaml"])
    cfgs = []
    for c in ray_containers(one(docs, "RayCluster")):
        env = resolve_env(c, secrets)
        assert env["KVMESH_CONFIG"] == "/etc/kvmesh/kvmesh.yaml"
        cfgs.append(KVMeshConfig.load(str(path), env={k: v for k, v in env.items() if k != "KVMESH_CONFIG"}))
    return cfgs


def test_rendered_configuration_loads_in_kvmesh(chart, tmp_path):
    """The ConfigMap and env of every Ray container, read by KVMeshConfig.load as a pod would."""
    docs = chart.template("--set", "kvmesh.config.lease_s=8", "--set", "kvmesh.config.heartbeat_s=2")
    secret = one(docs, "Secret")
    pw = base64.b64decode(secret["data"]["redis-password"]).decode()
    for cfg in _rendered_config(docs, tmp_path, {"kv-kvmesh-redis/redis-password": pw}):
        assert cfg.redis_url == f"redis://:{pw}@kv-kvmesh-redis.llm.svc:6379/0"
        assert cfg.key_prefix == "kv" and cfg.cpu_bytes == 1 << 30 and cfg.lease_s == 8.0
        kw = redis.Redis.from_url(cfg.redis_url).connection_pool.connection_kwargs
        assert (kw["host"], kw["port"], kw["password"], kw["db"]) == ("kv-kvmesh-redis.llm.svc", 6379, pw, 0)


def test_tls_urls_carry_the_mounted_ca(chart, tmp_path, monkeypatch):
    docs = chart.template("-f", str(TLS_EXAMPLE))
    pw = "p" * 32
    for cfg, c in zip(_rendered_config(docs, tmp_path, {"kv-kvmesh-redis/redis-password": pw}),
                      ray_containers(one(docs, "RayCluster"))):
        assert cfg.redis_url.startswith("rediss://")
        kw = redis.Redis.from_url(cfg.redis_url).connection_pool.connection_kwargs
        assert kw["ssl_ca_certs"] == "/etc/kvmesh-redis-tls/ca.crt"
        assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/etc/kvmesh-redis-tls"}
    sts = one(docs, "StatefulSet")
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert "--port 0 --tls-port 6379" in args and "--appendonly yes" in args
    # Redis's own default, said explicitly: groups of up to 512 chunks in listpacks (~20 bytes an entry, P6)
    assert "--hash-max-ziplist-entries 512" in args
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "4Gi"
    # external Redis with a CA Secret: the URL gets ssl_ca_certs, the CA is mounted
    docs = chart.template("--set", "redis.enabled=false", "--set", "externalRedis.url=rediss://r.example:6380/1?x=1",
                          "--set", "externalRedis.caSecret=redis-ca")
    assert not by_kind(docs, "StatefulSet") and not by_kind(docs, "Secret")
    for cfg in _rendered_config(docs, tmp_path, {}):
        assert cfg.redis_url == "rediss://r.example:6380/1?x=1&ssl_ca_certs=/etc/kvmesh-redis-tls/ca.crt"
    # the URL kept whole in a Secret of the user's (which cannot know where the chart mounts the CA): the pods are
    # told the CA's path apart, and kvmesh's directory client uses it for a rediss:// URL that names none
    docs = chart.template("--set", "redis.enabled=false", "--set", "externalRedis.existingSecret=my-url",
                          "--set", "externalRedis.caSecret=redis-ca")
    url = "rediss://:pw@r.example:6380/1"
    for c in ray_containers(one(docs, "RayCluster")):
        env = resolve_env(c, {"my-url/redis-url": url})
        assert env["KVMESH_REDIS_URL"] == url and env[redisconn.CA_ENV] == "/etc/kvmesh-redis-tls/ca.crt"
        assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/etc/kvmesh-redis-tls"}
        monkeypatch.setenv(redisconn.CA_ENV, env[redisconn.CA_ENV])
        kw = redisconn.connect(url).connection_pool.connection_kwargs
        assert kw["ssl_ca_certs"] == "/etc/kvmesh-redis-tls/ca.crt" and kw["password"] == "pw"
        # a URL that names its own CA keeps it; a plaintext URL gets none
        assert redisconn.connect(url + "?ssl_ca_certs=/mine.crt").connection_pool.connection_kwargs[
            "ssl_ca_certs"] == "/mine.crt"
        assert "ssl_ca_certs" not in redisconn.connect("redis://r.example:6379/0").connection_pool.connection_kwargs
    for c in ray_containers(one(chart.template(), "RayCluster")):  # no CA anywhere: not set
        assert redisconn.CA_ENV not in resolve_env(c, {"kv-kvmesh-redis/redis-password": "x"})


def test_gpu_external_redis_example(chart, tmp_path):
    docs = chart.template("-f", str(GPU_EXAMPLE))
    assert not by_kind(docs, "StatefulSet") and not by_kind(docs, "Secret")
    rc = one(docs, "RayCluster")
    (gpu,) = rc["spec"]["workerGroupSpecs"]
    c = gpu["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8 and c["resources"]["limits"]["cpu"] == "64"
    assert gpu["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert gpu["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert rc["spec"]["enableInTreeAutoscaling"] is True
    assert env_of(c)["KVMESH_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "kvmesh-redis-url",
                                                                         "key": "redis-url"}
    url = "rediss://kvmesh:pw@redis.example.internal:6380/0?ssl_ca_certs=/etc/kvmesh-redis-tls/ca.crt"
    for cfg in _rendered_config(docs, tmp_path, {"kvmesh-redis-url/redis-url": url}):
        assert cfg.redis_url == url and cfg.key_prefix == "kvmesh-prod" and cfg.cpu_bytes == 32 << 30
    assert one(docs, "PodMonitor")["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_kvmesh_directory_is_not_the_gcs_redis(chart, tmp_path):
    docs = chart.template(*SCENARIOS["gcs-ft-elsewhere"])
    rc = one(docs, "RayCluster")
    assert rc["spec"]["gcsFaultToleranceOptions"]["redisAddress"] == "redis://gcs-redis:6379"
    for cfg in _rendered_config(docs, tmp_path, {"kv-kvmesh-redis/redis-password": "x" * 32}):
        assert "gcs-redis" not in cfg.redis_url and cfg.key_prefix == "kv"
    # two releases in one namespace: their own Redis and their own key prefix
    other = chart.template(release="other")
    assert env_of(ray_containers(one(other, "RayCluster"))[0])["KVMESH_KEY_PREFIX"]["value"] == "other"


@pytest.mark.parametrize("args, message", [
    (("--set", "redis.enabled=false"), "externalRedis"),
    (("--set", "kvmesh.config.redis_url=redis://x"), "redis_url"),
    (("--set", "metrics.podMonitor.enabled=maybe"), "podMonitor"),
    (("--set", "kvmesh.dashboard.port=70000"), "port"),
    (("--set", "redsi.enabled=true"), "redsi"),
    (("--set", "redis.tls.enabled=true"), "existingSecret"),
    (("--set", "externalRedis.url=http://x", "--set", "redis.enabled=false"), "url"),
])
def test_bad_values_are_refused(chart, args, message):
    p = chart.run("template", "kv", str(CHART), *args, check=False)
    assert p.returncode != 0 and message in p.stderr, p.stderr


def test_bad_kvmesh_options_fail_in_kvmesh_with_a_clear_error(chart, tmp_path):
    """values.schema.json only knows option names' shape; kvmesh's loader names the bad one."""
    docs = chart.template("--set", "kvmesh.config.cpu_byts=1GiB")
    with pytest.raises(ValueError, match="unknown option 'cpu_byts'"):
        _rendered_config(docs, tmp_path, {"kv-kvmesh-redis/redis-password": "x" * 32})


def test_values_schema_is_valid_json_schema():
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(values)
    for ex in EXAMPLES:  # examples are overrides: merged over the defaults, they validate too
        merged = _merge(values, yaml.safe_load(ex.read_text()))
        jsonschema.Draft7Validator(schema).validate(merged)


def _merge(a, b):
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _merge(a.get(k), b[k]) if k in b else a[k] for k in {*a, *b}}
    return b
