"""Regression: a peer fetch to a device planned as several runs must land every chunk's own bytes.

`fetch_to_device` used to reuse one page-locked staging buffer for every peer run of a fetch, so a later run
overwrote the rows an earlier run had already handed on (after their checksums passed): every chunk but the last
run's held another chunk's bytes, and `verified()` still said True. On the CPU the device path is the same planning
and staging, so this runs in CI."""

import torch

import kvmesh
from kvmesh import KVSpec
from tests.integration.conftest import on_node

S = KVSpec("regress-device-fetch", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)


def _kv(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(S.kv_shape(n), generator=g).to(S.torch_dtype)


def _store(toks, kv):
    c = kvmesh.connect(S)
    c.store(toks, kv)
    n = c.flush()
    c.close()
    return n


def _fetch_to_device(toks, batch_bytes):
    c = kvmesh.connect(S, pull_batch_bytes=batch_bytes)
    match = c.lookup(toks)
    load, n = c.fetch_to_device(match, "cpu")
    try:
        return n, load.staging.clone(), load.verified()
    finally:
        load.release()
        c.close()


def test_a_peer_fetch_to_a_device_in_several_runs_lands_every_chunk_s_own_bytes(mesh):
    a, _, c = mesh.node_ids
    toks = list(range(1000, 1000 + 32 * 6))
    kv = _kv(len(toks))
    assert on_node(a, _store, toks, kv) == 6
    for batch in (S.chunk_bytes, 64 << 20):  # one chunk per run, then one run for all six
        n, staging, verified = on_node(c, _fetch_to_device, toks, batch)
        assert n == 6 and verified
        for i in range(6):
            want = kv[:, :, i * 32:(i + 1) * 32]
            assert torch.equal(staging[i], want), f"chunk {i} holds other bytes (runs of {batch} bytes)"
