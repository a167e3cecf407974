"""One real 3-node Ray cluster (one raylet per node, all on 127.0.0.1) and one KVNode per node, shared by every
test of the session. Tests use their own model ids, so their chunks never collide."""

import pytest

MiB = 1 << 20


@pytest.fixture(scope="session")
def ray_cluster():
    from kvmesh.local import LocalRayCluster

    cluster = LocalRayCluster(3, num_cpus=2, object_store_bytes=200 * MiB)
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="session")
def mesh(ray_cluster, redis_server):
    import kvmesh

    m = kvmesh.start(redis_server.url, cpu_bytes=32 * MiB, slot_bytes=256 * 1024, lease_s=2.0, heartbeat_s=0.5,
                     node_refresh_s=0.2, fetch_timeout_s=5.0, key_prefix="it")
    yield m
    kvmesh.stop()


_remote_cache = {}


def on_node(node_id: str, fn, *args, **kwargs):
    """Run fn(*args, **kwargs) in a Ray task pinned to node_id (a "worker on that node") and return its result."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = _remote_cache.get(fn)
    if remote is None:
        remote = _remote_cache[fn] = ray.remote(num_cpus=0)(fn)
    ref = remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(*args,
                                                                                                           **kwargs)
    return ray.get(ref, timeout=120)
