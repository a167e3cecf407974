"""A fault on a node's own tiers is counted where an operator looks: its stats, the metrics it exports, the live
page's events. A chunk its disk returns damaged is a corrupt chunk (`kvmesh_corrupt_chunks_total`), a read the disk
fails is a disk error by errno (`kvmesh_disk_errors_total`), and a chunk lost because the disk refused it is a drop
(`kvmesh_drops_total`), not a demotion. Real redis-server, KVNode objects in this process; what the node exports is
recorded by a stand-in for Ray's metrics (`Exported`)."""

import errno
import os
import time

import msgpack
import pytest
import redis
import torch

from kvmesh.connecting import connect_local
from kvmesh.spec import KVSpec
from tests.conftest import wait_until

SPEC = KVSpec("fault-accounting-model", 2, 2, 16, "float16", chunk_tokens=16)
CH = SPEC.chunk_tokens


class Exported:
    """What a node hands Ray's metrics: counter increments by (name, tags)."""

    def __init__(self) -> None:
        self.incs: dict = {}

    def inc(self, name, v, **tags) -> None:
        if v > 0:
            key = (name, tuple(sorted(tags.items())))
            self.incs[key] = self.incs.get(key, 0) + v

    def total(self, name: str, **tags) -> int:
        want = set(tags.items())
        return sum(v for (n, t), v in self.incs.items() if n == name and want <= set(t))

    def set(self, *a, **k) -> None:
        pass

    def observe(self, *a, **k) -> None:
        pass


@pytest.fixture
def node(private_redis, make_node):
    redis.Redis.from_url(private_redis.url).flushall()
    n = make_node("a" * 32, "kvnode-a", redis_url=private_redis.url, key_prefix="fa", cpu_bytes=4 * SPEC.chunk_bytes,
                  slot_bytes=SPEC.chunk_bytes, disk_bytes=32 * SPEC.chunk_bytes, disk_direct_io=False,
                  node_refresh_s=0.2, fetch_timeout_s=5.0)
    n.telemetry.ray_metrics = Exported()
    return n


def prompt(seed: int, chunks: int) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 30000, (chunks * CH + 3,), generator=g).tolist()
    return toks, torch.randn(SPEC.kv_shape(len(toks)), generator=g).to(torch.float16)


def on_disk(node, client, seed: int):
    """A 4-chunk prompt stored and pushed to the node's disk by another one (the slab holds 4)."""
    toks, kv = prompt(seed, 4)
    client.store(toks, kv)
    client.flush()
    other, kv2 = prompt(seed + 100, 4)
    client.store(other, kv2)
    client.flush()
    wait_until(lambda: [c.tier for c in client.lookup(toks, cost_model=False).chunks] == ["disk"] * 4, 10)
    wait_until(lambda: node.stats().get("disk_pending_io", 0) == 0 and not node.cascade._pending, 10)
    return toks, client.lookup(toks, cost_model=False)


def disk_copy(node, key: bytes) -> tuple[str, int]:
    ((_tier, path, offset),) = [w for w in node.locate([key])[0] if w[0] == "disk"]
    return path, offset


def test_a_chunk_damaged_on_disk_is_counted_as_corrupt_and_shown_as_an_event(node, private_redis):
    # before, only the unexported disk_checksum_failures knew: corrupt_dropped stayed 0, no event
    c = connect_local(SPEC, node)
    try:
        toks, match = on_disk(node, c, 1)
        path, offset = disk_copy(node, match.chunks[1].hash)
        with open(path, "r+b") as f:
            f.seek(offset + 10)
            b = f.read(1)
            f.seek(offset + 10)
            f.write(bytes([b[0] ^ 0xFF]))
        got = c.fetch(match)
        assert got.shape[2] == CH  # the chunk before it; the node holds no copy of chunk 1 any more
        node.publish()
        st = node.stats()
        assert st["disk_checksum_failures"] == 1 and st["corrupt_dropped"] == 1
        assert node.telemetry.ray_metrics.total("kvmesh_corrupt_chunks_total") == 1
        events = redis.Redis.from_url(private_redis.url).lrange("fa:{n}:events", 0, -1)
        assert "corrupt_chunk" in [msgpack.unpackb(e)[2] for e in events]
    finally:
        c.close()


def test_a_failed_disk_read_is_exported_as_a_disk_error_by_errno(node):
    # before, kvmesh_disk_errors_total ("failed disk writes and reads") counted only writes
    c = connect_local(SPEC, node)
    try:
        toks, match = on_disk(node, c, 2)
        path, _ = disk_copy(node, match.chunks[0].hash)
        os.truncate(path, 0)  # the device lost the data: every read of it comes back short
        assert c.fetch(match).shape[2] == 0
        node.publish()
        st = node.stats()
        assert st["disk_read_errors"] >= 1
        assert node.telemetry.ray_metrics.total("kvmesh_disk_errors_total", errno="EIO") == st["disk_read_errors"]
    finally:
        c.close()


def test_chunks_a_full_disk_refuses_are_drops_not_demotions(node):
    # before: 12 chunks left the node and were counted as 12 demotions, 0 drops
    node.cascade.disk.fail_writes_with = errno.ENOSPC
    c = connect_local(SPEC, node)
    try:
        stored = 0
        for seed in range(4):
            toks, kv = prompt(10 + seed, 4)
            c.store(toks, kv)
            stored += c.flush()
        # (after the first ENOSPC the disk's slots without blocks are set aside for a second: the chunks that
        # leave meanwhile are dropped without a write)
        wait_until(lambda: node.stats().get("drops", 0) == stored - 4, 10)
        time.sleep(0.2)
        st = node.stats()
        held = len(node.cascade.ready_chunks())
        assert held == 4 and st["drops"] == stored - held and st["demotions"] == 0
        assert st["disk_write_ENOSPC"] >= 1
    finally:
        c.close()
