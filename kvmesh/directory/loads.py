"""Load reports: where serving replicas stand (`kvmesh.routing`), in the node keys' slot.

report_load(replica_id, node_id, pending, depth, keep_ms)   mutates: a replica's load, stamped with Redis's
                                                 clock; drops reports older than keep_ms
read() -> [LoadRecord]                           read, one round trip: every replica's last report
read_with(group key, hashes) -> (values, loads)  read, one round trip (pipelined; in Redis Cluster both servers
                                                 are asked before either answer is read): a lookup's HMGET and
                                                 every replica's last report (`Directory.lookup_with_loads`)
"""

from __future__ import annotations

import msgpack

from kvmesh.directory.conn import Conn, pack_hgetall, pack_hmget
from kvmesh.directory.records import LOAD_VERSION, Keys, LoadRecord, fields, pairs
from kvmesh.directory.scripts import REPORT_LOAD


class Loads:
    def __init__(self, conn: Conn, keys: Keys) -> None:
        self.conn, self.keys = conn, keys
        self._redis = conn.redis
        self.report_script = self._redis.register_script(REPORT_LOAD)

    def report(
        self,
        replica_id: str,
        node_id: str,
        pending_prefill_tokens: int,
        queue_depth: int,
        keep_ms: int,
        prefill: tuple[float, ...] | None = None,
        namespace: bytes = b"",
    ) -> int:
        """Record a replica's load (and its measured prefill model's coefficients, when it has one, and the
        namespace of the spec it serves), stamped with Redis's clock (returned, ms); reports older than `keep_ms`
        go."""
        value = msgpack.packb(
            [LOAD_VERSION, node_id, int(pending_prefill_tokens), int(queue_depth)]
            + [[float(x) for x in prefill] if prefill is not None else None, bytes(namespace)],
            use_bin_type=True,
        )
        return int(self.report_script(keys=[self.keys.load, self.keys.load_at], args=[replica_id, value, keep_ms]))

    def _fallback(self) -> list:
        return [self._redis.hgetall(self.keys.load), self._redis.hgetall(self.keys.load_at)]

    def read(self) -> list[LoadRecord]:
        """Every replica's last load report, one round trip on this thread's connection."""
        k = self.keys
        raw, at = self.conn.send([(k.load, [pack_hgetall(k.load), pack_hgetall(k.load_at)])], self._fallback)
        return self.records(raw, at)

    def read_with(self, gkey: str, hashes: list[bytes]) -> tuple[list[bytes | None], list[LoadRecord]]:
        """The HMGET of `hashes` in the group `gkey` and every replica's last load report, in one round trip: the
        HMGET and the two HGETALLs go out together on this thread's connections (one in plain Redis; in Redis
        Cluster the group's server and the node keys' server are both sent to before either answer is read)."""
        k = self.keys
        loads = (k.load, [pack_hgetall(k.load), pack_hgetall(k.load_at)])
        if not hashes:
            raw, at = self.conn.send([loads], self._fallback)
            return [], self.records(raw, at)
        values, raw, at = self.conn.send(
            [(gkey, [pack_hmget(gkey, hashes)]), loads],
            lambda: [self._redis.hmget(gkey, fields(hashes)), *self._fallback()],  # (the client follows redirects)
        )
        return values, self.records(raw, at)

    @staticmethod
    def records(raw, at) -> list[LoadRecord]:
        """Load records from the two hashes' HGETALL replies (flat lists in RESP2, maps in RESP3); a value this
        version cannot read is no record."""
        raw = raw if isinstance(raw, dict) else pairs(raw)
        at = at if isinstance(at, dict) else pairs(at)
        out = []
        for rid, value in raw.items():
            try:
                parts = msgpack.unpackb(value)
                version, node_id, pending, depth = parts[:4]
                prefill = tuple(float(x) for x in parts[4]) if len(parts) > 4 and parts[4] else None
                namespace = bytes(parts[5]) if len(parts) > 5 and isinstance(parts[5], bytes) else b""
                stamp = int(at[rid])
            except (ValueError, TypeError, KeyError, msgpack.UnpackException):
                continue
            if version == LOAD_VERSION:
                out.append(
                    LoadRecord(
                        rid.decode(errors="replace"), str(node_id), int(pending), int(depth), stamp, prefill, namespace
                    )
                )
        return out
