"""The data-plane matrix: every source x sink x split x fault, bit-exact. Shared by the Ray-cluster matrix that CI
runs (tests/integration/test_matrix.py, CPU device sink) and the CUDA one run on a GPU machine without Ray
(tests/gpu/test_matrix_cuda.py, plain KVNodes).

Dimensions:
    source  slab (the reader's own node), tcp (a peer's data server), ray (a peer's actor), via (pulled through the
            reader's node: coalesce_pulls), disk (a peer whose copies are on its disk tier only); and on a GPU
            machine only (GPU_SOURCES): gpu (the reader's own node holds them in its GPU tier, stored there device
            to device, read device to device through the pool it exports)
    sink    new (a new CPU tensor), out (the caller's `out=`), device (`fetch_to_device`)
    split   one_run (one holder, one request), per_chunk (one holder, one chunk per batch: six parallel
            requests), interleaved (two holders, chunk by chunk)
    fault   none; holder_removed (a holder's KVNode is killed after the lookup, before the fetch); corrupt (one
            byte of chunk K flipped where its holder keeps it)

Each case checks: every delivered chunk equals its own reference bytes; a fault truncates at the first bad chunk
(exactly: K for a corrupt chunk, the removed holder's first chunk for a removal); no pin outlives the call; the
holder of a corrupt copy counts it and drops it (a later lookup stops before it). Slab chunks read into the device
sink are read once their node has recorded their device checksums, and must have been checked by those, over the
bytes as they landed on the device (not by xxh3 on the reader's CPU threads): a corrupt one is caught that way.
"""

from __future__ import annotations

import itertools
import os

import torch

from kvmesh import KVSpec
from tests.conftest import wait_until

SOURCES = ("slab", "tcp", "ray", "via", "disk")
GPU_SOURCES = ("gpu",)
SINKS = ("new", "out", "device")
SPLITS = ("one_run", "per_chunk", "interleaved")
FAULTS = ("none", "holder_removed", "corrupt")
N, K = 6, 2  # chunks per case; the chunk a corruption hits
SPEC = KVSpec("matrix", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)
if os.environ.get("KVMESH_MATRIX_SPEC"):  # another shape: "layers,kv_heads,head_dim,dtype,chunk_tokens"
    _l, _h, _d, _t, _c = os.environ["KVMESH_MATRIX_SPEC"].split(",")
    SPEC = KVSpec("matrix", num_layers=int(_l), num_kv_heads=int(_h), head_dim=int(_d), dtype=_t,
                  chunk_tokens=int(_c))

# (reader, holder of the even chunks, holder of the odd chunks) per source; roles are the backend's nodes:
# A and B hold in memory, C reads, D holds on disk, G holds in its GPU tier
ROLES = {"slab": ("A", "A", "B"), "tcp": ("C", "A", "B"), "ray": ("C", "A", "B"), "via": ("C", "A", "B"),
         "disk": ("C", "D", "A"), "gpu": ("G", "G", "B")}


def cases(sources=SOURCES, sinks=SINKS, splits=SPLITS, faults=FAULTS) -> list[tuple[str, str, str, str]]:
    return list(itertools.product(sources, sinks, splits, faults))


def case_id(case) -> str:
    return "-".join(case)


def options(source: str, split: str) -> dict:
    opts = {"peer_transport": "ray" if source == "ray" else "tcp", "coalesce_pulls": source == "via"}
    if split == "per_chunk":
        opts["pull_batch_bytes"] = SPEC.chunk_bytes
    return opts


def holders(source: str, split: str) -> list[str]:
    """The role holding each chunk."""
    _reader, even, odd = ROLES[source]
    return [even if (split != "interleaved" or i % 2 == 0) else odd for i in range(N)]


def removed(source: str, split: str) -> str:
    """The holder a removal kills: the only one, or the holder of the odd chunks."""
    return holders(source, split)[1]


def expected(source: str, split: str, fault: str) -> int:
    if fault == "corrupt":
        return K
    if fault == "holder_removed":
        return holders(source, split).index(removed(source, split))
    return N


def data(seed: int, n: int = N) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 50_000, (n * SPEC.chunk_tokens,), generator=g).tolist()
    return toks, torch.randn(SPEC.kv_shape(len(toks)), generator=g).to(SPEC.torch_dtype)


def corrupt_offset() -> int:
    """Where in a chunk a corruption flips its byte: inside the chunk, whatever the shape."""
    return min(1000, SPEC.chunk_bytes // 2)


def to_ray(t: torch.Tensor) -> torch.Tensor:
    """A KV tensor as bytes for a Ray argument or result (torch cannot unpickle float8 tensors); `from_ray` undoes it."""
    return t.contiguous().view(torch.uint8)


def from_ray(t: torch.Tensor) -> torch.Tensor:
    return t.view(SPEC.torch_dtype)


def keys(toks) -> list[bytes]:
    from kvmesh.hashing import as_tokens, chunk_hashes

    return chunk_hashes(SPEC.namespace, as_tokens(toks), SPEC.chunk_tokens)


def seed(case) -> int:
    import zlib

    return zlib.crc32(case_id(case).encode()) % 100_000 + 1


def chunk(kv: torch.Tensor, i: int) -> torch.Tensor:
    c = SPEC.chunk_tokens
    return kv[:, :, i * c:(i + 1) * c]


def run_case(backend, case) -> None:
    """`backend`: store(role, toks, kv, only) / lookup(role, toks, opts) / fetch(role, match, sink, opts) ->
    (delivered, kv of the delivered chunks), leaving in `backend.device_checked` the chunk indices a device sink
    checked by device checksum / kill(role) / revive(role) / corrupt(role, toks, index) / counters(role) -> dict /
    pinned() -> {role: pinned} / lookup_len(role, toks) -> chunks cached."""
    source, sink, split, fault = case
    reader = ROLES[source][0]
    toks, kv = data(seed(case))
    where = holders(source, split)
    for role in dict.fromkeys(where):
        backend.store(role, toks, kv, [i for i, r in enumerate(where) if r == role])
    device_slab = source in ("slab", "gpu") and sink == "device"  # GPU-tier chunks always carry device sums
    if device_slab:  # the reader's node has recorded its chunks' device checksums (a background thread)
        wait_until(lambda: backend.counters(reader)["slab_devsums_queued"] == 0, 10)
    opts = options(source, split)
    match = backend.lookup(reader, toks, opts)
    assert match.num_chunks == N, f"the lookup found {match.num_chunks} of {N} chunks"
    bad_holder = where[K]
    before = backend.counters(bad_holder)
    if fault == "corrupt":
        backend.corrupt(bad_holder, toks, K)
    if fault == "holder_removed":
        backend.kill(removed(source, split))
    try:
        delivered, got = backend.fetch(reader, match, sink, opts)
    finally:
        if fault == "holder_removed":
            backend.revive(removed(source, split))
    want = expected(source, split, fault)
    assert delivered == want, f"delivered {delivered} chunks, expected {want}"
    if device_slab:  # every slab chunk up to the result (and the corrupt one) was checked on the device
        must = {i for i in range(want + (fault == "corrupt")) if where[i] == reader}
        checked = set(backend.device_checked)
        assert must <= checked, f"slab chunks {sorted(must - checked)} were not checked by device checksum"
    assert got.shape[2] == delivered * SPEC.chunk_tokens
    for i in range(delivered):
        c = SPEC.chunk_tokens
        assert torch.equal(got[:, :, i * c:(i + 1) * c].view(torch.uint8), chunk(kv, i).contiguous().view(
            torch.uint8)), f"chunk {i} holds other bytes"
    backend.no_pins()
    if fault == "corrupt":
        after = backend.counters(bad_holder)
        # (a chunk its disk returned damaged is a corrupt chunk too, besides a disk checksum failure)
        dropped = after.get("corrupt_dropped", 0) - before.get("corrupt_dropped", 0)
        assert dropped == 1, f"the holder counted {dropped} corrupt chunks"
        backend.wait_lookup_len(reader, toks, opts, K)  # and it is no longer listed


def device_checked(load) -> list[int]:
    """The chunk indices of a `LayerwiseLoad` checked by device checksum (not by xxh3 on CPU threads)."""
    from kvmesh.dataplane.sinks import _DeviceCheck

    return [i for i, c in zip(load.checked, load.checks) if isinstance(c, _DeviceCheck)]
