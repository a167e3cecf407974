"""The data server keeps serving after an accept that failed (out of file descriptors for a moment): before, its
accept thread returned, and the node stayed listed while every peer's fetch from it timed out. A reader that stops
reading cannot keep the server's pins; a shutdown ends the accept thread and the port at once."""

import errno
import socket
import time

import numpy as np
import xxhash

from kvmesh.transport import DataClient, DataServer

CHUNK = np.arange(256, dtype=np.uint8)


class FailsOnce:
    """The server's listening socket, whose next accept fails with EMFILE once."""

    def __init__(self, real: socket.socket) -> None:
        self.real, self.failed = real, False

    def accept(self):
        if not self.failed:
            self.failed = True
            raise OSError(errno.EMFILE, "Too many open files")
        return self.real.accept()

    def shutdown(self, how: int) -> None:
        self.real.shutdown(how)

    def close(self) -> None:
        self.real.close()


def test_a_failed_accept_does_not_stop_the_data_server():
    server = DataServer(lambda keys, requester: ([0], [(CHUNK.nbytes, xxhash.xxh3_64_intdigest(CHUNK))],
                                                 [memoryview(CHUNK)]), lambda slots: None)
    client = DataClient()
    try:
        server._listener = FailsOnce(server._listener)
        host, port = server.address.rsplit(":", 1)
        socket.create_connection((host, int(port))).close()  # accepted by the accept already waiting; the next fails
        deadline = time.monotonic() + 5
        while not server._listener.failed:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        out = np.zeros(256, dtype=np.uint8)
        got, err = client.pull(server.address, [b"k" * 16], 256, lambda j: [out], time.monotonic() + 5)
        assert (got, err) == (1, None) and np.array_equal(out, CHUNK)
        assert server._thread.is_alive()
    finally:
        client.close()
        server.shutdown()


def test_a_cancelled_pull_stops_waiting_for_a_silent_peers_reply():
    # a fetch that already knows its result cancels its later runs; a pull waiting for a slow peer's reply header
    # waited out the whole deadline (6 s of a 10 s fetch in the hunt's run) instead of ~0.1 s
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    address = "127.0.0.1:%d" % listener.getsockname()[1]
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    t0 = time.monotonic()
    try:
        done, err = DataClient().pull(address, [b"k" * 16], 64, lambda j: [np.zeros(64, np.uint8)],
                                      time.monotonic() + 10.0, cancel=cancel)
    finally:
        listener.close()
    assert done == 0 and isinstance(err, TimeoutError)
    assert time.monotonic() - t0 < 1.5


def test_a_reader_that_stops_reading_loses_its_connection_and_the_pins_are_released():
    # a worker that hangs mid-pull (or sits behind a partition that keeps the connection open) held the holder's
    # slots pinned for good: its slab then refused every store
    import threading

    from kvmesh.transport import _LEN
    from kvmesh.wire import pack_keys

    big = np.zeros(1 << 20, dtype=np.uint8)
    unpinned = threading.Event()
    server = DataServer(
        lambda keys, requester: (list(range(16)), [(big.nbytes, 0)] * 16, [memoryview(big)] * 16),
        lambda slots: unpinned.set(),
        send_timeout_s=0.5,
    )
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        host, port = server.address.rsplit(":", 1)
        s.connect((host, int(port)))
        body = pack_keys([b"k" * 16] * 16, "stalled")
        s.sendall(_LEN.pack(len(body)) + body)  # and never reads the 16 MiB reply
        assert unpinned.wait(5.0)
    finally:
        s.close()
        server.shutdown()


def test_shutdown_stops_accepting_at_once():
    import threading

    server = DataServer(lambda keys, requester: ([], [], []), lambda slots: None)
    host, port = server.address.rsplit(":", 1)
    t0 = time.monotonic()
    server.shutdown()
    assert time.monotonic() - t0 < 1.0  # before, the join waited out its 2 s: close() does not wake accept()
    assert not server._thread.is_alive() and "kvmesh-data-accept" not in [t.name for t in threading.enumerate()]
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        listening = True
    except OSError:
        listening = False
    assert not listening


def test_connections_kept_for_a_peer_that_is_gone_are_closed_once_idle(monkeypatch):
    """A peer that restarted listens on a new port: its old address is never asked again, and the connections
    kept for it stayed open for the client's life (two file descriptors per peer restart, to EMFILE)."""
    from kvmesh import transport

    client = DataClient()
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        client._keep("10.0.0.1:1000", pairs[0][0])
        assert list(client._idle) == ["10.0.0.1:1000"]
        monkeypatch.setattr(transport, "IDLE_S", 0.0)
        time.sleep(0.01)
        client._keep("10.0.0.1:2000", pairs[1][0])  # (the next connection kept, to anyone, prunes)
        assert list(client._idle) == ["10.0.0.1:2000"]
        assert pairs[0][0].fileno() == -1  # closed
        monkeypatch.setattr(transport, "IDLE_S", 60.0)
        monkeypatch.setattr(transport, "IDLE_PER_PEER", 1)
        client._keep("10.0.0.1:2000", pairs[2][0])
        assert [s for _, s in client._idle["10.0.0.1:2000"]] == [pairs[2][0]] and pairs[1][0].fileno() == -1
    finally:
        client.close()
        for a, b in pairs:
            a.close()
            b.close()
