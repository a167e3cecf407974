"""Peer data plane over plain TCP, beside Ray's object store.

Ray's object transfer moves a KV pull at 0.1–0.3 of a raw loopback TCP stream on our machines (a copy into the
object store, the raylet-to-raylet transfer, a copy out). Each KVNode therefore also runs a `DataServer` on its
node's address; clients pull chunks from it directly. Ray stays the control plane (placement, actor handles,
pins for same-node reads) and the fallback data path (`peer_transport="ray"`).

Protocol, one request at a time per connection (connections are kept and reused):

    request   u32 length (little-endian) + msgpack PullRequest [1, [key, ...]]         (wire.pack_keys)
    reply     u32 length + msgpack PullReply header [1, [[nbytes, checksum], ...]]    leading chunks held, pinned
              then each chunk's bytes, back to back

The server sends straight from the pinned slab (no user-space copy) and unpins when the last byte is out, or when
the reader has not taken the reply within `send_timeout_s` (the node's pin TTL): then it closes the connection. The
client receives straight into the caller's tensor and checks each chunk's checksum there; a mismatch, a short
read or a missed deadline closes the connection and ends the pull at the last intact chunk.

The port is unauthenticated, like Ray's own ports: it must only be reachable inside the cluster network.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable

import xxhash

from kvmesh.wire import WireError, pack_chunk_header, pack_keys, unpack_chunk_header, unpack_request

log = logging.getLogger("kvmesh.transport")
_LEN = struct.Struct("<I")
MAX_FRAME = 1 << 24
ACCEPT_RETRY_S = 0.05  # after a failed accept (e.g. EMFILE), the server tries again this much later


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(_recv_exact(sock, 4))
    if n > MAX_FRAME:
        raise WireError(f"frame of {n} bytes is too large")
    return _recv_exact(sock, n)


def _send_frame(sock: socket.socket, body: bytes) -> None:
    sock.sendall(_LEN.pack(len(body)) + body)


class DataServer:
    """Serves pulls from a node's slab. `pin(keys, requester)` returns (slots, [(nbytes, checksum)], [memoryview])
    for the leading run it holds, pinned; `unpin(slots)` releases them."""

    def __init__(
        self, pin: Callable, unpin: Callable, host: str = "127.0.0.1", port: int = 0, send_timeout_s: float = 30.0
    ) -> None:
        self._pin, self._unpin = pin, unpin
        self.send_timeout_s = send_timeout_s  # a reply's pins are held at most this long: a reader that stops
        # reading (hung, stopped, behind a partition that keeps the connection open) loses its connection instead
        self._listener = socket.create_server((host, port), backlog=64)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self._thread = threading.Thread(target=self._accept_loop, name="kvmesh-data-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError as e:
                if self._stop.is_set():
                    return  # (shutdown closed the listener)
                # out of file descriptors for a moment, a connection reset before it was accepted: the server
                # keeps serving (its node stays listed; a server that stopped would time out every peer's fetch)
                log.warning("data server %s: accept failed (%s); accepting again", self.address, e)
                self._stop.wait(ACCEPT_RETRY_S)
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kvmesh-data-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                try:
                    keys, requester = unpack_request(_recv_frame(conn), "PullRequest")
                except (ConnectionError, OSError):
                    return
                slots, rows, views = self._pin(keys, requester)
                try:
                    deadline = time.monotonic() + self.send_timeout_s
                    conn.settimeout(self.send_timeout_s)
                    _send_frame(conn, pack_chunk_header(rows))
                    for v in views:
                        conn.settimeout(max(0.001, deadline - time.monotonic()))
                        conn.sendall(v)
                        self.bytes_sent += len(v)
                    conn.settimeout(None)  # an idle kept connection waits for its next request as long as it likes
                finally:
                    self._unpin(slots)
        except (WireError, OSError, ValueError) as e:  # (ValueError: the slab was unmapped by a shutdown meanwhile)
            log.debug("data connection closed: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def shutdown(self) -> None:
        self._stop.set()
        try:  # wakes the accept() blocked in the accept thread, which a close() from here does not do on Linux
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for c in list(self._conns):
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._thread.join(timeout=2)


IDLE_S = 60.0  # a kept connection idle this long is closed (the next pull from that peer connects anew)
IDLE_PER_PEER = 8  # kept connections per peer address at most
RECV_STEP_S = 0.1  # a receive waits at most this long before the deadline and `cancel` are checked again


def _recv_into(sock: socket.socket, view: memoryview, deadline: float, cancel: threading.Event | None) -> int:
    """One receive into `view`, by the deadline. It waits in steps of at most RECV_STEP_S and checks `cancel`
    between them (a step that times out with nothing received costs nothing). The socket's timeout is set only
    when it would outlast the deadline (the first receive of a pull, and its last step): setting it costs two
    system calls, which on every receive cost a loaded machine 0.56 of a stream's throughput, against 0.87."""
    while True:
        left = deadline - time.monotonic()
        if cancel is not None and cancel.is_set():
            raise TimeoutError("cancelled")
        if left <= 0:
            raise TimeoutError("deadline passed")
        step = sock.gettimeout()
        if step is None or step > left or step > RECV_STEP_S:
            sock.settimeout(min(RECV_STEP_S, left))
        try:
            return sock.recv_into(view)
        except TimeoutError:
            continue


def _recv_frame_by(sock: socket.socket, deadline: float, cancel: threading.Event | None) -> bytes:
    """`_recv_frame` by the deadline, ending within RECV_STEP_S of `cancel` (a slow peer's reply header would
    otherwise keep a fetch that already ended waiting for it)."""

    def exact(n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = _recv_into(sock, view[got:], deadline, cancel)
            if not k:
                raise ConnectionError("peer closed the connection")
            got += k
        return bytes(buf)

    (n,) = _LEN.unpack(exact(4))
    if n > MAX_FRAME:
        raise WireError(f"frame of {n} bytes is too large")
    return exact(n)


class DataClient:
    """Pulls chunks from peers' DataServers, keeping idle connections per peer for reuse: at most IDLE_PER_PEER
    each, closed once idle for IDLE_S (a peer that restarted listens on a new port: its old address is never asked
    again, and its sockets would stay open for the client's life)."""

    def __init__(self, connect_timeout_s: float = 1.0) -> None:
        self._idle: dict[str, list[tuple[float, socket.socket]]] = {}  # address -> (idle since, socket)
        self._lock = threading.Lock()
        self.connect_timeout_s = connect_timeout_s

    def _connect(self, address: str, deadline: float, reuse: bool = True) -> tuple[socket.socket, bool]:
        """A connection to `address`, and whether it is a kept one (which the peer may have closed since)."""
        with self._lock:
            pool = self._idle.get(address)
            if pool and reuse:
                sock = pool.pop()[1]
                if not pool:
                    del self._idle[address]
                return sock, True
        host, port = address.rsplit(":", 1)
        timeout = max(0.01, min(self.connect_timeout_s, deadline - time.monotonic()))
        sock = socket.create_connection((host, int(port)), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, False

    def pull(
        self,
        address: str,
        keys: list[bytes],
        expected_nbytes: int,
        dest: Callable[[int], list],
        deadline: float,
        requester: str = "",
        checksums: list | None = None,
        cancel: threading.Event | None = None,
    ) -> tuple[int, Exception | None]:
        """Pull `keys` from the peer at `address`; chunk j's bytes go into the writable buffers `dest(j)`, in
        order (they add up to `expected_nbytes`). Returns how many leading chunks arrived intact, and the error
        that ended the pull early (None when the peer sent every chunk it holds). `checksums`, if given, gets
        the verified checksum of each intact chunk appended. Setting `cancel` ends the pull within ~0.1 s (the
        caller stopped waiting for it); its error is then a `TimeoutError`."""
        done = 0
        if cancel is not None and cancel.is_set():
            return 0, TimeoutError("cancelled")
        reuse = True
        while True:
            try:
                sock, kept = self._connect(address, deadline, reuse)
            except OSError as e:
                return 0, e
            try:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                _send_frame(sock, pack_keys(keys, requester))
                rows = unpack_chunk_header(_recv_frame_by(sock, deadline, cancel))
                break
            except (OSError, WireError) as e:
                sock.close()
                if kept and not isinstance(e, TimeoutError):  # a kept connection the peer closed since: once more
                    reuse = False
                    continue
                return 0, e
        try:
            if len(rows) > len(keys) or any(n != expected_nbytes for n, _ in rows):
                raise WireError("PullReply: unexpected chunk count or size")
            for j, (_nbytes, want) in enumerate(rows):
                h = xxhash.xxh3_64()
                for buf in dest(j):
                    view = memoryview(buf).cast("B")
                    got = 0
                    while got < len(view):
                        k = _recv_into(sock, view[got:], deadline, cancel)
                        if not k:
                            raise ConnectionError("peer closed the connection mid-chunk")
                        got += k
                    h.update(view)
                if h.intdigest() != want:
                    raise ChecksumError(f"chunk {j} of a pull from {address} fails its checksum")
                if checksums is not None:
                    checksums.append(want)
                done += 1
        except (OSError, WireError) as e:  # socket.timeout is an OSError (and a TimeoutError)
            sock.close()
            return done, e
        self._keep(address, sock)
        return done, None

    def _keep(self, address: str, sock: socket.socket) -> None:
        now = time.monotonic()
        stale: list[tuple[float, socket.socket]] = []
        with self._lock:
            pool = self._idle.setdefault(address, [])
            pool.append((now, sock))
            if len(pool) > IDLE_PER_PEER:
                stale.append(pool.pop(0))
            for addr in list(self._idle):
                kept: list[tuple[float, socket.socket]] = []
                for t, s in self._idle[addr]:
                    (kept if now - t <= IDLE_S else stale).append((t, s))
                if kept:
                    self._idle[addr] = kept
                else:
                    del self._idle[addr]
        for _, s in stale:
            s.close()

    def close(self) -> None:
        with self._lock:
            for pool in self._idle.values():
                for _, s in pool:
                    s.close()
            self._idle.clear()


class ChecksumError(WireError):
    """Bytes that arrived do not match the checksum their holder recorded."""
