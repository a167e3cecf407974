"""How a `KVMeshClient` is made: `connect` (in a Ray driver, task or actor: attached to the KVNode of its Ray node)
and `connect_local` (beside a KVNode object of this process, without Ray), with their checks of the config the
client ends up with: a chunk must fit the node's slots, and the client must use its node's directory."""

from __future__ import annotations

import logging
import time

from kvmesh.client import KVMeshClient
from kvmesh.config import KVMeshConfig, redact_url
from kvmesh.directory import probe
from kvmesh.handle import LocalHandle, NodeHandle, NodeUnavailable, Orphans
from kvmesh.hashing import client_salt
from kvmesh.spec import KVSpec

log = logging.getLogger("kvmesh.client")


def _resolve(
    spec: KVSpec, cfg: KVMeshConfig, redis_url, config, options, node_slot_bytes: int | None = None
) -> KVMeshConfig:
    """The client's config. `node_slot_bytes`: the slot size of the node this client attaches to, which is what a
    chunk must fit (a `slot_bytes` option changes only this client's copy of the config, not the node's slots)."""
    cfg = config or cfg
    if redis_url is not None:
        cfg = cfg.replace(redis_url=redis_url)
    cfg = cfg.replace(**options)
    slot_bytes = cfg.slot_bytes if node_slot_bytes is None else min(cfg.slot_bytes, node_slot_bytes)
    if spec.chunk_bytes > slot_bytes:
        where = "the nodes'" if node_slot_bytes is None or slot_bytes < node_slot_bytes else "this KVNode's"
        raise ValueError(
            f"spec.chunk_tokens={spec.chunk_tokens} makes {spec.chunk_bytes}-byte chunks, larger than "
            f"{where} slot_bytes={slot_bytes}; use fewer chunk_tokens, or start the KVNodes with bigger slots"
        )
    return cfg


def _check_directory(cfg: KVMeshConfig, node_cfg: KVMeshConfig) -> None:
    """A client attached to a node must use the node's directory: the node registers what the client stores, and
    lookups under another database or key prefix would never find it (a silent 0 % hit rate). Two spellings of the
    node's own (a host name and its address, another master of its Redis Cluster, another ACL user) are the same
    directory: the servers are asked where the text differs. Where the node's server cannot be asked, the client
    goes on (its own URL answered the probe), with a warning."""
    from kvmesh.redisconn import same_server

    same = (
        same_server(cfg.redis_url, node_cfg.redis_url, min(2.0, cfg.lease_s))
        if cfg.key_prefix == node_cfg.key_prefix
        else False
    )
    if same is None:
        log.warning(
            "kvmesh: could not tell whether %s is the directory of this client's KVNode (%s)",
            redact_url(cfg.redis_url),
            redact_url(node_cfg.redis_url),
        )
    elif not same:
        raise ValueError(
            f"this client's directory ({redact_url(cfg.redis_url)}, key_prefix {cfg.key_prefix!r}) is not the "
            f"one its KVNode registers in ({redact_url(node_cfg.redis_url)}, key_prefix {node_cfg.key_prefix!r}): "
            "what it stores would never be found; leave redis_url and key_prefix out"
        )


def connect(
    spec: KVSpec,
    redis_url: str | None = None,
    *,
    cache_salt: str | bytes | None = None,
    config: KVMeshConfig | None = None,
    node_id: str | None = None,
    count_fetches: bool = True,
    **options,
) -> KVMeshClient:
    """A client for `spec` in this process. Finds the KVNode on this process's Ray node (or on `node_id`: for an
    engine whose Ray connection lands elsewhere, e.g. a child process of an actor) and takes its config (directory
    URL included) unless `redis_url`/`config`/`options` say otherwise. Raises `kvmesh.DirectoryUnavailable` (a
    `ConnectionError` naming the URL, password redacted, and the cause) within about 2 x `lease_s` when the
    directory does not answer, refuses AUTH or is not Redis; once connected, directory failures are misses.
    `count_fetches=False`: the caller reports each request's reuse itself (`KVMeshClient.record_request`)."""
    if not isinstance(spec, KVSpec):
        raise TypeError(f"spec must be a kvmesh.KVSpec, got {type(spec).__name__}")
    if node_id is not None and (not isinstance(node_id, str) or not node_id):
        raise ValueError(f"node_id must be a Ray node id (hex string), got {node_id!r}")
    if not isinstance(count_fetches, bool):
        raise TypeError(f"count_fetches must be True or False, got {count_fetches!r}")
    if config is not None and not isinstance(config, KVMeshConfig):  # (a dict of options goes in **options)
        raise TypeError(f"config must be a kvmesh.KVMeshConfig, got {type(config).__name__}")
    client_salt(cache_salt)
    from kvmesh.mesh import _require_ray

    ray = _require_ray()
    named = node_id is not None
    node_id = node_id or ray.get_runtime_context().get_node_id()
    orphans = Orphans()
    local = NodeHandle.find(node_id, node_id, orphans)
    hello = None
    if local is not None:
        try:
            hello = _hello(local, time.monotonic() + 30)
        except (ConnectionError, TimeoutError) as e:
            if named:
                raise RuntimeError(f"no KVNode answers on Ray node {node_id}: {e}") from None
            local = None
    elif named:
        raise RuntimeError(f"no KVNode runs on Ray node {node_id} (call kvmesh.start first)")
    if hello is None and redis_url is None and config is None:
        raise RuntimeError("no KVNode runs on this Ray node (call kvmesh.start first) and no redis_url was given")
    cfg = _resolve(
        spec,
        hello.config if hello else KVMeshConfig(),
        redis_url,
        config,
        options,
        hello.info.slot_bytes if hello else None,
    )
    # the one time a directory failure raises: a wrong URL would otherwise read as a miss on every lookup, forever
    probe(cfg.redis_url, cfg.lease_s)
    if hello is not None:  # (after the probe: a directory that cannot be used is said as such first)
        _check_directory(cfg, hello.config)
    slab = (hello.info.slab_path, hello.info.slab_bytes, hello.info.slot_bytes) if hello else None
    return KVMeshClient(
        spec,
        cfg,
        node_id,
        local,
        slab,
        cache_salt,
        gpu_exports=hello.gpu_exports if hello else (),
        count_fetches=count_fetches,
    )


def _hello(local, deadline: float):
    """The local KVNode's hello by `deadline`, asked again while Ray cannot reach its process for a moment (a
    KVNode that Ray is restarting answers `ActorUnavailableError` until its new process is up: it runs, and is no
    "no KVNode")."""
    while True:
        try:
            return local.hello(timeout=max(0.1, deadline - time.monotonic()))
        except NodeUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def connect_local(
    spec: KVSpec, node, *, peers=(), cache_salt: str | bytes | None = None, count_fetches: bool = True, **options
) -> KVMeshClient:
    """A client for `spec` beside a `KVNode` object of this process, without Ray (tests, a GPU machine without a Ray
    cluster). `peers`: other KVNode objects, reachable through their data servers (peer transport "tcp")."""
    if not isinstance(spec, KVSpec):
        raise TypeError(f"spec must be a kvmesh.KVSpec, got {type(spec).__name__}")
    cfg = _resolve(spec, node.config, None, None, options, node.info.slot_bytes)
    _check_directory(cfg, node.config)
    local = LocalHandle(node, node.node_id)
    others = {p.node_id: LocalHandle(p, node.node_id) for p in peers}
    info = node.info
    return KVMeshClient(
        spec,
        cfg,
        node.node_id,
        local,
        (info.slab_path, info.slab_bytes, info.slot_bytes),
        cache_salt,
        peers=others.get,
        gpu_exports=node.hello().gpu_exports,
        count_fetches=count_fetches,
    )
