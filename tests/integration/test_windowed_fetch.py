"""A fetch larger than the slab can pin at once: its chunks come through the node's slab in windows, each released
before the next is pinned, so a prompt whose KV is larger than the reader's CPU tier (its chunks on disk, or pulled
through a small node) is read whole, bit-exact, into every sink. Plain KVNodes against a real redis-server (no Ray:
the same file runs on a GPU machine, where the device sink is a CUDA one and the GPU tier is a source too)."""

import pytest
import torch

from kvmesh import KVSpec
from kvmesh.connecting import connect_local
from kvmesh.handle import LocalHandle
from kvmesh.hashing import as_tokens, chunk_hashes
from kvmesh.node import KVNode
from tests.conftest import NodeFactory, wait_until

SPEC = KVSpec("windows", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)
SLOT = 64 * 1024
N, SMALL = 40, 8  # chunks per prompt; the small slab's slots (a fetch may pin half of it: windows of 2)
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    from kvmesh.local import RedisServer

    with RedisServer() as server, NodeFactory(tmp_path_factory.mktemp("windows"), server.url) as make:
        base = make.config(key_prefix="win", cpu_bytes=64 * SLOT, slot_bytes=SLOT, lease_s=4.0, heartbeat_s=0.5,
                           node_refresh_s=0.2, fetch_timeout_s=10.0)
        small = base.replace(cpu_bytes=SMALL * SLOT)
        configs = {
            "D": small.replace(disk_bytes=4 * N * SLOT, disk_dir=make.disk_dir),  # a small slab above a disk
            "B": base,  # holds in its (large) slab
            "C": small,  # reads through its small slab (coalesce_pulls)
        }
        if CUDA:  # a GPU tier larger than its slab
            configs["G"] = small.replace(gpu_bytes=2 * N * SLOT, gpu_device="cuda")
        made: dict[str, KVNode] = {}
        for role, cfg in configs.items():
            n = made[role] = make(f"node-{role}" * 6, f"kvnode-{role}", config=cfg)
            n.peers = lambda node, me=n: next(
                (LocalHandle(p, me.node_id) for p in made.values() if p.node_id == node), None)
        yield made


def client(nodes, role, **opts):
    return connect_local(SPEC, nodes[role], peers=[n for r, n in nodes.items() if r != role], **opts)


def data(seed: int):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 50_000, (N * SPEC.chunk_tokens + 7,), generator=g).tolist()
    return toks, torch.randn(SPEC.kv_shape(len(toks)), generator=g).to(SPEC.torch_dtype)


def keys(toks):
    return chunk_hashes(SPEC.namespace, as_tokens(toks), SPEC.chunk_tokens)


def store(nodes, role, toks, kv):
    """`role` holds the prompt's N chunks: D on its disk (all but the last few), stored a slab's worth at a time."""
    c = client(nodes, role)
    ks, n = keys(toks), SPEC.chunk_tokens
    try:
        if role == "G":
            kv = kv.to("cuda")
        for at in range(0, N, SMALL):
            c.store_keys(ks[0], ks[at : at + SMALL], [kv[:, :, i * n : (i + 1) * n] for i in range(at, at + SMALL)])
            assert c.flush() == SMALL
            wait_until(lambda: nodes[role].stats().get("disk_pending_io", 0) == 0, 10)
    finally:
        c.close()
    if role == "G":
        return
    # (a chunk whose disk write is under way is in neither tier for a moment: disk_pending_io counts only the
    # writes not yet taken by a writer thread)
    wait_until(lambda: all(nodes[role].locate(ks)), 10)
    where = [{t for t, *_ in w} for w in nodes[role].locate(ks)]
    if role == "D":
        assert sum("disk" in w for w in where) >= N - SMALL, where


def corrupt(nodes, role, toks, index):
    """Flip one byte of chunk `index` where `role` keeps it (its disk copy on D, its slab copy on B)."""
    key = keys(toks)[index]
    (_tier, path, offset), = [w for w in nodes[role].locate([key])[0] if w[0] == ("disk" if role == "D" else "cpu")]
    with open(path, "r+b") as f:
        f.seek(offset + 1000)
        b = f.read(1)
        f.seek(offset + 1000)
        f.write(bytes([b[0] ^ 0x20]))


def fetch(c, match, sink):
    s = SPEC
    if sink == "new":
        return c.fetch(match)
    if sink == "out":
        out = torch.full(s.kv_shape(N * s.chunk_tokens), 7.0, dtype=s.torch_dtype)
        got = c.fetch(match, out=out)
        assert got.data_ptr() == out.data_ptr()
        return got
    load, n = c.fetch_to_device(match, DEVICE)
    if load is None:
        return torch.empty(s.kv_shape(0), dtype=s.torch_dtype)
    try:
        n = min(n, load.first_unverified())
        return load.staging[:n].permute(1, 2, 0, 3, 4, 5).reshape(s.kv_shape(n * s.chunk_tokens)).cpu()
    finally:
        load.release()


SOURCES = [("D", "D", {}), ("C", "B", {"coalesce_pulls": True}), ("B", "D", {})] + ([("G", "G", {})] if CUDA else [])


@pytest.mark.parametrize("fault", ["none", "corrupt"])
@pytest.mark.parametrize("sink", ["new", "out", "device"])
@pytest.mark.parametrize("reader,holder,opts", SOURCES, ids=["disk", "via", "peer-disk", "gpu"][: len(SOURCES)])
def test_fetch_larger_than_the_slab(nodes, reader, holder, opts, sink, fault):
    if fault == "corrupt" and holder == "G":
        pytest.skip("GPU-tier corruption is the matrix's (tests/gpu/test_matrix_cuda.py)")
    toks, kv = data(hash((reader, sink, fault)) % 10_000)
    store(nodes, holder, toks, kv)
    bad = 29  # in a later window
    if fault == "corrupt":
        corrupt(nodes, holder, toks, bad)
    c = client(nodes, reader, **opts)
    try:
        match = c.lookup(toks, cost_model=False)
        assert match.num_chunks == N
        got = fetch(c, match, sink)
        want = bad if fault == "corrupt" else N
        assert got.shape[2] == want * SPEC.chunk_tokens, f"{got.shape[2] // SPEC.chunk_tokens} chunks, not {want}"
        assert torch.equal(got.view(torch.uint8), kv[:, :, : want * SPEC.chunk_tokens].contiguous().view(torch.uint8))
        if fault == "none":
            assert not c.counts["fetch_truncated"]
    finally:
        c.close()
    wait_until(lambda: all(n.stats()["pinned"] == 0 for n in nodes.values()), 5)
    if fault == "corrupt":  # the bad copy was dropped: the prompt is cached up to it
        c = client(nodes, reader, **opts)
        try:
            wait_until(lambda: c.lookup(toks, cost_model=False).num_chunks == bad, 5)
        finally:
            c.close()


def test_a_window_fetch_leaves_room_for_stores(nodes):
    """While a reader's fetch runs through D's small slab, it pins at most half of it."""
    toks, kv = data(4242)
    store(nodes, "D", toks, kv)
    c = client(nodes, "D")
    try:
        seen = []
        pin = nodes["D"].pin

        def watching(keys, *a, **k):
            seen.append(nodes["D"].stats()["pinned"] + len(keys))
            return pin(keys, *a, **k)

        nodes["D"].pin = watching
        try:
            assert c.fetch(c.lookup(toks, cost_model=False)).shape[2] == N * SPEC.chunk_tokens
        finally:
            del nodes["D"].pin
        assert seen and max(seen) <= SMALL // 2, seen
    finally:
        c.close()


def test_a_store_larger_than_the_slab_goes_to_disk_whole(nodes):
    # one store of a prompt five times D's slab: each chunk it evicts goes to D's disk through a write-back buffer.
    # Before, the buffers (16) were handed to the disk writers only once the whole store was done, so the chunks
    # evicted after the 16th were dropped: the prompt's middle was lost, and with it the use of its tail on disk
    toks, kv = data(777)
    before = nodes["D"].stats()
    c = client(nodes, "D")
    try:
        assert c.store(toks, kv) == N and c.flush() == N
        # (a chunk on its way to the disk is in neither tier for a moment: read from its write-back buffer then)
        wait_until(lambda: all(nodes["D"].locate(keys(toks))), 10)
        got = c.fetch(c.lookup(toks, cost_model=False))
        assert torch.equal(got.view(torch.uint8), kv[:, :, : N * SPEC.chunk_tokens].contiguous().view(torch.uint8))
    finally:
        c.close()
    after = nodes["D"].stats()
    assert after["write_buffers_full"] == before["write_buffers_full"]  # (drops: the full disk's own evictions)


@pytest.mark.parametrize("reader", ["D", "B"], ids=["local", "peer"])
def test_a_prefix_that_fills_the_slab_and_goes_on_to_disk_is_read_whole(nodes, reader):
    # D's slab holds the prompt's first 8 chunks (all it has room for), its 9th is on D's disk. The fetch pinned the
    # 8 where they lay and then found no slot to read the 9th into: 8 chunks and "not_held", a second late. A fetch
    # that brings chunks into a slab is windowed once all it pins there passes half of it
    toks, kv = data(9191 if reader == "D" else 9192)
    store(nodes, "D", toks, kv)
    n = SPEC.chunk_tokens
    c = client(nodes, reader)
    try:
        for _ in range(5):  # (read into D's slab through windows: mostly once is enough, other work may evict one)
            first = c.lookup(toks[: SMALL * n], cost_model=False)
            assert torch.equal(c.fetch(first), kv[:, :, : SMALL * n])
            match = c.lookup(toks[: (SMALL + 1) * n], cost_model=False)
            if [ch.tier for ch in match.chunks] == ["cpu"] * SMALL + ["disk"]:
                break
        assert [ch.tier for ch in match.chunks] == ["cpu"] * SMALL + ["disk"]
        got = c.fetch(match)
        assert got.shape[2] == (SMALL + 1) * n and not c.last_fetch.error, c.last_fetch
        assert torch.equal(got.view(torch.uint8), kv[:, :, : (SMALL + 1) * n].contiguous().view(torch.uint8))
    finally:
        c.close()
