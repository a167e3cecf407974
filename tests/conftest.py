import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1

import pytest

from kvmesh.local import RedisServer


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server on a free port for the whole session."""
    with RedisServer() as server:
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
