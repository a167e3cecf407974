"""Faults at moments the other fault tests do not reach: the directory hangs between a lookup and its fetch, or
while stores come in; a holder goes away between a lookup and its fetch and the worker stores what it recomputed.
Real redis-server (stopped with SIGSTOP: a hang, not a refused connection), KVNode objects in this process."""

import contextlib
import os
import signal
import time
from dataclasses import replace

import pytest
import redis
import torch

from kvmesh.connecting import connect_local
from kvmesh.node import KVNode
from kvmesh.spec import KVSpec
from tests.conftest import wait_until

SPEC = KVSpec("fault-moments-model", 2, 2, 16, "float16", chunk_tokens=16)
CH = SPEC.chunk_tokens


@pytest.fixture
def cfg(private_redis, make_node):
    redis.Redis.from_url(private_redis.url).flushall()
    return make_node.config(redis_url=private_redis.url, key_prefix="fm", cpu_bytes=64 * SPEC.chunk_bytes,
                            slot_bytes=SPEC.chunk_bytes, node_refresh_s=0.2, fetch_timeout_s=5.0)


@pytest.fixture
def nodes(cfg, make_node):
    return lambda name: make_node(name * 32, f"kvnode-{name}", config=cfg)


@contextlib.contextmanager
def hung(server):
    """The directory's server stops answering (its connections stay open), and answers again after."""
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


def prompt(seed: int, chunks: int) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 30000, (chunks * CH + 3,), generator=g).tolist()
    return toks, torch.randn(SPEC.kv_shape(len(toks)), generator=g).to(torch.float16)


def cached_on(writer, reader, seed: int, chunks: int):
    """A prompt of `chunks` chunks stored by `writer` and looked up by `reader`, which sees all of it cached."""
    toks, kv = prompt(seed, chunks)
    writer.store(toks, kv)
    writer.flush()
    match = reader.lookup(toks, cost_model=False)
    assert match.num_chunks == chunks
    return toks, kv, match


def test_a_fetch_keeps_its_deadline_while_the_directory_hangs_and_each_run_goes_to_a_peer(private_redis, nodes):
    # one run per chunk (pull_batch_bytes: one chunk, as the default 32 MiB gives for real chunk sizes): before,
    # every run asked the directory for the holder's address and waited for it, and the fetch took 8 s, not 1
    a, b = nodes("a"), nodes("b")
    writer, reader = connect_local(SPEC, a), connect_local(SPEC, b, peers=[a], pull_batch_bytes=SPEC.chunk_bytes)
    try:
        toks, kv, match = cached_on(writer, reader, 1, 16)
        with hung(private_redis):
            time.sleep(1.0)  # every table here is older than node_refresh_s now
            t0 = time.monotonic()
            got = reader.fetch(match, deadline_s=1.0)
            took = time.monotonic() - t0
        assert took < 1.8, f"a fetch with a 1-s deadline took {took:.2f} s"
        assert got.shape[2] == 16 * CH and torch.equal(got, kv[:, :, : 16 * CH])  # the peer still answers
    finally:
        writer.close()
        reader.close()


def test_stores_return_at_once_while_the_directory_hangs_and_are_registered_when_it_answers(private_redis, nodes):
    # a store waits until its chunks are registered, but not on a directory that does not answer: before, each
    # store held the caller (and, in Ray, one of the node's request threads) for 3 s
    a = nodes("a")
    client = connect_local(SPEC, a)
    try:
        prompts = [prompt(10 + i, 4) for i in range(4)]
        with hung(private_redis):
            took = []
            for toks, kv in prompts:
                t0 = time.monotonic()
                assert client.store(toks, kv) == 4
                took.append(time.monotonic() - t0)
        assert sum(took) < 4.0 and max(took[1:]) < 0.5, f"stores took {[round(t, 2) for t in took]} s"
        # nothing was lost: once the directory answers, every chunk is registered and found
        deadline = time.monotonic() + 10
        while any(client.lookup(t, cost_model=False).num_chunks < 4 for t, _ in prompts):
            assert time.monotonic() < deadline, "the stores made while the directory hung were never registered"
            time.sleep(0.1)
        for toks, kv in prompts:
            assert torch.equal(client.fetch(client.lookup(toks, cost_model=False)), kv[:, :, : 4 * CH])
        a.check_integrity(directory=True)
    finally:
        client.close()


def test_what_a_fetch_did_not_get_is_stored_again_by_the_worker_that_recomputed_it(nodes):
    # the lookup saw the chunks cached on A; A left before the fetch. A store right after a lookup trusts what the
    # lookup saw (no second round trip): it must not trust it for the chunks the fetch failed to get
    a, b = nodes("a"), nodes("b")
    writer, reader = connect_local(SPEC, a), connect_local(SPEC, b, peers=[a])
    try:
        toks, kv, match = cached_on(writer, reader, 2, 6)
        a.shutdown()
        assert reader.fetch(match).shape[2] == 0
        assert reader.store(toks, kv) == 6  # recomputed, and kept on this node
        reader.flush()
        again = reader.lookup(toks, cost_model=False)
        assert again.num_chunks == 6 and {c.node_id for c in again.chunks} == {b.node_id}
        assert torch.equal(reader.fetch(again), kv[:, :, : 6 * CH])
    finally:
        writer.close()
        reader.close()


def test_a_store_that_lands_while_a_pull_through_counts_its_readers_stays_registered_and_held(cfg, nodes):
    # replicate_min_readers=2: a first pull-through of a prompt keeps nothing (its chunks are transient: never
    # registered, dropped at the reader's unpin). A store of the same chunks on the same node, landing during the
    # readers' count (a Redis round trip), was marked transient too: dropped at the unpin, its entries left behind
    a = KVNode(cfg, "a" * 32, "kvnode-a")
    b = KVNode(replace(cfg, coalesce_pulls=True, replicate_min_readers=2), "b" * 32, "kvnode-b")
    writer = connect_local(SPEC, a)
    reader = connect_local(SPEC, b, peers=[a])
    same_node = connect_local(SPEC, b)
    try:
        toks, kv = prompt(3, 4)
        writer.store(toks, kv)
        writer.flush()
        hashes = reader.hashes(toks)
        count_readers, stored = b.replicas.readers, []

        def readers_then_a_store_lands(group):
            n = count_readers(group)
            if not stored:
                chunks = [kv[:, :, i * CH : (i + 1) * CH] for i in range(len(hashes))]
                same_node.stores.submit(hashes[0], hashes, chunks)
                stored.append(same_node.flush())
            return n

        b.replicas.readers = readers_then_a_store_lands
        got = reader.fetch(reader.lookup(toks, cost_model=False))
        assert stored == [4] and torch.equal(got, kv[:, :, : 4 * CH])
        b.check_integrity(directory=True)  # what B holds is listed, and nothing else
        a.shutdown()
        again = reader.lookup(toks, cost_model=False)
        assert again.num_chunks == 4 and torch.equal(reader.fetch(again), kv[:, :, : 4 * CH])
    finally:
        for c in (writer, reader, same_node):
            c.close()
        for n in (a, b):
            n.shutdown()


def test_a_disk_chunk_that_cannot_be_read_is_dropped_and_the_prompt_cached_again(cfg, tmp_path):
    # a bad sector under one chunk's slot (EIO on read): before, the copy stayed listed, every lookup found it,
    # every fetch missed it, and the recomputed store was skipped ("cached"): the prompt could never be cached again
    import errno

    c = replace(cfg, cpu_bytes=4 * SPEC.chunk_bytes, disk_dir=str(tmp_path / "disk"), disk_bytes=32 * SPEC.chunk_bytes,
                disk_direct_io=False)
    a = KVNode(c, "a" * 32, "kvnode-a")
    client = connect_local(SPEC, a)
    try:
        toks, kv = prompt(4, 3)
        client.store(toks, kv)
        client.flush()
        for i in range(3):  # three more prompts push it out of the 4-slot CPU tier onto disk
            more, more_kv = prompt(40 + i, 3)
            client.store(more, more_kv)
            client.flush()
        key = client.hashes(toks)[0]
        deadline = time.monotonic() + 10
        while True:
            with a.lock:
                bad = a.cascade.disk.slot_of(key)
                in_cpu = a.tier.slot_of(key)
            if bad is not None and in_cpu is None:
                break
            assert time.monotonic() < deadline, "the chunk never reached the disk tier alone"
            time.sleep(0.05)
        read = a.cascade.disk.read_chunk

        def bad_sector(slot, nbytes, into=None):
            if slot == bad:
                raise OSError(errno.EIO, "Input/output error")
            return read(slot, nbytes, into)

        a.cascade.disk.read_chunk = bad_sector
        match = client.lookup(toks, cost_model=False)
        assert match.num_chunks == 3
        assert client.fetch(match).shape[2] == 0  # the first chunk cannot be read
        assert a.stats()["disk_read_errors"] == 1
        assert client.store(toks, kv) == 3  # (the fetch got none of them: the worker recomputed all three)
        client.flush()
        again = client.lookup(toks, cost_model=False)
        assert again.num_chunks == 3 and torch.equal(client.fetch(again), kv[:, :, : 3 * CH])
        a.check_integrity(directory=True)
    finally:
        client.close()
        a.shutdown()


def test_a_fetch_on_a_closed_client_says_so(nodes):
    client = connect_local(SPEC, nodes("a"))
    toks, kv = prompt(5, 2)
    client.store(toks, kv)
    client.flush()
    match = client.lookup(toks, cost_model=False)
    client.close()
    with pytest.raises(ValueError, match="closed"):  # (was: "cannot schedule new futures after shutdown")
        client.fetch(match)


def test_a_close_from_another_thread_lets_the_fetch_in_flight_finish(nodes):
    # the fetch raised "cannot schedule new futures after shutdown" (untyped, out of the public API): close() shut
    # down the pools under it. Now close() waits for fetches in flight, up to their deadlines
    import threading

    node = nodes("a")
    writer, reader = connect_local(SPEC, node), connect_local(SPEC, node)
    try:
        toks, kv, match = cached_on(writer, reader, 6, 8)
        local = reader.fetcher.env.local
        real_pin = local.pin
        closer = threading.Thread(target=reader.close)

        def pin_then_close(*a, **k):
            pinned = real_pin(*a, **k)
            closer.start()
            closer.join(2.0)  # close() is under way meanwhile (before: done, the pools shut down)
            return pinned

        local.pin = pin_then_close
        got = reader.fetch(match, deadline_s=node.config.pin_ttl_s)  # longer than half the pin TTL: copied, checked
        closer.join(10)
        assert not closer.is_alive() and torch.equal(got, kv[:, :, : 8 * CH])
        with pytest.raises(ValueError, match="closed"):
            reader.fetch(match)
    finally:
        writer.close()
        reader.close()


def test_a_start_that_cannot_reach_the_directory_leaves_the_disk_tier_to_the_next_try(cfg, tmp_path):
    # a KVNode that Ray restarts during a Redis outage tries again until Redis answers; each failed try kept its
    # disk directory locked, so the try that joined claimed a new, empty one: the node's chunks on disk were lost
    disk = cfg.replace(cpu_bytes=2 * SPEC.chunk_bytes, disk_bytes=16 * SPEC.chunk_bytes, disk_dir=str(tmp_path / "d"),
                       disk_direct_io=False)
    first = KVNode(disk, "d" * 32, "kvnode-d")
    c = connect_local(SPEC, first)
    try:
        toks, kv = prompt(8, 6)
        c.store(toks, kv)
        c.flush()
        wait_until(lambda: first.stats()["disk_chunks"] >= 4 and not first.cascade._pending, 10)
        on_disk = first.stats()["disk_chunks"]
    finally:
        c.close()
        first.shutdown()
    for _ in range(3):
        with pytest.raises(redis.ConnectionError):
            KVNode(disk.replace(redis_url="redis://127.0.0.1:1/0"), "d" * 32, "kvnode-d")
    again = KVNode(disk, "d" * 32, "kvnode-d")
    try:
        assert again.stats()["disk_chunks"] == on_disk
        assert sorted(os.listdir(tmp_path / "d")) == ["kvmesh-disk-000"]
    finally:
        again.shutdown()


def test_close_waits_for_a_fetch_stuck_on_a_hung_holder_only_a_few_seconds(nodes):
    # close() lets the fetches in flight finish, but not for the whole deadline of one stuck on a holder that hangs
    # (a deadline may be a day long)
    import threading

    from kvmesh.client import CLOSE_WAIT_S

    a, b = nodes("a"), nodes("b")
    writer, reader = connect_local(SPEC, a), connect_local(SPEC, b, peers=[a])
    hang = threading.Event()
    real = a.data_server._pin
    try:
        toks, kv, match = cached_on(writer, reader, 9, 4)
        a.data_server._pin = lambda keys, requester="": (hang.wait(60), real(keys, requester))[1]
        fetching = threading.Thread(target=lambda: reader.fetch(match, deadline_s=40.0), daemon=True)
        fetching.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        reader.close()
        assert time.monotonic() - t0 < CLOSE_WAIT_S + 2
    finally:
        hang.set()
        writer.close()
        reader.close()
