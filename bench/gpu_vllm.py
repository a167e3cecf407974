"""The vLLM connector's load into GPU blocks (bench/gpu.py --only vllm), on a machine without vLLM or Ray.

vLLM's worker half (`vllm_worker.WorkerSide` and its loader) is driven with real CUDA tensors in the layouts vLLM's
GPU backends allocate, against a real KVNode run as a plain object in this process (its slab in /dev/shm, page
locked) and a real redis-server (`kvmesh.local.RedisServer`): the chunks are saved through the worker (a background
gather on a side stream, `store_keys` to the node), then loaded by the loader as vLLM would ask (`LoadJob`, async):
one directory lookup, then `client.fetch_to_device` (the slab chunks DMA'd straight into device staging and
verified there by the device checksums their node recorded, on a side stream as each layer lands), then one indexed
write per layer into the blocks, each waiting for its layer's copy alone. The loads start once the node's
device-checksum thread has recorded every chunk's sum (`devsums_after_store_s`: how long after the store's flush);
a chunk read before its sum is recorded is checked with xxh3 instead (the `xxh3` figures below).

    vllm_gpu_load_ratio_to_h2d = raw pinned H2D copy of the same bytes / the connector's load (plan + run, until the
    writes landed), both the minimum of `repeat` runs in the same process. Goal >= 0.9.

Beside it: the same load through the pageable path (`client.fetch` into a new pageable CPU tensor, then the writes
copy from it), and the data plane's fetch alone (lookup + fetch_to_device + verification, no writes). With the
node's device sums hidden from the reader (as for chunks whose sums are not recorded yet): the load verified by
xxh3 on the client's 4 threads (`ratio_to_h2d_xxh3`, the path before device sums), on 8 and 16 threads, and with no
checksum verified at all (`ratio_to_h2d_unverified`: a diagnostic, never a setting); the xxh3 checksums alone on 4
and 8 threads.

The two vLLM modules the connector imports are stubbed (`install_vllm_stubs`), as in tests/gpu.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import types

import numpy as np
import torch

MiB, GiB = 1 << 20, 1 << 30


def install_vllm_stubs() -> list[str]:
    """Stand-ins for the vLLM names the connector's worker half imports; returns the module names installed."""
    class KVConnectorMetadata:
        pass

    class KVConnectorWorkerMetadata:
        pass

    names = ["vllm", "vllm.model_executor", "vllm.model_executor.models", "vllm.distributed",
             "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
             "vllm.distributed.kv_transfer.kv_connector.v1"]
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    utils = types.ModuleType("vllm.model_executor.models.utils")
    utils.extract_layer_index = lambda n: int(n.split(".")[2])
    base = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.base")
    base.KVConnectorMetadata, base.KVConnectorWorkerMetadata = KVConnectorMetadata, KVConnectorWorkerMetadata
    sys.modules[utils.__name__], sys.modules[base.__name__] = utils, base
    return names + [utils.__name__, base.__name__]


def _layers(layout: str, num_layers: int, num_blocks: int, bs: int, heads: int, head_dim: int, device, seed: int):
    """vLLM's per-layer caches in `layout`: 'flash_attn' [2, blocks, bs, H, D], 'flashinfer' [blocks, 2, bs, H, D],
    'logical' (vLLM's KVCacheLayout view [blocks, H, bs, 2D] over [blocks, bs, H, 2D] memory)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    if layout == "flash_attn":
        return [rnd(2, num_blocks, bs, heads, head_dim) for _ in range(num_layers)]
    if layout == "flashinfer":
        return [rnd(num_blocks, 2, bs, heads, head_dim) for _ in range(num_layers)]
    return [rnd(num_blocks, bs, heads, 2 * head_dim).permute(0, 2, 1, 3) for _ in range(num_layers)]


def vllm_load(device, total_bytes: int, timer, layouts=("flash_attn", "flashinfer", "logical"), layers=32, heads=8,
              head_dim=128, block=16, chunk_tokens=256, repeat=5) -> dict:
    try:  # vLLM itself where it is installed (a bare `import vllm` can find bench/vllm.py: bench/ is sys.path[0])
        import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
    except ImportError:
        install_vllm_stubs()
    from kvmesh import KVSpec
    from kvmesh.connecting import connect_local
    from kvmesh.config import KVMeshConfig
    from kvmesh.integrations.vllm_meta import LoadJob, SaveJob, StepMeta
    from kvmesh.integrations.vllm_options import ConnectorOptions
    from kvmesh.integrations.vllm_worker import WorkerSide
    from kvmesh.local import RedisServer
    from kvmesh.node import KVNode

    device = torch.device(device)
    spec = KVSpec("vllm-bench", layers, heads, head_dim, "bfloat16", chunk_tokens=chunk_tokens)
    n = max(1, total_bytes // spec.chunk_bytes)
    per_chunk = chunk_tokens // block
    nblk = n * per_chunk
    num_blocks = nblk + 64
    nbytes = n * spec.chunk_bytes
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    toks = np.random.default_rng(0).integers(0, 1 << 20, n * chunk_tokens).astype("<u4")
    g = torch.Generator().manual_seed(0)
    save_ids = torch.randperm(num_blocks, generator=g)[:nblk].tolist()  # scattered blocks, as vLLM's are
    load_ids = torch.randperm(num_blocks, generator=g)[:nblk].tolist()
    out: dict = {"bytes": nbytes, "chunks": n, "chunk_bytes": spec.chunk_bytes, "block_tokens": block,
                 "shape": f"{layers} layers x {heads} KV heads x {head_dim}, bf16", "repeat": repeat}

    # the raw baseline: a pinned host buffer of the same bytes into device memory
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    raw_h2d = timer(lambda: dev.copy_(host, non_blocking=True), repeat=repeat)
    del host, dev
    out["raw_h2d_s"], out["raw_h2d_gbps"] = raw_h2d, nbytes / raw_h2d / 1e9

    shm = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="kvmesh-vllm-bench-")
    with RedisServer() as server:
        cfg = KVMeshConfig(redis_url=server.url, key_prefix="vb", cpu_bytes=(n + 8) * spec.chunk_bytes,
                           slot_bytes=spec.chunk_bytes, shm_dir=shm, fetch_timeout_s=60.0)
        node = KVNode(cfg, "node-vllm-bench-" * 2, "kvnode-vllm-bench")
        out["cpu_tier_page_locked"] = node.tier.page_locked
        try:
            def worker(kv_layers):
                w = WorkerSide([spec], lambda s: connect_local(s, node), ConnectorOptions(), block, "kv_both",
                               [names], background_copy=True)
                w.register(dict(zip(names, kv_layers)))
                return w

            # save once, from the first layout (the chunks do not depend on the layout)
            src = _layers(layouts[0], layers, num_blocks, block, heads, head_dim, device, 1)
            w = worker(src)
            t0 = time.perf_counter()
            meta = StepMeta(saves=[SaveJob("save", toks.tobytes(), 0, n, save_ids, None, None)])
            w.end_step(meta)
            end = time.monotonic() + 300
            while w.counts["vllm_saved_chunks"] < n and time.monotonic() < end:
                time.sleep(0.01)
            stored = w.client(None).flush(120)
            out["save_s"], out["saved_chunks"], out["stored_chunks"] = time.perf_counter() - t0, \
                w.counts["vllm_saved_chunks"], stored
            t1 = time.perf_counter()
            while node.stats()["slab_devsums_queued"] and time.perf_counter() - t1 < 120:
                time.sleep(0.005)
            st = node.stats()
            out["devsums_after_store_s"] = time.perf_counter() - t1
            out["slab_devsums"], out["slab_devsums_refused"] = st.get("slab_devsums", 0), \
                st.get("slab_devsums_refused", 0)
            src_pieces = [w.codec.pieces(t.index_select(0, torch.tensor(save_ids, device=device))).clone()
                          for t in w.layers]
            w.close()
            del src

            for li, layout in enumerate(layouts):
                dst = _layers(layout, layers, num_blocks, block, heads, head_dim, device, 2)
                for t in dst:
                    t.zero_()
                w = worker(dst)
                job = LoadJob("load", toks.tobytes(), 0, n, load_ids, 0, nblk, None, None, sync=False)

                def load():
                    ld = w.loader.plan(job)
                    w.loader.run(ld)  # what the loader thread runs; ends once the writes landed
                    assert not ld.failed, f"{len(ld.failed)} blocks failed"
                t = timer(load, repeat=repeat)
                idx = torch.tensor(load_ids, device=device)
                exact = all(torch.equal(w.codec.pieces(t_.index_select(0, idx)), p)
                            for t_, p in zip(w.layers, src_pieces))
                r = {"load_s": t, "load_gbps": nbytes / t / 1e9, "ratio_to_h2d": raw_h2d / t, "bit_exact": exact,
                     "codec": type(w.codec).__name__}
                if li == 0:
                    client = w.client(None)
                    keys = client.hashes(toks)

                    def fetch_only():  # the data plane alone: lookup, DMA + verification, no writes
                        m = client.lookup_keys(keys[0], keys)
                        ld, got = client.fetch_to_device(m, device)
                        assert got == n and ld.first_unverified() == n
                        ld.release()
                    r["fetch_to_device_s"] = timer(fetch_only, repeat=repeat)
                    r["fetch_to_device_ratio_to_h2d"] = raw_h2d / r["fetch_to_device_s"]
                    r["previous_path_pageable_s"] = timer(lambda: _previous_path(w, job), repeat=2)
                    # what bounds it: the slab chunks' checksums alone on the client's 4 verifying threads, and on
                    # 8; the same load with 8 (a diagnostic: the client's pool has 4)
                    from concurrent.futures import ThreadPoolExecutor

                    from kvmesh.tiers import checksum

                    views = [node.tier.chunk_view(node.tier.slot_of(k)) for k in keys]
                    for threads in (4, 8):
                        with ThreadPoolExecutor(threads) as pool:
                            r[f"verify_{threads}_threads_s"] = timer(lambda: list(pool.map(checksum, views)),
                                                                     repeat=3)
                    del views
                    pool4 = client._verify_pool
                    with _devsums_hidden(node, keys):  # as if the node had recorded no device sums yet
                        r["load_xxh3_s"] = timer(load, repeat=repeat)
                        r["ratio_to_h2d_xxh3"] = raw_h2d / r["load_xxh3_s"]
                        for threads in (8, 16, 0):  # 0: no checksum verified at all (NOT a safe setting: it
                            # shows what the copies and the writes cost alone, i.e. what bounds the load)
                            client._verify_pool = ThreadPoolExecutor(threads) if threads else _Unverified()
                            try:
                                name = f"{threads}_verify_threads" if threads else "unverified"
                                r[f"load_{name}_s"] = timer(load, repeat=repeat)
                                r[f"ratio_to_h2d_{name}"] = raw_h2d / r[f"load_{name}_s"]
                            finally:
                                client._verify_pool.shutdown()
                                client._verify_pool = pool4
                    from kvmesh.dataplane.sinks import _DeviceCheck

                    ld, got = client.fetch_to_device(client.lookup_keys(keys[0], keys), device)
                    r["chunks_checked_on_device"] = sum(isinstance(c, _DeviceCheck) for c in ld.checks)
                    r["chunks_checked_on_device_all_good"] = ld.first_unverified() == got
                    ld.release()
                    r["speedup_vs_previous_path"] = r["previous_path_pageable_s"] / t
                out[layout] = r
                w.close()
                del dst, w
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        finally:
            node.shutdown()
            try:
                os.rmdir(shm)
            except OSError:
                pass
    main = out[layouts[0]]
    out.update(vllm_gpu_load_ratio_to_h2d=main["ratio_to_h2d"], layout=layouts[0],
               all_bit_exact=all(out[lay]["bit_exact"] for lay in layouts), goal="vllm_gpu_load_ratio_to_h2d >= 0.9")
    return out


class _devsums_hidden:
    """Within it, the node's pins carry no device sums for `keys` (as before the node's device-checksum thread
    came to them): a device sink checks those chunks with xxh3. A diagnostic."""

    def __init__(self, node, keys) -> None:
        self.node, self.keys = node, keys
        self.saved: dict[int, int | None] = {}  # slot -> its recorded device sum

    def __enter__(self):
        with self.node.lock:
            for k in self.keys:
                slot = self.node.tier.slot_of(k)
                rec = self.node.tier.record(slot)
                self.saved[slot], rec.devsum = rec.devsum, None
        return self

    def __exit__(self, *exc) -> None:
        with self.node.lock:
            for slot, d in self.saved.items():
                self.node.tier.record(slot).devsum = d


class _Unverified:
    """An executor that runs nothing: every verification it is given passes at once (a diagnostic only)."""

    def submit(self, fn, *args):
        from concurrent.futures import Future

        f: Future = Future()
        f.set_result(True)
        return f

    def shutdown(self) -> None:
        pass


def _previous_path(w, job) -> None:
    """The load before the device sink: `client.fetch(out=)` into a new pageable CPU tensor, then the writes copy
    from it (the same lookup and writes; scatter_layer moves each layer's slice to the GPU)."""
    from kvmesh.paged import scatter_layer

    client, s = w.client(None), w.spec
    keys = client.hashes(np.frombuffer(job.tokens, dtype="<u4"))
    m = client.lookup_keys(keys[0], keys)
    buf = torch.empty(s.kv_shape(m.num_chunks * s.chunk_tokens), dtype=s.torch_dtype)
    kv = client.fetch(m, out=buf)
    ids = torch.tensor(job.block_ids, dtype=torch.long)
    for i, layer in enumerate(w.layers):
        scatter_layer(kv[i], layer, w.codec, ids)
