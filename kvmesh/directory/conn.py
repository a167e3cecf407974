"""How the directory talks to Redis on its hot paths, written once: the RESP of the commands a lookup sends (packed
here, not by redis-py: packing 512 arguments one by one costs as much as the round trip itself), each thread's own
connection to each server (no pool round trip), `send` (packed commands out on those connections in one round
trip, replies back; a Redis Cluster redirect answered by a fallback through the cluster client, which follows it)
and `run_scripts` (one script over many groups, pipelined per server, redirects followed per call).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import numpy as np
import redis

from kvmesh.directory.records import FIELD_BYTES

MULTI, EXEC = b"*1\r\n$5\r\nMULTI\r\n", b"*1\r\n$4\r\nEXEC\r\n"
_FIELD_HEAD = np.frombuffer(b"$%d\r\n" % FIELD_BYTES, dtype=np.uint8)
_CRLF = np.frombuffer(b"\r\n", dtype=np.uint8)
_ARG_HEAD = b"$%d\r\n" % FIELD_BYTES
_ARG_SEP = b"\r\n" + _ARG_HEAD


def pack_hmget(key: str, hashes: list[bytes]) -> bytes:
    """RESP encoding of `HMGET key f1 f2 ...` with the fields of 16-byte chunk hashes, built in one numpy pass:
    packing 512 arguments one by one costs as much as the round trip itself."""
    n = len(hashes)
    k = key.encode()
    joined = b"".join(hashes)
    assert len(joined) == 16 * n, "chunk hashes are 16 bytes"
    h = len(_FIELD_HEAD)
    body = np.empty((n, h + FIELD_BYTES + 2), dtype=np.uint8)
    body[:, :h] = _FIELD_HEAD
    body[:, h : h + FIELD_BYTES] = np.frombuffer(joined, dtype=np.uint8).reshape(n, 16)[:, :FIELD_BYTES]
    body[:, h + FIELD_BYTES :] = _CRLF
    return b"*%d\r\n$5\r\nHMGET\r\n$%d\r\n%s\r\n" % (n + 2, len(k), k) + body.tobytes()


def pack_hmget_fields(key: str, names: list[bytes], version: bool = False) -> bytes:
    """RESP of `HMGET key [v] name...` for FIELD_BYTES-long names (and a group summaries' version field first)."""
    k = key.encode()
    head = b"*%d\r\n$5\r\nHMGET\r\n$%d\r\n%s\r\n" % (len(names) + 2 + version, len(k), k)
    if version:
        head += b"$1\r\nv\r\n"
    if not names:
        return head
    return head + _ARG_HEAD + _ARG_SEP.join(names) + b"\r\n"


def pack_hgetall(key: str) -> bytes:
    k = key.encode()
    return b"*2\r\n$7\r\nHGETALL\r\n$%d\r\n%s\r\n" % (len(k), k)


class Conn:
    """The directory's redis-py client (`connect`'s: a `redis.Redis`, or a `RedisCluster` for a cluster URL) and
    each thread's own connections beside it."""

    def __init__(self, client) -> None:
        self.redis = client
        self.cluster = not isinstance(client, redis.Redis)
        self.redirects = 0  # Redis Cluster MOVED/ASK answers followed (a resharding)
        self._local = threading.local()  # per-thread lookup connection: no pool round trip on the hot path
        self._thread_conns: list = []  # (its thread, by weak reference; connection): closed by close()
        self._conns_lock = threading.Lock()

    def send(self, batches: list[tuple[str, list[bytes]]], fallback: Callable[[], list]) -> list:
        """One round trip: each (key, packed commands) batch goes out on this thread's connection to the server of
        `key` (in Redis Cluster, every server is written to before any answer is read; a batch's commands share
        its key's slot), the commands to one connection in one write (one segment, one wake). Their replies, in
        order. A redirect (a resharding moved a slot, or is moving it) answers `fallback()` instead: the same
        commands through the client, which follows redirects."""
        conns = [self.thread_connection(key) for key, _ in batches]
        out: dict[int, tuple] = {}  # id(connection) -> (connection, its commands), in the order first used
        for conn, (_, packed) in zip(conns, batches):
            out.setdefault(id(conn), (conn, []))[1].extend(packed)
        try:
            for conn, packed in out.values():
                conn.send_packed_command([b"".join(packed)], check_health=False)
            return [conn.read_response() for conn, (_, packed) in zip(conns, batches) for _ in packed]
        except redis.exceptions.ResponseError as e:
            if sum(len(packed) for _, packed in batches) > 1:
                for conn, _ in out.values():
                    conn.disconnect()  # answers of the other commands may still be queued on it
            if self.redirected(e):  # a resharding moved the key's slot, or is moving it
                return fallback()
            raise
        except BaseException:
            for conn, _ in out.values():
                conn.disconnect()  # reconnects on the next command
            raise

    def thread_connection(self, key: str):
        """This thread's own connection to the server that holds `key` (one per server in Redis Cluster)."""
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        if self.cluster:
            node = self.redis.get_node_from_key(key)
            server, pool = node.name, self.redis.get_redis_connection(node).connection_pool
        else:
            server, pool = "", self.redis.connection_pool
        conn = conns.get(server)
        if conn is None:
            # (made outside the pool's count, which caps what it makes, 100 by default in redis-py, and never
            # lowers it for a connection disconnected: one per short-lived thread would exhaust it)
            conn = conns[server] = pool.connection_class(**pool.connection_kwargs)
            with self._conns_lock:  # the connections of threads that have ended go now: a server that runs each
                kept = []  # request on a thread of its own would otherwise hold one per request, to EMFILE
                for ref, c in self._thread_conns:
                    t = ref()
                    if t is None or not t.is_alive():
                        c.disconnect()
                    else:
                        kept.append((ref, c))
                kept.append((weakref.ref(threading.current_thread()), conn))
                self._thread_conns = kept
        return conn

    def thread_connections(self) -> int:
        """How many threads' own connections are kept (those of threads that ended go as the next one is made)."""
        with self._conns_lock:
            return len(self._thread_conns)

    def run_scripts(self, script: str, calls: list[tuple[list[str], list]]) -> list:
        """`script` once per (keys, args), pipelined: one round trip per server that owns any of the keys (Redis
        Cluster does not pipeline scripts across slots, so each server gets its own pipeline; one call's keys share
        a slot)."""
        if not self.cluster:
            pipe = self.redis.pipeline(transaction=False)
            for keys, args in calls:
                pipe.eval(script, len(keys), *keys, *args)
            return pipe.execute()
        by_server: dict[str, list[int]] = {}
        nodes = {}
        for i, (keys, _) in enumerate(calls):
            node = self.redis.get_node_from_key(keys[0])
            nodes[node.name] = node
            by_server.setdefault(node.name, []).append(i)
        out: list = [None] * len(calls)
        for name, idx in by_server.items():
            pipe = self.redis.get_redis_connection(nodes[name]).pipeline(transaction=False)
            for i in idx:
                pipe.eval(script, len(calls[i][0]), *calls[i][0], *calls[i][1])
            for i, r in zip(idx, pipe.execute(raise_on_error=False)):
                if isinstance(r, Exception) and self.redirected(r):  # (a script runs whole or not at all)
                    keys, args = calls[i]
                    r = self.redis.eval(script, len(keys), *keys, *args)  # follows the redirect
                if isinstance(r, Exception):
                    raise r
                out[i] = r
        return out

    def redirected(self, e: BaseException) -> bool:
        """Whether `e` is a Redis Cluster redirect: MOVED (the slot has a new owner: the slot map learns it, so
        that the next command goes there) or ASK (the slot is being migrated). The caller asks again through the
        cluster client, which follows redirects. (redis-py's MovedError and AskError do not start with the word.)"""
        if not (self.cluster and isinstance(e, redis.exceptions.AskError)):
            return False
        self.redirects += 1
        if isinstance(e, redis.exceptions.MovedError):
            try:
                self.redis.nodes_manager.move_slot(e)
            except Exception:  # (a redis-py without it, or a redirect without a host): the whole map again
                self.redis.nodes_manager.initialize()
        return True

    def close(self) -> None:
        with self._conns_lock:
            for _, conn in self._thread_conns:
                conn.disconnect()
        self.redis.close()
