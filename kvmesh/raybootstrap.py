"""One way for kvmesh's processes to join Ray: quiet (warnings only, workers' logs not echoed to the driver).

init_ray(address, namespace)         ray.init with kvmesh's settings (the CLI, local clusters)
ensure_ray(address, namespace)       the same unless this process is connected already (an engine inside a
                                     Ray actor); address: the option, else $RAY_ADDRESS, else "auto"
local_node_id(option) -> str | None  the Ray node whose KVNode is this process's local one: the option, else
                                     $KVMESH_RAY_NODE_ID, else None (the node the connection lands on)
"""

from __future__ import annotations

import os


def init_ray(address: str, namespace: str) -> None:
    import ray

    ray.init(address=address, namespace=namespace, logging_level="WARNING", log_to_driver=False)


def ensure_ray(address: str | None, namespace: str) -> None:
    import ray

    if not ray.is_initialized():
        init_ray(address or os.environ.get("RAY_ADDRESS") or "auto", namespace)


def local_node_id(option: str | None) -> str | None:
    return option or os.environ.get("KVMESH_RAY_NODE_ID") or None
