"""SGLang's HiCache L3 backend tests: SGLang 0.5.23's own classes on CPU (make test-sglang builds .venv-sglang).

The CPU shims (tests/sglang/shims, never in kvmesh/) go on PYTHONPATH before anything imports SGLang or starts
Ray, so Ray workers and SGLang's spawned processes load them too.
"""

import os
import sys

SHIMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shims")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SHIMS, os.environ.get("PYTHONPATH")) if p)
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
if SHIMS not in sys.path:
    sys.path.insert(0, SHIMS)

import contextlib
import importlib.util  # noqa: E402

import pytest  # noqa: E402

if importlib.util.find_spec("sglang") is None:  # the core venv: these run under `make test-sglang`
    collect_ignore_glob = ["test_*.py"]
else:
    import kvmesh_sglang_shims  # noqa: F401,E402

MiB = 1 << 20


@contextlib.contextmanager
def sgl_mesh(redis_url: str, **settings):
    """A real 3-node Ray cluster (the driver on the head) with one KVNode per node; `settings` override the KVNodes'
    settings below."""
    import kvmesh
    from kvmesh.local import LocalRayCluster

    cluster = LocalRayCluster(3, num_cpus=1, object_store_bytes=100 * MiB)
    mesh = kvmesh.start(redis_url, **{**dict(cpu_bytes=8 * MiB, slot_bytes=64 * 1024, lease_s=2.0, heartbeat_s=0.5,
                                             node_refresh_s=0.2, fetch_timeout_s=5.0, key_prefix="sgl"), **settings})
    yield cluster, mesh
    kvmesh.stop()
    cluster.shutdown()


@pytest.fixture(scope="module")
def sgl_cluster(redis_server):
    """`sgl_mesh` for one test module."""
    with sgl_mesh(redis_server.url) as both:
        yield both
