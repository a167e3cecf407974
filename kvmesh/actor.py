"""`KVNodeActor`: the node's wire edge, what Ray runs on each node (`kvmesh.start` wraps it with `ray.remote`).
Wire messages in, typed `KVNode` calls, wire messages out: the only code that unpacks the actor's requests and
packs its replies (`handle.py` holds the caller's side). Malformed messages raise `WireError` and never reach the
node. The configuration comes as a dict over Ray and becomes a `KVMeshConfig` here: `KVNode` takes only that.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import redis

from kvmesh.config import KVMeshConfig
from kvmesh.node import KVNode
from kvmesh.wire import (
    WireError,
    pack_chunk_header,
    pack_gpu_reserved,
    pack_pin_reply,
    unpack_gpu_commit,
    unpack_gpu_reserve,
    unpack_keys,
    unpack_pin_request,
    unpack_pull_through,
    unpack_request,
    unpack_store,
)

log = logging.getLogger("kvmesh.node")


def _restarted() -> bool:
    """Whether this process is a Ray actor that Ray restarted (not its first start, nor a plain object)."""
    try:
        import ray

        return bool(ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:
        return False


class KVNodeActor:
    """What Ray runs on each node (`kvmesh.start` wraps it with `ray.remote`): the wire edge of a `KVNode`. Also
    usable as a plain object (the fuzz tests feed it malformed messages without Ray)."""

    def __init__(
        self, config: KVMeshConfig | dict, node_id: str, actor_name: str = "", host: str = "127.0.0.1"
    ) -> None:
        cfg = config if isinstance(config, KVMeshConfig) else KVMeshConfig.from_dict(config)
        wait = 0.5
        while True:
            try:
                self.node = KVNode(cfg, node_id, actor_name, host, restarted=_restarted())
                return
            except (redis.ConnectionError, redis.TimeoutError) as e:
                # Ray restarting this actor (its process died) while the directory is away: a creation that fails
                # is never retried, whatever max_restarts says, and the node would have no KVNode for good. So a
                # restart waits for the directory instead; a first start fails at once (its caller probed Redis)
                if not _restarted():
                    raise
                log.warning(
                    "KVNode %s: the directory cannot be reached (%s); joining again in %.1f s", node_id[:8], e, wait
                )
                time.sleep(wait)
                wait = min(5.0, wait * 2)

    @classmethod
    def around(cls, node: KVNode) -> KVNodeActor:
        """The wire edge of an existing KVNode object (tests speak wire messages to it in-process)."""
        edge = cls.__new__(cls)
        edge.node = node
        return edge

    def hello(self) -> bytes:
        return self.node.hello().pack()

    def pin(self, request: bytes) -> bytes:
        keys, requester, gpu, hold_ms = unpack_pin_request(request)
        p = self.node.pin(keys, requester, gpu, hold_ms / 1000)
        return pack_pin_reply(p.pin_id, p.chunks, p.slab_path, p.gpu)

    def unpin(self, pin_id: int) -> None:
        if isinstance(pin_id, bool) or not isinstance(pin_id, int):
            raise WireError(f"pin_id must be an int, got {type(pin_id).__name__}")
        self.node.unpin(pin_id)

    def pull(self, request: bytes) -> tuple[bytes, np.ndarray]:
        keys, requester = unpack_request(request, "PullRequest")
        p = self.node.pull(keys, requester)
        return pack_chunk_header(p.rows), p.data

    def pull_through(self, request: bytes) -> bytes:
        p = self.node.pull_through(unpack_pull_through(request))
        return pack_pin_reply(p.pin_id, p.chunks, p.slab_path)

    def store(self, request: bytes, data) -> int:
        items = unpack_store(request)
        buf = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
        if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size != sum(i.nbytes for i in items):
            raise WireError("StoreRequest: buffer size does not match the header")
        return self.node.store(items, buf)

    def report_corrupt(self, request: bytes) -> int:
        return self.node.report_corrupt(unpack_keys(request, "PinRequest"))

    def reserve_gpu(self, request: bytes) -> bytes:
        items, requester = unpack_gpu_reserve(request)
        return pack_gpu_reserved(self.node.reserve_gpu(items, requester))

    def commit_gpu(self, request: bytes) -> int:
        return self.node.commit_gpu(*unpack_gpu_commit(request))

    def stats(self) -> dict:
        return self.node.stats()

    def check_integrity(self, verify_checksums: bool = True, directory: bool = False) -> None:
        self.node.check_integrity(verify_checksums, directory)

    def locate(self, keys: list) -> list:
        """Where the chunks are held on this node, for diagnostics: per key, [tier, file, byte offset] of each copy
        in a memory-mapped or disk tier."""
        if not isinstance(keys, list) or not all(isinstance(k, bytes) for k in keys):
            raise WireError("locate: keys must be a list of bytes")
        return self.node.locate(keys)

    def shutdown(self) -> None:
        self.node.shutdown()
