"""The Ray edge: one `KVNode` actor per alive Ray node (`start`), found by name from any worker, removed by `stop`.

Actors are named `kvnode-<node id>` in the Ray namespace `kvmesh`, detached, pinned to their node with hard node
affinity, and restarted by Ray if their process dies (a restart is a new incarnation in the directory).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from kvmesh.config import KVMeshConfig
from kvmesh.forks import ForkedProcessError, inherited_ray
from kvmesh.handle import ACTOR_PREFIX, NAMESPACE, NodeHandle, NodeHello, actor_name
from kvmesh.redisconn import same_server
from kvmesh.wire import NodeInfo

__all__ = ["Mesh", "start", "stop", "node_actors", "NAMESPACE", "ACTOR_PREFIX", "actor_name"]
log = logging.getLogger("kvmesh.mesh")


@dataclass(frozen=True)
class Mesh:
    """What `start` placed: the config the nodes run with and one `NodeInfo` per node."""

    config: KVMeshConfig
    nodes: tuple[NodeInfo, ...]

    @property
    def node_ids(self) -> list[str]:
        return [n.node_id for n in self.nodes]


def _require_ray():
    import ray

    if not ray.is_initialized():
        raise RuntimeError("kvmesh needs a Ray connection: call ray.init(...) first")
    parent = inherited_ray()
    if parent is not None:  # (its calls would wait on a connection that is not there: connect's hello for 30 s)
        raise ForkedProcessError(
            f"this process was forked from process {parent}, whose Ray connection it inherited: Ray's connection "
            "does not survive a fork; start workers with multiprocessing's 'spawn' start method, or as Ray tasks "
            "or actors"
        )
    return ray


def kvnode_actor_class():
    import ray

    from kvmesh.actor import KVNodeActor  # (the node itself: imported where one is started, not by every client)

    return ray.remote(KVNodeActor)


def start(
    redis_url: str | None = None, *, config: KVMeshConfig | None = None, timeout_s: float = 60.0, **options
) -> Mesh:
    """Put exactly one KVNode on every alive Ray node; idempotent (existing nodes are kept as they are, new Ray
    nodes get one). `options` are `KVMeshConfig` fields, e.g. `cpu_bytes=`, `slot_bytes=`, `lease_s=`. Raises
    `kvmesh.DirectoryUnavailable` (a `ConnectionError`) within about 2 x `lease_s` when the directory does not
    answer, refuses AUTH or is not Redis."""
    if config is not None and not isinstance(config, KVMeshConfig):  # (a dict of options goes in **options)
        raise TypeError(f"config must be a kvmesh.KVMeshConfig, got {type(config).__name__}")
    ray = _require_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kvmesh.directory import probe

    cfg = config or KVMeshConfig()
    if redis_url is not None:
        options["redis_url"] = redis_url
    cfg = cfg.replace(**options)
    # before any actor is placed: a directory that cannot answer one PING within a lease cannot keep leases
    probe(cfg.redis_url, cfg.lease_s)
    _check_same_directory(ray, cfg, timeout_s)
    cls = kvnode_actor_class()
    extra = {}
    if cfg.gpu_bytes:
        # A KVNode reserves no GPU from Ray (the engines own them) but its GPU tier must see the device: keep
        # Ray from hiding it behind an empty CUDA_VISIBLE_DEVICES.
        extra["runtime_env"] = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
    placed = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        node_id = node["NodeID"]
        name = actor_name(node_id)
        host = node.get("NodeManagerAddress") or "127.0.0.1"
        placed.append(
            (
                node_id,
                cls.options(
                    name=name,
                    namespace=NAMESPACE,
                    lifetime="detached",
                    get_if_exists=True,
                    num_cpus=0,
                    max_concurrency=32,
                    max_restarts=-1,
                    max_task_retries=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                    **extra,
                ).remote(cfg.to_dict(), node_id, name, host),
            )
        )
    handles = _wait_until_up(ray, placed, timeout_s)
    hellos = [NodeHandle(h, "").hello(timeout_s) for h in handles]
    return Mesh(cfg, tuple(h.info for h in hellos))


def _check_same_directory(ray, cfg: KVMeshConfig, timeout_s: float) -> None:
    """A `start` on a mesh that is up must name its directory (`redis_url`, `key_prefix`: KVNodes that differ in
    these keep two caches that never meet): it keeps the KVNodes as they are and would give
    the Ray nodes added since another directory, splitting the cache without a word. Raises ValueError naming the
    fields that differ (never their values: a URL may hold a password)."""
    actors = node_actors()
    if not actors:
        return
    refs = [h.hello.remote() for h in actors.values()]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=min(timeout_s, 10.0))
    for ref in ready:
        try:
            running = NodeHello.unpack(ray.get(ref, timeout=1.0)).config
        except Exception:  # (a KVNode that is restarting or gone: the placement below deals with it)
            continue
        differ = [
            f
            for f, same in (("redis_url", lambda a, b: same_server(a, b) is not False), ("key_prefix", str.__eq__))
            if not same(getattr(running, f), getattr(cfg, f))
        ]
        if differ:
            raise ValueError(
                f"kvmesh is already up on this Ray cluster with another {' and '.join(differ)}: start() keeps the "
                "KVNodes that run, so nodes added since would use another directory. Call it with the running "
                "mesh's settings, or kvmesh.stop() first"
            )


def _wait_until_up(ray, placed: list, timeout_s: float) -> list:
    """The handles of the KVNodes that answered. A node that died while they started (Ray listed it alive, but
    its actor can no longer be placed there) is left out; any other failure, on a node that is still alive, is
    raised."""
    deadline = time.monotonic() + timeout_s
    refs = [h.hello.remote() for _, h in placed]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    up = []
    for (node_id, h), ref in zip(placed, refs):
        try:
            while True:
                try:
                    ray.get(ref, timeout=1.0)  # ready, or past the wait above
                    break
                except ray.exceptions.ActorUnavailableError:  # Ray could not reach the actor's process for a
                    # moment (a new actor on a loaded machine: "connection refused"): hello changes nothing, ask
                    # again until the deadline
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
                    ref = h.hello.remote()
        except Exception as e:
            if _node_alive(ray, node_id):
                lines = [line.strip() for line in str(e).splitlines() if line.strip()]
                cause = lines[-1] if lines else type(e).__name__  # (the KVNode's own error, last in Ray's text)
                raise RuntimeError(f"kvmesh.start: the KVNode on Ray node {node_id[:8]} did not start: {cause}") from e
            log.warning("kvmesh: node %s died while its KVNode started; left out (%s)", node_id, type(e).__name__)
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # already gone with its node
                pass
            continue
        up.append(h)
    return up


def _node_alive(ray, node_id: str) -> bool:
    return any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes())


def node_actors() -> dict[str, Any]:
    """node id -> actor handle, for every KVNode in the cluster."""
    ray = _require_ray()
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == NAMESPACE and a["name"].startswith(ACTOR_PREFIX):
            try:
                out[a["name"][len(ACTOR_PREFIX) :]] = ray.get_actor(a["name"], namespace=NAMESPACE)
            except ValueError:
                pass
    return out


def stop(timeout_s: float = 10.0) -> int:
    """Shut down and remove every KVNode; returns how many there were."""
    ray = _require_ray()
    actors = node_actors()
    refs = [h.shutdown.remote() for h in actors.values()]
    try:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    except Exception:
        pass
    for h in actors.values():
        try:
            ray.kill(h, no_restart=True)
        except Exception:
            pass
    return len(actors)
