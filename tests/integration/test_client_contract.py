"""What a caller of the raw client may rely on: a tenant's salt is a boundary a call's own salt cannot cross, a
chunk must fit the slots of the node it is stored to, bad arguments are typed errors, a closed client refuses
every call and holds nothing, and a client used from short-lived threads holds a bounded number of directory
connections. Real redis-server, KVNode objects in this process (`connect_local`)."""

import gc
import threading

import pytest
import redis
import torch

from kvmesh.connecting import connect_local
from kvmesh.hashing import root_hash
from kvmesh.spec import KVSpec

SPEC = KVSpec("client-contract-model", 2, 2, 16, "bfloat16", chunk_tokens=16)
CH = SPEC.chunk_tokens


@pytest.fixture
def node(private_redis, make_node):
    redis.Redis.from_url(private_redis.url).flushall()
    return make_node("c" * 32, "kvnode-c", redis_url=private_redis.url, key_prefix="cc",
                     cpu_bytes=32 * SPEC.chunk_bytes, slot_bytes=SPEC.chunk_bytes, lease_s=4.0, heartbeat_s=0.5,
                     node_refresh_s=0.2, fetch_timeout_s=5.0)


def prompt(seed: int, chunks: int) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 30000, (chunks * CH,), generator=g).tolist()
    return toks, torch.randn(SPEC.kv_shape(len(toks)), generator=g).to(SPEC.torch_dtype)


def redis_clients(node) -> int:
    r = redis.Redis.from_url(node.config.redis_url)
    try:
        return len(r.client_list()) - 1  # (not this one)
    finally:
        r.close()


def test_a_calls_salt_goes_behind_the_tenants_and_never_replaces_it(node):
    a = connect_local(SPEC, node, cache_salt="tenant-A")
    b = connect_local(SPEC, node, cache_salt="tenant-B")
    plain = connect_local(SPEC, node)
    try:
        toks, kv = prompt(1, 3)
        a.store(toks, kv, cache_salt="req-1")
        other, kv2 = prompt(2, 3)
        plain.store(other, kv2)
        a.flush()
        plain.flush()
        assert a.lookup(toks, cache_salt="req-1").num_tokens == 3 * CH  # the tenant finds its own
        assert b.lookup(toks, cache_salt="req-1").num_tokens == 0  # the same call salt, another tenant
        assert b.lookup(other, cache_salt="").num_tokens == 0  # an empty call salt is not "no tenant"
        assert b.lookup(other).num_tokens == 0
        assert plain.lookup(other).num_tokens == 3 * CH
        # an unsalted client's call salt is the whole salt: the same chunks as a client salted that way
        plain.store(toks, kv, cache_salt="solo")
        plain.flush()
        solo = connect_local(SPEC, node, cache_salt="solo")
        try:
            got = solo.fetch(solo.lookup(toks))
            assert torch.equal(got.view(torch.int16), kv.view(torch.int16))
        finally:
            solo.close()
        with pytest.raises(ValueError, match="NUL"):
            connect_local(SPEC, node, cache_salt="tenant-A\0req-1")
    finally:
        for c in (a, b, plain):
            c.close()


def test_a_chunk_larger_than_the_nodes_slots_is_refused_at_connect_whatever_the_clients_options(node):
    big = KVSpec("client-contract-model", 2, 2, 16, "bfloat16", chunk_tokens=2 * CH)
    with pytest.raises(ValueError, match="slot_bytes"):
        connect_local(big, node)
    with pytest.raises(ValueError, match="this KVNode's slot_bytes"):
        connect_local(big, node, slot_bytes=big.chunk_bytes)  # (the node's slots stay what they are)


def test_bad_arguments_are_typed_errors_and_leave_the_client_working(node):
    c = connect_local(SPEC, node)
    try:
        toks, kv = prompt(3, 2)
        c.store(toks, kv)
        c.flush()
        with pytest.raises(ValueError, match="chunk_tokens"):
            KVSpec("m", 2, 2, 16, "bfloat16", chunk_tokens=2**64)
        with pytest.raises(ValueError, match="num_layers"):
            KVSpec("m", 2**70, 2, 16, "bfloat16")
        with pytest.raises(TypeError, match="match"):
            c.plan("x", 5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="prompt_tokens"):
            c.plan(c.lookup(toks), -5)
        group = root_hash(SPEC.namespace)
        meta = torch.empty(SPEC.chunk_shape, dtype=SPEC.torch_dtype, device="meta")
        with pytest.raises(ValueError, match="dense CPU or CUDA"):
            c.store_keys(group, [b"k" * 16], [meta])
        got = c.fetch(c.lookup(toks))
        assert torch.equal(got.view(torch.int16), kv.view(torch.int16))
    finally:
        c.close()


def test_a_closed_client_refuses_every_call_and_reopens_nothing(node):
    c = connect_local(SPEC, node)
    toks, kv = prompt(4, 2)
    c.store(toks, kv)
    c.flush()
    match = c.lookup(toks)
    loads = [c.fetch_to_device(match, "cpu") for _ in range(2)]  # never released by their caller
    assert [n for _, n in loads] == [2, 2] and node.stats()["pinned"] == 4  # (pins, not chunks)
    c.close()
    assert node.stats()["pinned"] == 0  # close() released the loads it handed out (not its TTL, 30 s on)
    before = redis_clients(node)
    group = root_hash(SPEC.namespace)
    for call in (
        lambda: c.lookup(toks),
        lambda: c.store(toks, kv),
        lambda: c.lookup_keys(group, [b"k" * 16]),
        lambda: c.store_keys(group, [b"k" * 16], [kv[:, :, :CH]]),
        lambda: c.fetch(match),
        lambda: c.route(toks, [node.node_id]),
    ):
        with pytest.raises(ValueError, match="closed KVMeshClient"):
            call()
    assert redis_clients(node) == before


def test_a_client_used_from_short_lived_threads_keeps_a_bounded_number_of_connections(node):
    c = connect_local(SPEC, node)
    try:
        toks, kv = prompt(5, 2)
        c.store(toks, kv)
        c.flush()
        before = redis_clients(node)
        hits = []
        for _ in range(150):  # a server that runs each request on a thread of its own (more than redis-py's
            t = threading.Thread(target=lambda: hits.append(c.lookup(toks).num_tokens))  # pool makes: 100)
            t.start()
            t.join()
        gc.collect()
        assert hits == [2 * CH] * 150
        assert c.directory.conn.thread_connections() <= 2  # (the last thread's, and one being replaced)
        # on the server: not one per thread (150); the node in this process may have opened a few of its own since
        # (its threads share one pool, which grows with how many of them met at once)
        assert redis_clients(node) <= before + 8
    finally:
        c.close()


def test_a_serve_replicas_load_reporter_outlives_its_closed_client_quietly(node):
    """A replica's shutdown may close its client before its LoadReporter: a request still arriving is priced as a
    full prefill and the reporter's thread ends, neither raises."""
    try:
        from kvmesh.integrations.serve import LoadReporter
    except ImportError as e:  # (kvmesh.MissingExtra: Ray Serve, the serve extra, e.g. on the GPU machine)
        pytest.skip(str(e))

    died: list = []
    hook, threading.excepthook = threading.excepthook, lambda a: died.append(a)
    try:
        c = connect_local(SPEC, node)
        rep = LoadReporter(c, replica_id="replica-1")
        c.close()
        with rep.request(list(range(40))) as tracked:
            assert tracked is not None
        rep._thread.join(timeout=5)
        assert not rep._thread.is_alive() and not died
        rep.close()
    finally:
        threading.excepthook = hook


def test_clients_that_share_counts_report_each_change_once_stores_included(node):
    """An engine's clients (one per LoRA adapter or KV cache group) count into one Counter. Each client's exporter
    shipped every change of it, so the live page and Ray metrics read N times the lookups, and an adapter's stores
    were counted in its own, unshared counters (found by the thread-safety hunt)."""
    from kvmesh.telemetry import Records

    base = connect_local(SPEC, node)
    adapter = connect_local(SPEC, node, cache_salt="adapter-1")
    adapter.share_counts(base)
    try:
        for seed in range(5):
            base.lookup(prompt(seed, 2)[0])
            adapter.lookup(prompt(seed, 2)[0])
        toks, kv = prompt(9, 3)
        assert adapter.store(toks, kv) == 3
        adapter.flush()
        assert base.counts["lookups"] == 10 and base.counts["stored_chunks"] == 3
        base._flush_telemetry()
        adapter._flush_telemetry()
        base._flush_telemetry()
        r = redis.Redis.from_url(node.config.redis_url)
        totals = {k.decode(): int(v) for k, v in r.hgetall(Records(r, node.config.key_prefix).k_totals).items()}
        r.close()
        assert totals["lookups"] == 10 and totals["stored_chunks"] == 3, totals
    finally:
        adapter.close()
        base.close()
