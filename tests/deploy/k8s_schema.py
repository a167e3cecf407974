"""Schema checks of rendered manifests without a cluster: CRDs (vendored in schemas/) as strict JSON schemas, and
Kubernetes' built-in kinds against kubernetes-validate's strict schemas."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import jsonschema
import yaml

SCHEMAS = Path(__file__).parent / "schemas"
KUBERNETES_VERSION = "1.33"
CRDS = {
    ("ray.io/v1", "RayCluster"): "kuberay-v1.7.0-ray.io_rayclusters.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): "prometheus-operator-v0.93.0-monitoring.coreos.com_podmonitors.yaml",
}


def strict(node):
    """openAPIV3Schema (structural) -> JSON schema in which unknown fields are errors."""
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict(v) for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_schema(api_version: str, kind: str) -> dict:
    crd = yaml.safe_load((SCHEMAS / CRDS[(api_version, kind)]).read_text())
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = strict(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
    # what the API server checks of every object's metadata, and the type fields
    schema["properties"]["apiVersion"] = {"const": api_version}
    schema["properties"]["kind"] = {"const": kind}
    schema["properties"]["metadata"] = {
        "type": "object", "required": ["name"],
        "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253},
                       "namespace": {"type": "string"},
                       "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                       "annotations": {"type": "object", "additionalProperties": {"type": "string"}}},
        "additionalProperties": False}
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata", "spec"})
    jsonschema.Draft7Validator.check_schema(schema)
    return schema


def errors(doc: dict) -> list[str]:
    """Every schema error of one manifest, as 'Kind/name: path: message' lines; [] when it is valid."""
    import kubernetes_validate

    key = (doc.get("apiVersion"), doc.get("kind"))
    where = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
    if key in CRDS:
        v = jsonschema.Draft7Validator(crd_schema(*key))
        return [f"{where}: {'/'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{where}: {'/'.join(map(str, e.absolute_path))}: {e.message}"]
    return []


def pod_template_errors(template: dict, where: str) -> list[str]:
    """A pod template checked a second time, against Kubernetes' own PodTemplateSpec schema (strict)."""
    import kubernetes_validate

    doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"}, "template": template}
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{where}: {'/'.join(map(str, e.absolute_path))}: {e.message}"]
    return []
