"""LMCache's compiled paged-KV transfer, timed on the same bytes and layout as kvmesh's P1 (bench/gpu.py).

LMCache (0.5.3 wheel, installed with --no-deps) moves one 256-token chunk per call of
`lmcache.c_ops.multi_layer_kv_transfer`: a pinned host buffer [2, layers, tokens, heads * head_dim] (its KV_2LTD
memory object), an int64 device tensor of the layers' data pointers, the chunk's slot mapping (block * bs + offset
per token), the paged buffer size (num_blocks * block_size), the direction, and EngineKVFormat
NL_X_TWO_NB_BS_NH_HS for per-layer [2, num_blocks, block_size, heads, head_dim] caches. The kernel reads or writes
the host buffer directly (zero-copy through unified addressing); this is how
lmcache/v1/gpu_connector/gpu_connectors.py (VLLMPagedMemGPUConnectorV2.to_gpu / from_gpu) calls it.

The compiled module is loaded from the wheel's files without running `lmcache/__init__` (whose imports need
LMCache's many dependencies, and whose shim silently falls back to a torch implementation when the extension does
not load: here a failure to load is reported instead).
"""

from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import os

import torch


def load_c_ops():
    """The compiled `lmcache.c_ops` module, or raise ImportError saying why."""
    spec = importlib.util.find_spec("lmcache")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("lmcache is not installed")
    paths = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "c_ops*.so"))
    if not paths:
        raise ImportError("the lmcache wheel has no compiled c_ops")
    loader = importlib.machinery.ExtensionFileLoader("lmcache.c_ops", paths[0])
    mod_spec = importlib.util.spec_from_file_location("lmcache.c_ops", paths[0], loader=loader)
    mod = importlib.util.module_from_spec(mod_spec)
    loader.exec_module(mod)
    return mod


def lmcache_paged(paged: list[torch.Tensor], table: torch.Tensor, block: int, chunk_tokens: int, timer,
                  expected_chunks: torch.Tensor | None = None) -> dict:
    """Time LMCache storing every chunk of `table` ([n, pages] of block ids into `paged`, per-layer
    [2, num_blocks, block, H, D]) into pinned buffers and loading them back into other blocks' copies."""
    ops = load_c_ops()
    two, nb, bs, h, d = paged[0].shape
    layers = len(paged)
    device = paged[0].device
    n = table.shape[0]
    ptrs = torch.tensor([t.data_ptr() for t in paged], dtype=torch.int64, device=device)
    slots = (table.to(torch.int64).unsqueeze(-1) * bs + torch.arange(bs, device=device)).reshape(n, -1)
    host = torch.empty((n, 2, layers, chunk_tokens, h * d), dtype=paged[0].dtype, pin_memory=True)
    fmt = ops.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    d2h, h2d = ops.TransferDirection.D2H, ops.TransferDirection.H2D

    def run(direction, kv_ptrs):
        for i in range(n):
            ops.multi_layer_kv_transfer(host[i], kv_ptrs, slots[i], device, nb * bs, direction, fmt, bs, d, 0)

    store_t = timer(lambda: run(d2h, ptrs))
    targets = [torch.zeros_like(t) for t in paged]
    tptrs = torch.tensor([t.data_ptr() for t in targets], dtype=torch.int64, device=device)
    load_t = timer(lambda: run(h2d, tptrs))
    torch.cuda.synchronize()
    flat = table.flatten()
    round_trip = all(torch.equal(t[:, flat], p[:, flat]) for t, p in zip(targets, paged))
    matches = None
    if expected_chunks is not None:  # kvmesh's chunk [L, 2, C, H, D] vs LMCache's [2, L, C, H*D]: same values
        matches = bool(torch.equal(host.view(n, 2, layers, chunk_tokens, h, d).permute(0, 2, 1, 3, 4, 5).cpu(),
                                   expected_chunks.cpu()))
    nbytes = host.numel() * host.element_size()
    return {"lmcache_store_gbps": nbytes / store_t / 1e9, "lmcache_load_gbps": nbytes / load_t / 1e9,
            "lmcache_store_s": store_t, "lmcache_load_s": load_t, "lmcache_round_trip_bit_exact": round_trip,
            "lmcache_store_matches_kvmesh_chunks": matches, "lmcache_calls_per_direction": n}
