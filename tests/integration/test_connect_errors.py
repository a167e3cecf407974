"""A directory kvmesh cannot use fails `kvmesh.connect` and `kvmesh.start` at once, typed and in words: nothing
listens, a socket accepts and never answers, Redis refuses AUTH, or the server is not Redis. Every server here is
real and started by the test, on 127.0.0.1."""

import socket
import socketserver
import threading
import time

import pytest

import kvmesh
from kvmesh.local import RedisServer

# lease_s bounds the probe: connecting, then each reply, waits at most that long
LEASE_S = 1.0
BOUND_S = 2 * LEASE_S + 1.5  # the probe's two waits, and slack for a loaded machine
SPEC = kvmesh.KVSpec(model_id="test/connect-errors", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16",
                     chunk_tokens=4)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Echo(socketserver.BaseRequestHandler):
    """A plain TCP echo server: Redis's PING comes back as an array holding "PING"."""

    def handle(self):
        while data := self.request.recv(4096):
            self.request.sendall(data)


class _Http(socketserver.BaseRequestHandler):
    """What an HTTP server answers to bytes that are not HTTP."""

    def handle(self):
        self.request.recv(4096)
        self.request.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


def _serve(handler):
    server = _Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def servers():
    """name -> URL, each with a password in it (to check the redaction) where that makes sense."""
    silent = socket.socket()  # accepts (the kernel completes the handshake) and never reads or answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    echo, http = _serve(_Echo), _serve(_Http)
    closed = socket.socket()  # a port where nothing listens: bound, never listening, so no one else takes it
    closed.bind(("127.0.0.1", 0))
    with RedisServer(password="right-pw") as redis_auth:
        yield {
            "refused": f"redis://:hunter2@127.0.0.1:{closed.getsockname()[1]}/0",
            "port_1": "redis://127.0.0.1:1/0",
            "silent": f"redis://:hunter2@127.0.0.1:{silent.getsockname()[1]}/0",
            "wrong_password": f"redis://:hunter2@127.0.0.1:{redis_auth.port}/0",
            "no_password": f"redis://127.0.0.1:{redis_auth.port}/0",
            "query_password": f"redis://127.0.0.1:{redis_auth.port}/0?password=hunter2",  # redis-py's other way
            "echo": f"redis://127.0.0.1:{echo.server_address[1]}/0",
            "echo_auth": f"redis://:hunter2@127.0.0.1:{echo.server_address[1]}/0",
            "http": f"redis://:hunter2@127.0.0.1:{http.server_address[1]}/0",
            "good": redis_auth.url,
        }
    for s in (echo, http):
        s.shutdown()
        s.server_close()
    silent.close()
    closed.close()


CASES = [  # server, words the cause must hold
    ("refused", "Connection refused"),
    ("port_1", "Connection refused"),
    ("silent", f"no answer within {LEASE_S:g} s"),
    ("wrong_password", "authentication refused"),
    ("no_password", "authentication refused"),
    ("query_password", "authentication refused"),
    ("echo", "not a Redis server"),
    ("echo_auth", "not a Redis server"),
    ("http", "not a Redis server"),
]


def _check(e: kvmesh.DirectoryUnavailable, url: str, words: str) -> None:
    msg = str(e)
    assert isinstance(e, ConnectionError)
    assert "hunter2" not in msg and "hunter2" not in e.url, msg
    shown = url.replace("hunter2", "***")
    assert e.url == shown and shown in msg, msg
    assert words in e.cause and e.cause in msg, msg
    assert "\n" not in msg  # one line, for the integrations' and the CLI's logs


@pytest.mark.parametrize("name,words", CASES)
def test_connect_raises_a_typed_error_naming_the_redacted_url_and_the_cause(ray_cluster, servers, name, words):
    url = servers[name]
    t0 = time.monotonic()
    with pytest.raises(kvmesh.DirectoryUnavailable) as info:
        kvmesh.connect(SPEC, redis_url=url, lease_s=LEASE_S, heartbeat_s=LEASE_S / 2)
    took = time.monotonic() - t0
    _check(info.value, url, words)
    assert took < BOUND_S, f"{name}: {took:.2f} s"
    if name == "silent":  # the bound is the lease: it really waited for an answer, and no longer
        assert took >= LEASE_S * 0.9, took


@pytest.mark.parametrize("name,words", [c for c in CASES if c[0] in ("silent", "wrong_password", "http")])
def test_start_raises_the_same_error_and_places_no_node(ray_cluster, servers, name, words):
    from kvmesh.mesh import node_actors

    url = servers[name]
    before = set(node_actors())
    t0 = time.monotonic()
    with pytest.raises(kvmesh.DirectoryUnavailable) as info:
        kvmesh.start(url, lease_s=LEASE_S, heartbeat_s=LEASE_S / 2, key_prefix="connect-errors")
    assert time.monotonic() - t0 < BOUND_S
    _check(info.value, url, words)
    assert set(node_actors()) == before


def _connect_and_look_up(url: str) -> str:
    client = kvmesh.connect(SPEC, redis_url=url, lease_s=LEASE_S, heartbeat_s=LEASE_S / 2)
    try:
        return client.lookup(list(range(8))).why
    finally:
        client.close()


def test_connect_to_a_good_directory_with_its_password_works(ray_cluster, servers):
    """From a Ray node without a KVNode (a client beside a KVNode must use the node's own directory)."""
    from tests.integration.conftest import on_node

    node = ray_cluster.add_node(num_cpus=1)
    try:
        assert on_node(node.node_id, _connect_and_look_up, servers["good"]) == "not_cached"  # the directory answered
    finally:
        ray_cluster.remove_node(node, graceful=True)


class _Client:
    def __init__(self, url: str) -> None:
        self.c = kvmesh.connect(SPEC, redis_url=url, lease_s=LEASE_S, heartbeat_s=LEASE_S / 2, lookup_timeout_s=0.3)

    def lookup(self) -> tuple[int, str]:
        m = self.c.lookup(list(range(8)))
        return m.num_chunks, m.why

    def close(self) -> None:
        self.c.close()


def test_once_connected_a_directory_that_goes_away_is_a_miss(ray_cluster):
    """(A client on a Ray node without a KVNode: one beside a KVNode must use the node's own directory.)"""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray_cluster.add_node(num_cpus=1)
    try:
        with RedisServer() as server:
            where = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
            client = ray.remote(num_cpus=0)(_Client).options(scheduling_strategy=where).remote(server.url)
            try:
                assert ray.get(client.lookup.remote(), timeout=60) == (0, "not_cached")
                server.kill()
                # no exception: a miss, and why
                assert ray.get(client.lookup.remote(), timeout=60) == (0, "directory_error")
            finally:
                ray.get(client.close.remote(), timeout=60)
                ray.kill(client)
    finally:
        ray_cluster.remove_node(node, graceful=True)


def _connect_in_a_task(url: str):
    kvmesh.connect(SPEC, redis_url=url, lease_s=LEASE_S, heartbeat_s=LEASE_S / 2)


def test_the_error_reaches_the_caller_of_a_ray_task_or_actor_typed_and_whole(ray_cluster, servers):
    # engines and routers connect inside Ray actors: the error must survive Ray's pickling as itself (an exception
    # Ray cannot rebuild reaches the caller as UnserializableException, its words buried in a traceback)
    import ray

    url = servers["refused"]
    with pytest.raises(kvmesh.DirectoryUnavailable) as info:
        ray.get(ray.remote(num_cpus=0)(_connect_in_a_task).remote(url), timeout=60)
    # Ray raises a RayTaskError that is also a DirectoryUnavailable; its `cause` is the original error, rebuilt
    original = info.value.cause
    assert type(original) is kvmesh.DirectoryUnavailable
    _check(original, url, "Connection refused")
    assert str(original) in str(info.value)
