"""KVNode as a plain class (no Ray) against a real redis-server: store, pin, pull, corruption, resync."""

import os
import threading
import time

import numpy as np
import pytest
import redis

from kvmesh.config import KVMeshConfig
from kvmesh.directory import Directory
from tests.integration.nodes import WireNode
from kvmesh.tiers import TIER_CPU, checksum
from kvmesh.tiers.devsum import reference_checksum
from kvmesh.wire import StoreItem, WireError, pack_keys, pack_store, unpack_chunk_header, unpack_pin_reply
from tests.conftest import wait_until

SLOT = 4096
G = b"g" * 16


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture
def node(private_redis, tmp_path):
    redis.Redis.from_url(private_redis.url).flushall()
    cfg = KVMeshConfig(redis_url=private_redis.url, key_prefix="tn", cpu_bytes=8 * SLOT, slot_bytes=SLOT,
                       lease_s=2.0, heartbeat_s=0.2, shm_dir=str(tmp_path))
    n = WireNode(cfg, "node-a" * 4, "kvnode-a")
    yield n
    n.shutdown()


def chunks(*ids: int, size: int = SLOT) -> tuple[bytes, np.ndarray]:
    datas = [np.full(size, i % 251, dtype=np.uint8) for i in ids]
    items = [StoreItem(G, k(i), size, checksum(d)) for i, d in zip(ids, datas)]
    return pack_store(items), np.concatenate(datas)


def lookup(node, ids) -> list:
    d = node.directory
    return d.longest_prefix(d.lookup_raw(G, [k(i) for i in ids]), d.node_table())


def test_store_registers_and_pull_returns_verified_bytes(node):
    assert node.store(*chunks(1, 2, 3)) == 3
    assert node.store(*chunks(2, 3)) == 0  # already held
    assert len(lookup(node, [1, 2, 3, 4])) == 3
    header, data = node.pull(pack_keys([k(1), k(2), k(7), k(3)]))
    rows = unpack_chunk_header(header)
    assert len(rows) == 2 and data.size == 2 * SLOT  # stops at the first chunk it does not hold
    assert (data[:SLOT] == 1).all() and (data[SLOT:] == 2).all()
    node.check_integrity()


def test_pins_protect_a_same_node_read_and_expire(node):
    node.store(*chunks(1))
    pin_id, rows, path, _ = unpack_pin_reply(node.pin(pack_keys([k(1)])))
    assert path == node.info.slab_path and len(rows) == 1
    assert node.stats()["pinned"] == 1
    node.unpin(pin_id)
    assert node.stats()["pinned"] == 0
    node.serving.pin_ttl_s = 0.1  # (the pin table is Serving's)
    node.pin(pack_keys([k(1)]))  # a reader that never unpins
    wait_until(lambda: node.stats()["pinned"] == 0, 3)


def test_an_unpin_meant_for_the_nodes_previous_process_releases_no_pin_of_this_one(private_redis, tmp_path):
    """Ray restarts a KVNode under the same actor handle; a client that pinned from the old process unpins late,
    and the new process, whose pin ids also started at 1, released another reader's pin: its slots could be
    reused under that reader's zero-copy read (found by the restart hunt)."""
    cfg = KVMeshConfig(redis_url=private_redis.url, key_prefix="tp", cpu_bytes=8 * SLOT, slot_bytes=SLOT,
                       lease_s=2.0, heartbeat_s=0.2, shm_dir=str(tmp_path))
    old = WireNode(cfg, "node-p" * 4, "kvnode-p")
    old.store(*chunks(1))
    stale = [unpack_pin_reply(old.pin(pack_keys([k(1)])))[0] for _ in range(3)]
    old.kill()
    new = WireNode(cfg, "node-p" * 4, "kvnode-p")  # the restarted process
    try:
        new.store(*chunks(1))
        mine = [unpack_pin_reply(new.pin(pack_keys([k(1)])))[0] for _ in range(3)]
        assert new.stats()["pinned"] == 3
        for pin_id in stale:
            new.unpin(pin_id)  # the old process's readers, late
        assert new.stats()["pinned"] == 3
        for pin_id in mine:
            new.unpin(pin_id)
        assert new.stats()["pinned"] == 0
    finally:
        new.shutdown()


def test_pins_carry_each_slab_chunk_s_device_checksum_once_the_node_has_recorded_it(node):
    node.store(*chunks(1, 2))
    wait_until(lambda: node.stats()["slab_devsums_queued"] == 0, 5)  # (the node's device-checksum thread)
    pin_id, rows, _path, _ = unpack_pin_reply(node.pin(pack_keys([k(1), k(2)])))
    assert [r.devsum for r in rows] == [reference_checksum(np.full(SLOT, i, dtype=np.uint8).tobytes())
                                        for i in (1, 2)]
    node.unpin(pin_id)
    assert node.stats()["slab_devsums"] == 2
    node.check_integrity()  # (which re-checks the recorded sums)


def test_a_corrupt_chunk_is_never_served_and_is_unregistered(node):
    node.store(*chunks(1, 2, 3))
    slot = node.tier.slot_of(k(2))
    node.tier.buffer(slot)[100] ^= 0x01  # a single bit flip in host memory
    header, data = node.pull(pack_keys([k(1), k(2), k(3)]))
    assert len(unpack_chunk_header(header)) == 1 and data.size == SLOT
    assert node.tier.slot_of(k(2)) is None
    assert len(lookup(node, [1, 2, 3])) == 1
    assert node.stats()["corrupt_dropped"] == 1


def test_a_store_that_was_corrupted_in_transit_is_refused(node):
    req, data = chunks(1, 2)
    data[SLOT + 7] ^= 0xFF
    assert node.store(req, data) == 1
    assert node.tier.slot_of(k(2)) is None and node.stats()["store_corrupt_in_transit"] == 1


def test_eviction_unregisters_and_keeps_prefix_heads(node):
    node.store(*chunks(*range(1, 9)))  # fills all 8 slots
    node.store(*chunks(*range(11, 15)))  # 4 more: evicts 4 of the first prompt's tail chunks
    assert len(lookup(node, range(1, 9))) == 4  # the head 1..4 survives
    assert node.stats()["evictions"] == 4 and node.stats()["drops"] == 4  # no tier below the CPU: dropped
    node.check_integrity()


def test_the_purge_index_follows_what_the_node_holds(node):
    """A long-lived node churns through many prompt groups: its purge index lists only the groups it still holds
    chunks of, so a purge after its death costs what it held, not every group it ever touched."""
    own = node.directory.own_key(node.lease.incarnation)
    r = node.directory.redis
    for g in range(20):  # 20 groups of 4 chunks through an 8-slot tier: most of them are evicted again
        items = [StoreItem(bytes([g + 1]) * 16, k(100 * g + i), SLOT, checksum(np.full(SLOT, i, np.uint8)))
                 for i in range(4)]
        node.store(pack_store(items), np.concatenate([np.full(SLOT, i, np.uint8) for i in range(4)]))
    held = {grp for grp, _key, _tier in node.cascade.ready_chunks()}
    assert len(held) <= 2 and r.smembers(own) == held
    node.check_integrity(directory=True)  # which also checks the index against the tiers


def test_bad_messages_raise_wire_error_and_the_node_keeps_serving(node):
    for bad in (b"junk", pack_keys([b"short"]), 42):
        with pytest.raises(WireError):
            node.pin(bad)
        with pytest.raises(WireError):
            node.pull(bad)
    req, data = chunks(1)
    with pytest.raises(WireError):
        node.store(req, data[:-1])
    with pytest.raises(WireError):
        node.unpin("x")
    assert node.store(req, data) == 1


def test_chunks_bigger_than_a_slot_are_refused(node):
    assert node.store(*chunks(1, size=SLOT + 1)) == 0
    assert node.stats()["store_refused_too_big"] == 1


def test_redis_restart_empty_triggers_resync_under_a_new_incarnation(node, private_redis):
    node.store(*chunks(1, 2))
    old = node.lease.incarnation
    private_redis.restart()
    d = Directory(private_redis.url, "tn")
    rows = d.longest_prefix(d.lookup_raw(G, [k(1)]), d.node_table())  # nothing stale in the gap: empty, or
    assert all(h.incarnation != old for r in rows for h in r)  # registered anew under a new incarnation
    wait_until(lambda: node.lease.incarnation != old and len(lookup(node, [1, 2])) == 2, 5)
    assert lookup(node, [1])[0][0].incarnation == node.lease.incarnation
    assert node.stats()["resyncs"] == 1
    d.close()


def aof_node(server, tmp_path, name: str):
    cfg = KVMeshConfig(redis_url=server.url, key_prefix="tn", cpu_bytes=8 * SLOT, slot_bytes=SLOT, lease_s=5.0,
                       heartbeat_s=0.2, shm_dir=str(tmp_path))
    return WireNode(cfg, name * 4, "kvnode-" + name)


def test_changes_made_while_redis_hangs_reach_it_when_it_answers_again(tmp_path):
    """A blip, not a loss: the same Redis process stops answering for a while, so the node keeps its incarnation.
    Chunks evicted meanwhile must not stay listed: the removals are sent again, not forgotten."""
    import os
    import signal

    from kvmesh.local import RedisServer

    with RedisServer() as server:
        node = aof_node(server, tmp_path, "node-o")
        try:
            node.store(*chunks(*range(1, 9)))  # fills all 8 slots, registered
            inc = node.lease.incarnation
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                node.store(*chunks(*range(11, 15)))  # evicts 4 of them while nobody can be told
                assert node.stats()["directory_errors"] >= 1
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)  # 1..8 are all still listed
            wait_until(lambda: not node.registrar.pending and len(lookup(node, range(1, 9))) == 4, 10)
            assert node.lease.incarnation == inc and node.stats().get("resyncs", 0) == 0
            node.check_integrity(directory=True)  # exactly what it holds is listed: no phantom entries
        finally:
            node.shutdown()


def test_a_node_that_leaves_takes_its_stats_along_and_forgets_readers_gone_for_good(private_redis, tmp_path):
    """The live page's hash of published stats kept a field for every node id ever seen (a replaced machine, a
    restarted raylet), and a node kept the bytes it served to every reader id it ever saw: both only grow."""
    from kvmesh.telemetry import Records

    redis.Redis.from_url(private_redis.url).flushall()
    cfg = KVMeshConfig(redis_url=private_redis.url, key_prefix="ts", cpu_bytes=8 * SLOT, slot_bytes=SLOT,
                       lease_s=2.0, heartbeat_s=0.2, shm_dir=str(tmp_path))
    a, b = WireNode(cfg, "node-s" * 4, "kvnode-s"), WireNode(cfg, "node-t" * 4, "kvnode-t")
    records = Records(redis.Redis.from_url(private_redis.url), "ts")
    try:
        served, served_at = a.serving.served, a.serving.served_at
        served[b.node_id] += 10
        served["gone" * 8] += 10  # a reader no longer in the node table, not served for 10 leases
        served_at[b.node_id], served_at["gone" * 8] = time.monotonic(), time.monotonic() - 10 * cfg.lease_s - 1
        a.publish()
        b.publish()
        assert set(a.stats()["served_bytes"]) == {b.node_id}
        wait_until(lambda: set(records.read()[0]) == {a.node_id, b.node_id}, 5)
        b.shutdown()
        wait_until(lambda: set(records.read()[0]) == {a.node_id}, 5)
    finally:
        a.shutdown()
        b.shutdown()


def test_a_long_outage_under_churn_does_not_queue_changes_without_bound(tmp_path, monkeypatch):
    """Every store and eviction while Redis is away queues a change (mostly unregisters of chunks stored and
    evicted meanwhile): ~1,600 a second under churn, without bound. Past MAX_QUEUED the queue goes, and the node
    re-joins under a new incarnation once Redis answers (the old one's entries purged through its index) and
    registers what it holds then: exactly that is listed."""
    import os
    import signal

    from kvmesh import registrar
    from kvmesh.local import RedisServer

    monkeypatch.setattr(registrar, "MAX_QUEUED", 5)
    with RedisServer() as server:
        node = aof_node(server, tmp_path, "node-q")
        try:
            node.store(*chunks(*range(1, 9)))
            inc = node.lease.incarnation
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                node.store(*chunks(*range(11, 15)))  # 4 stored, 4 evicted: 8 changes for a queue of 5
                assert len(node.registrar._queued) <= 5
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            wait_until(lambda: node.lease.incarnation != inc and not node.registrar.pending, 10)
            assert node.stats()["registrar_queue_overflows"] >= 1
            wait_until(lambda: not node.janitor._to_purge, 10)
            assert len(lookup(node, range(1, 9))) == 4 and len(lookup(node, range(11, 15))) == 4
            node.check_integrity(directory=True)  # no phantom of the evicted four, the rest listed
            d = Directory(server.url, "tn")
            wait_until(lambda: d.entries_of(inc) == {}, 10)  # the old incarnation's entries were purged
            d.close()
        finally:
            node.shutdown()


def test_a_redis_that_restarts_with_its_data_makes_nodes_re_register(tmp_path):
    """A restart from disk (or a failover to a replica) keeps the epoch but may have lost recent writes, or kept
    entries of chunks since evicted: the node sees the server's run id change and re-joins and re-registers."""
    from kvmesh.local import RedisServer

    with RedisServer(extra_args=("--appendonly", "yes", "--appendfsync", "always")) as server:
        node = aof_node(server, tmp_path, "node-f")
        try:
            node.store(*chunks(*range(1, 9)))
            inc = node.lease.incarnation
            server.kill()
            node.store(*chunks(*range(11, 15)))  # evicts 4 while Redis is down
            server.start()  # with its data: 1..8 are still listed, under the current incarnation
            wait_until(lambda: node.lease.incarnation != inc, 10)
            assert node.stats()["directory_server_changed"] == 1 and node.stats()["resyncs"] == 1
            wait_until(lambda: not node.registrar.pending and not node.janitor._to_purge, 10)
            assert len(lookup(node, range(1, 9))) == 4 and len(lookup(node, range(11, 15))) == 4
            node.check_integrity(directory=True)
            d = Directory(server.url, "tn")
            assert d.entries_of(inc) == {}  # the old incarnation's entries were purged
            d.close()
        finally:
            node.shutdown()


def test_entries_the_old_incarnation_wrote_into_an_emptied_redis_are_purged(node, private_redis):
    node.store(*chunks(1))
    old = node.lease.incarnation
    node.registrar._next_heartbeat = float("inf")  # no heartbeat until the test asks for one
    private_redis.restart()
    # before the heartbeat notices, a store registers under the old incarnation in the new Redis
    node._stop.set()  # hold the maintenance thread (the janitor) back
    node._thread.join(timeout=5)
    node.store(*chunks(2))
    d = Directory(private_redis.url, "tn")
    holders = lambda: [inc for inc, _ in d.decode_holders(d.lookup_raw(G, [k(2)])[0] or b"")]  # noqa: E731
    assert holders() == [old]
    node.registrar.heartbeat_now()  # the registrar's thread re-joins and re-registers
    wait_until(lambda: node.lease.incarnation != old and not node.registrar.pending, 5)
    node.janitor.round()
    assert node.lease.incarnation != old and holders() == [node.lease.incarnation]  # the old entry is gone
    node.check_integrity(directory=True)
    d.close()


@pytest.fixture
def gpu_node(private_redis, tmp_path):
    """A node with a 2-slot GPU tier above a 4-slot CPU tier; on machines without CUDA the GPU tier lives on a
    CPU stand-in device, which exercises the same cascade."""
    import torch

    redis.Redis.from_url(private_redis.url).flushall()
    cfg = KVMeshConfig(redis_url=private_redis.url, key_prefix="tn", cpu_bytes=4 * SLOT, slot_bytes=SLOT,
                       gpu_bytes=2 * SLOT, gpu_device="cuda" if torch.cuda.is_available() else "cpu",
                       lease_s=2.0, heartbeat_s=0.2, shm_dir=str(tmp_path))
    n = WireNode(cfg, "node-g" * 4, "kvnode-g")
    yield n
    n.shutdown()


def test_a_node_without_a_gpu_ignores_the_gpu_tier_it_was_given(private_redis, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    cfg = KVMeshConfig(redis_url=private_redis.url, key_prefix="tn", cpu_bytes=4 * SLOT, slot_bytes=SLOT,
                       gpu_bytes=2 * SLOT, gpu_device="cuda", lease_s=2.0, heartbeat_s=0.2, shm_dir=str(tmp_path))
    n = WireNode(cfg, "node-c" * 4, "kvnode-c")  # one cluster-wide config, a node with no GPU: it still starts
    try:
        assert n.cascade.gpu is None and "gpu_chunks" not in n.stats()
        assert n.store(*chunks(1, 2)) == 2 and tiers(n, [1, 2]) == [TIER_CPU, TIER_CPU]
    finally:
        n.shutdown()


def tiers(node, ids) -> list:
    rows = lookup(node, ids)
    return [r[0].tier for r in rows]


def test_gpu_tier_first_then_demotion_and_promotion_with_the_directory_tracking(gpu_node):
    from kvmesh.tiers import TIER_CPU, TIER_GPU

    gpu_node.store(*chunks(1, 2))
    assert tiers(gpu_node, [1, 2]) == [TIER_GPU, TIER_GPU]
    gpu_node.store(*chunks(3, 4))  # the GPU tier holds 2: the older ones are demoted to the CPU tier
    assert tiers(gpu_node, [1, 2, 3, 4]) == [TIER_CPU, TIER_CPU, TIER_GPU, TIER_GPU]
    assert gpu_node.stats()["demotions"] == 2
    header, data = gpu_node.pull(pack_keys([k(3), k(4), k(1)]))  # peers read every tier, bit-exact
    assert data.size == 3 * SLOT and [int(data[i * SLOT]) for i in range(3)] == [3, 4, 1]
    rounds = gpu_node.maintenance_rounds
    wait_until(lambda: gpu_node.maintenance_rounds >= rounds + 2, 5)  # a whole maintenance pass since the pull: 1
    # is not promoted, it would evict 3 or 4 of the same hit
    assert gpu_node.stats()["promotions"] == 0
    header, data = gpu_node.pull(pack_keys([k(1), k(2)]))
    # the hit on 1 and 2 (CPU only) promotes them on the next maintenance pass; 3 and 4 go down (they have
    # CPU copies now, made for the first reader, so nothing needs copying)
    wait_until(lambda: tiers(gpu_node, [1, 2, 3, 4]) == [TIER_GPU, TIER_GPU, TIER_CPU, TIER_CPU], 5)
    assert gpu_node.stats()["promotions"] >= 2
    gpu_node.check_integrity()


def disk_node(private_redis, tmp_path, name="node-d" * 4, **kw):
    cfg = KVMeshConfig(redis_url=private_redis.url, key_prefix="tn", cpu_bytes=kw.pop("cpu_slots", 2) * SLOT,
                       slot_bytes=SLOT,
                       disk_dir=str(tmp_path / "disk"), disk_bytes=kw.pop("disk_slots", 6) * SLOT,
                       lease_s=2.0, heartbeat_s=0.2, shm_dir=str(tmp_path), **kw)
    return WireNode(cfg, name, "kvnode-d")


def settled(node) -> bool:
    s = node.stats()
    return s.get("disk_pending_io", 0) == 0


def test_cpu_evictions_land_on_disk_and_are_served_bit_exact(private_redis, tmp_path):
    from kvmesh.tiers import TIER_CPU, TIER_DISK

    redis.Redis.from_url(private_redis.url).flushall()
    node = disk_node(private_redis, tmp_path)
    try:
        # the CPU holds 2; a prompt's tail is evicted first (its head stays hot), so 3 and 4 go to disk
        node.store(*chunks(1, 2, 3, 4))
        wait_until(lambda: tiers(node, [1, 2, 3, 4]) == [TIER_CPU, TIER_CPU, TIER_DISK, TIER_DISK], 5)
        header, data = node.pull(pack_keys([k(3), k(4)]))  # read back up through the slab (1 and 2 go down)
        assert [int(data[i * SLOT]) for i in range(2)] == [3, 4] and data.size == 2 * SLOT
        wait_until(lambda: tiers(node, [1, 2, 3, 4]) == [TIER_DISK, TIER_DISK, TIER_CPU, TIER_CPU], 5)
        header, data = node.pull(pack_keys([k(1), k(2)]))
        assert [int(data[i * SLOT]) for i in range(2)] == [1, 2]
        wait_until(lambda: settled(node), 5)
        st = node.stats()  # (a chunk read before its write-back finished comes from the write-back buffer)
        assert st["disk_reads"] + st["writeback_hits"] == 4 and st["disk_writes"] >= 2
        node.check_integrity()
    finally:
        node.shutdown()


@pytest.mark.parametrize("new_id", [False, True], ids=["same-node-id", "new-node-id"])
def test_a_restarted_node_recovers_its_disk_and_drops_what_is_corrupt(private_redis, tmp_path, new_id):
    """An actor restart keeps the Ray node id; a raylet or machine restart gets a new one: either way the disk
    tier's chunks come back."""
    from kvmesh.tiers import TIER_DISK

    redis.Redis.from_url(private_redis.url).flushall()
    node = disk_node(private_redis, tmp_path, write_policy="write_through")
    node.store(*chunks(1, 2, 3))
    wait_until(lambda: node.stats().get("disk_writes", 0) == 3, 5)
    old_inc = node.lease.incarnation
    disk_file = node.cascade.disk.path
    slot2 = node.cascade.disk.slot_of(k(2))
    node.kill()  # the process dies without a word: no shutdown, no unregistering (its lease will lapse)
    # a bit flip on disk while it was down
    from kvmesh.tiers.disk import HEADER

    with open(disk_file, "r+b") as f:
        f.seek(slot2 * (HEADER + node.cascade.disk.stride) + HEADER + 7)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    again = disk_node(private_redis, tmp_path, name=("node-n" if new_id else "node-d") * 4,
                      write_policy="write_through")
    try:
        assert again.cascade.disk.path == disk_file and again.lease.incarnation != old_inc
        # (each record is verified by an I/O thread: the corrupt one may be judged after the good ones)
        wait_until(lambda: again.stats().get("disk_recovered", 0) == 2
                   and again.stats().get("disk_recovery_corrupt", 0) == 1, 5)
        rows = lookup(again, [1])
        # (the old incarnation may still be listed until its lease lapses, under another node id)
        assert rows and (again.lease.incarnation, TIER_DISK) in [(h.incarnation, h.tier) for h in rows[0]]
        header, data = again.pull(pack_keys([k(1), k(2), k(3)]))
        assert data.size == SLOT and (data == 1).all()  # 2 is gone, so the run stops there
        header, data = again.pull(pack_keys([k(3)]))
        assert (data == 3).all()
    finally:
        again.shutdown()


def test_a_full_or_failing_disk_refuses_counts_and_keeps_serving(private_redis, tmp_path, monkeypatch):
    import errno as _errno

    from kvmesh.tiers import slots as slots_mod

    # (slots an ENOSPC write set aside are tried again at once: the EIO below must reach a write)
    monkeypatch.setattr(slots_mod, "BACKING_RETRY_S", 0.0)
    redis.Redis.from_url(private_redis.url).flushall()
    node = disk_node(private_redis, tmp_path, disk_slots=3)
    try:
        node.store(*chunks(*range(1, 9)))  # 8 chunks: 2 in the CPU tier, a 3-slot disk budget for the rest
        wait_until(lambda: settled(node) and len(node.cascade.disk) == 3, 5)
        assert node.stats()["drops"] >= 3  # the budget is full: the disk's LRU leaves
        node.cascade.disk.fail_writes_with = _errno.ENOSPC
        node.store(*chunks(11, 12, 13))
        wait_until(lambda: node.stats().get("disk_write_ENOSPC", 0) >= 1, 5)
        header, data = node.pull(pack_keys([k(11), k(12)]))  # the CPU tier still serves
        assert data.size == 2 * SLOT
        node.cascade.disk.fail_writes_with = _errno.EIO
        node.store(*chunks(21, 22))
        wait_until(lambda: node.stats().get("disk_write_EIO", 0) >= 1, 5)
        assert node.stats()["disk_write_errors"] >= 2
        node.check_integrity()
    finally:
        node.shutdown()


def test_the_janitor_purges_a_lapsed_incarnation_and_a_restart_purges_its_predecessor(node, private_redis):
    d = Directory(private_redis.url, "tn")
    from kvmesh.wire import NodeInfo

    ghost = d.join(NodeInfo("ghost" * 4, "kvnode-ghost", "/dev/shm/none", 1024, 64), 1000)  # never heartbeats
    d.register(ghost, 1, G, [k(50), k(51)])
    r = redis.Redis.from_url(private_redis.url)
    # the lease lapses after 1 s; the janitor purges a quarter lease period (0.5 s) after it sees that
    wait_until(lambda: r.hget(d.group_key(G), k(50)[:6]) is None, 8)
    wait_until(lambda: ("ghost" * 4).encode() not in r.hgetall("tn:{n}:inc"), 5)  # then its row is forgotten
    assert node.stats()["purged_incarnations"] >= 1
    # a node that restarts purges what its previous incarnation registered
    node.store(*chunks(1, 2))
    wait_until(lambda: len(lookup(node, [1, 2])) == 2, 5)
    again = WireNode(node.config, node.node_id, "kvnode-a2")
    try:
        assert again.lease.previous == node.lease.incarnation
        wait_until(lambda: r.hget(d.group_key(G), k(1)[:6]) is None, 5)
    finally:
        again.shutdown()
    d.close()


def test_concurrent_pull_throughs_of_the_same_chunks_make_one_transfer(node, tmp_path):
    """Readers on node B all want chunks that only A holds, at the same moment: B pulls each chunk from A once,
    the others wait for that transfer, and every reader gets the bytes from B's slab."""
    import threading

    from kvmesh.wire import PullThrough, pack_pull_through

    (tmp_path / "b").mkdir()
    b = WireNode(node.config.replace(shm_dir=str(tmp_path / "b")), "node-b" * 4, "kvnode-b")
    try:
        node.store(*chunks(1, 2, 3))
        serve = node.data_server._pin

        def slow_serve(keys, requester=""):  # a slow link: the readers' requests overlap the transfer
            time.sleep(0.3)
            return serve(keys, requester)

        node.data_server._pin = slow_serve
        request = pack_pull_through(PullThrough([k(1), k(2), k(3)], G, SLOT, node.node_id, "tcp", 5000))
        replies = []

        def reader():
            pin_id, rows, path, _ = unpack_pin_reply(b.pull_through(request))
            replies.append((pin_id, rows, path))

        threads = [threading.Thread(target=reader) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert node.stats()["pulls"] == 1 and node.stats()["pulled_bytes"] == 3 * SLOT  # one transfer
        assert node.stats()["served_bytes"] == {b.node_id: 3 * SLOT}
        st = b.stats()
        assert st["pull_through_calls"] == 8 and st["pull_through_pulled_chunks"] == 3
        assert st["pull_through_waited_chunks"] == 7 * 3
        for pin_id, rows, path in replies:  # every reader got all three, pinned in B's slab, bit-exact
            assert path == b.info.slab_path and len(rows) == 3
            for i, row in zip((1, 2, 3), rows):
                assert (np.frombuffer(b.tier.chunk_view(row.slot), dtype=np.uint8) == i).all()
            b.unpin(pin_id)
        # B now holds them too, registered (by its registrar, a moment after the readers got their pins): readers of
        # B read them locally from now on
        wait_until(lambda: [{h.node_id for h in r} for r in lookup(b, [1, 2, 3])] == [{node.node_id, b.node_id}] * 3,
                   5)
        b.pull_through(request)
        assert node.stats()["pulls"] == 1 and b.stats()["pull_through_pulled_chunks"] == 3
        b.check_integrity()
    finally:
        b.shutdown()


def test_a_reader_of_a_transient_pull_still_gets_it_when_another_reader_unpins_first(node, tmp_path):
    """Pulled chunks a node does not keep (`replicate_min_readers` > 1: transient) go at their last unpin. A reader
    that shared another's transfer, but was slower to pin, found them gone: the first reader's unpin dropped them
    (found by the thread-safety hunt: 10-22 of 400 coalesced reads came back empty). A reader between its
    pull-through's start and its pin keeps them."""
    from kvmesh.wire import PullThrough, pack_pull_through

    (tmp_path / "b").mkdir()
    b = WireNode(node.config.replace(shm_dir=str(tmp_path / "b"), replicate_min_readers=2), "node-b" * 4, "kvnode-b")
    try:
        node.store(*chunks(1, 2, 3))
        request = pack_pull_through(PullThrough([k(1), k(2), k(3)], G, SLOT, node.node_id, "tcp", 5000))
        first, rows, _, _ = unpack_pin_reply(b.pull_through(request))  # the first reader: pulled, pinned
        assert len(rows) == 3 and b.replicas.is_transient(k(1))
        run, ran, go = b.pull_through_part.run, threading.Event(), threading.Event()

        def slow_to_pin(req):  # the second reader's pull-through: its chunks are here; it pins a moment later
            run(req)
            ran.set()
            go.wait(5)

        b.pull_through_part.run = slow_to_pin
        second = []
        t = threading.Thread(target=lambda: second.append(unpack_pin_reply(b.pull_through(request))))
        t.start()
        assert ran.wait(5)
        b.unpin(first)  # the first reader is done
        go.set()
        t.join(5)
        pin_id, rows, _, _ = second[0]
        assert len(rows) == 3  # before: 0 (the chunks went with the first reader's unpin)
        for i, row in zip((1, 2, 3), rows):
            assert (np.frombuffer(b.tier.chunk_view(row.slot), dtype=np.uint8) == i).all()
        b.unpin(pin_id)
        assert len(b.tier) == 0 and not b.replicas.is_transient(k(1))  # gone at the last unpin, as before
        b.check_integrity()
    finally:
        b.shutdown()


def test_a_pull_through_that_fails_midway_is_shorter_and_frees_its_slots(node, tmp_path):
    from kvmesh.wire import PullThrough, pack_pull_through

    (tmp_path / "b").mkdir()
    b = WireNode(node.config.replace(shm_dir=str(tmp_path / "b")), "node-b" * 4, "kvnode-b")
    try:
        node.store(*chunks(1, 2, 3))
        node.tier.buffer(node.tier.slot_of(k(2)))[5] ^= 0x10  # A's copy of 2 rots: the transfer stops there
        _, rows, _, _ = unpack_pin_reply(b.pull_through(pack_pull_through(
            PullThrough([k(1), k(2), k(3)], G, SLOT, node.node_id, "tcp", 5000))))
        assert len(rows) == 1 and b.stats()["pull_through_pulled_chunks"] == 1
        assert b.tier.slot_of(k(2)) is None and len(b.tier) == 1  # nothing half-written stays reserved
        # the unknown holder, and the Ray path outside Ray, end as shorter reads, not errors
        _, rows, _, _ = unpack_pin_reply(b.pull_through(pack_pull_through(
            PullThrough([k(1), k(7)], G, SLOT, "no-such-node", "tcp", 1000))))
        assert len(rows) == 1 and b.stats()["pull_through_holder_unknown"] == 1
        # (outside Ray: ConnectionError; with this process connected to a test cluster: no such actor there)
        errors = lambda: sum(v for c, v in b.stats().items() if c.startswith("pull_through_error_"))  # noqa: E731
        before = errors()
        _, rows, _, _ = unpack_pin_reply(b.pull_through(pack_pull_through(
            PullThrough([k(3)], G, SLOT, node.node_id, "ray", 1000))))
        assert rows == [] and errors() == before + 1
        b.check_integrity()
    finally:
        b.shutdown()


def test_a_restarted_node_whose_disk_cannot_be_used_starts_without_its_disk_tier(private_redis, tmp_path):
    """A disk that went read-only or away (here: the disk directory's parent is a file) made a restarted node fail
    to start; Ray does not retry a restarted actor whose creation fails, so the node lost its KVNode, CPU tier and
    all, for good (found by the restart hunt, on a read-only bind mount). A restart starts with its other tiers,
    and says why the disk tier is missing."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    cfg = KVMeshConfig(redis_url=private_redis.url, key_prefix="nd", cpu_bytes=16 * SLOT, slot_bytes=SLOT,
                       disk_dir=str(blocker / "disk"), disk_bytes=64 * SLOT, shm_dir=str(tmp_path))
    with pytest.raises(OSError):  # a first start says it (`kvmesh.start` raises it in one line)
        WireNode(cfg, "node-d" * 4, "kvnode-d")
    assert not [f for f in os.listdir(tmp_path) if f.startswith("kvmesh-")]  # and leaves no slab file behind
    n = WireNode(cfg, "node-d" * 4, "kvnode-d", restarted=True)  # a restart (KVNodeActor: Ray restarted it)
    try:
        st = n.stats()
        assert st["disk_unavailable"] == 1 and "disk_chunks" not in st
        assert n.store(*chunks(1, 2)) == 2
        wait_until(lambda: len(lookup(n, [1, 2])) == 2, 5)
    finally:
        n.shutdown()
