"""What the chaos scenarios share: deterministic prompts and KV, and `Worker`, a Ray actor that runs client loops
on one node and checks every byte it gets back.

The KV of a chunk is a pure function of its chunk hash (spec, salt and token prefix), so any worker can say what
a fetch must return without asking anyone: a wrong, torn or cross-served byte is a mismatch against it.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import numpy as np
import ray
import torch

import kvmesh
from kvmesh import KVSpec
from kvmesh.hashing import as_tokens, chunk_hashes, salt_bytes

C = 32  # tokens per chunk: small chunks keep CI runs fast; the failure paths do not depend on the size


def make_spec(model: str, dtype: str = "bfloat16") -> KVSpec:
    return KVSpec(model, num_layers=2, num_kv_heads=2, head_dim=16, dtype=dtype, chunk_tokens=C)


def prompt(seed: int, chunks: int, doc: int | None = None, doc_chunks: int = 0) -> list[int]:
    """`chunks` full chunks and a partial one; the first `doc_chunks` come from document `doc` (shared)."""
    head = []
    if doc is not None:
        head = np.random.default_rng(10_000_000 + doc).integers(0, 50_000, doc_chunks * C).tolist()
    tail = np.random.default_rng(seed).integers(0, 50_000, (chunks - len(head) // C) * C + C // 2).tolist()
    return head + tail


def hashes_of(spec: KVSpec, tokens, salt=None) -> list[bytes]:
    return chunk_hashes(spec.namespace, as_tokens(tokens), spec.chunk_tokens, salt_bytes(salt))


def chunk_of(spec: KVSpec, h: bytes) -> torch.Tensor:
    raw = np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, spec.chunk_bytes, dtype=np.uint8)
    return torch.from_numpy(raw).view(spec.torch_dtype).view(spec.chunk_shape)


def kv_for(spec: KVSpec, tokens, salt=None) -> torch.Tensor:
    """The KV every worker stores for `tokens` (the partial tail chunk is zeros: it is never stored)."""
    hs = hashes_of(spec, tokens, salt)
    kv = torch.zeros(spec.kv_shape(len(tokens)), dtype=spec.torch_dtype)
    for i, h in enumerate(hs):
        kv[:, :, i * spec.chunk_tokens:(i + 1) * spec.chunk_tokens] = chunk_of(spec, h)
    return kv


def wrong_bytes(spec: KVSpec, kv: torch.Tensor, tokens, salt=None) -> int:
    """Bytes of a fetched prefix that differ from what was stored for it."""
    n = kv.shape[2]
    if n % spec.chunk_tokens or n > len(tokens):
        return -1  # not a whole-chunk prefix: as wrong as it gets
    want = kv_for(spec, tokens[:n], salt)
    return int((kv.contiguous().view(torch.uint8) != want.view(torch.uint8)).sum())


@dataclass(frozen=True, slots=True)
class Op:
    """One client call a worker thread made, as it saw it."""

    t: float  # wall-clock start
    op: str  # "fetch", "store", "lookup"
    seconds: float
    want: int  # chunks the lookup matched (fetch), or chunks handed over (store)
    got: int  # chunks the fetch returned
    wrong: int  # bytes that differ from what was stored (-1: not a whole-chunk prefix)
    stale: int  # holders named that are not their node's current incarnation (see `Worker._stale`)
    error: str  # the exception a call raised ("" for none: calls must never raise)
    coalesced: bool = False  # the client pulled peer chunks through its own node (`coalesce_pulls`)
    lookup_s: float = 0.0  # the lookup alone (fetch), or the whole store call


@ray.remote(num_cpus=0, max_concurrency=96)
class Worker:
    """Client loops in threads, one `KVMeshClient` per thread, on the node the actor is placed on."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._count = 0
        self._lock = threading.Lock()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        import os

        return os.getpid()

    def store(self, spec: KVSpec, prompts: list[list[int]], salt=None) -> int:
        c = kvmesh.connect(spec, cache_salt=salt)
        try:
            for i, p in enumerate(prompts):
                c.store(p, kv_for(spec, p, salt))
                if i % 8 == 7:  # stay under the client's bound on stores in flight (more would be dropped)
                    c.flush()
            c.flush()
            return sum(len(hashes_of(spec, p, salt)) for p in prompts)
        finally:
            c.close()

    def fetch_each(self, spec: KVSpec, jobs: list[tuple[list[int], dict]], salt=None,
                   start_at: float = 0.0) -> list[Op]:
        """One lookup and fetch per (prompt, client options), in order; the first not before `start_at` (wall
        clock), so that workers started apart can fetch at the same moment."""
        out = []
        clients: dict = {}  # one client per distinct options
        try:
            for toks, options in jobs:
                key = tuple(sorted(options.items()))
                if key not in clients:
                    clients[key] = kvmesh.connect(spec, cache_salt=salt, **options)
                time.sleep(max(0.0, start_at - time.time()))
                out.append(self._fetch(clients[key], spec, toks, salt, deadline_s=5.0))
        finally:
            for c in clients.values():
                c.close()
        return out

    def lookup(self, spec: KVSpec, toks):
        c = kvmesh.connect(spec)
        try:
            return c.lookup(toks)
        finally:
            c.close()

    def fetch_match(self, spec: KVSpec, toks, match, options: dict | None = None) -> Op:
        """Fetch a match made earlier (the world may have changed since), checking what comes back."""
        c = kvmesh.connect(spec, **(options or {}))
        try:
            t, t0 = time.time(), time.monotonic()
            try:
                kv = c.fetch(match, deadline_s=5.0)
                got, wrong, err = kv.shape[2] // spec.chunk_tokens, wrong_bytes(spec, kv, toks), ""
            except Exception as e:  # noqa: BLE001
                got, wrong, err = 0, 0, type(e).__name__
            return Op(t, "fetch", time.monotonic() - t0, match.num_chunks, got, wrong, 0, err)
        finally:
            c.close()

    def progress(self) -> int:
        return self._count

    def stop(self) -> None:
        self._stop.set()

    def loop(self, spec: KVSpec, prompts: list[list[int]], threads: int, max_ops: int, seconds: float,
             store_share: float = 0.0, options_by_thread: list[dict] | None = None, deadline_s: float = 2.0,
             check_stale: bool = False, seed: int = 0) -> list[Op]:
        """`threads` threads pick random prompts and look up + fetch (or, a `store_share` of the time, store)
        until `max_ops` calls were made and `seconds` passed, or `stop()`."""
        self._stop.clear()
        self._count = 0
        t_end = time.monotonic() + seconds
        results: list[list[Op]] = [[] for _ in range(threads)]
        connecting = threading.Lock()

        def run(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            opts = (options_by_thread or [{}])[i % len(options_by_thread or [{}])]
            with connecting:  # one at a time: each client calibrates a memcpy on 64 MiB of scratch
                c = kvmesh.connect(spec, **opts)
            try:
                while not self._stop.is_set():
                    with self._lock:
                        if self._count >= max_ops and time.monotonic() >= t_end:
                            break
                        self._count += 1
                    toks = rng.choice(prompts)
                    if rng.random() < store_share:
                        results[i].append(self._store(c, spec, toks))
                    else:
                        results[i].append(self._fetch(c, spec, toks, None, deadline_s, check_stale,
                                                      opts.get("coalesce_pulls", False)))
            finally:
                c.flush(timeout_s=10)
                c.close()

        ts = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return [op for r in results for op in r]

    # -- one call, checked ------------------------------------------------------------------------------------------
    @staticmethod
    def _store(c, spec: KVSpec, toks) -> Op:
        kv = kv_for(spec, toks)
        t, t0 = time.time(), time.monotonic()
        try:
            n = c.store(toks, kv)
            err = ""
        except Exception as e:  # noqa: BLE001 - a store must never raise; record what did
            n, err = 0, type(e).__name__
        took = time.monotonic() - t0
        return Op(t, "store", took, n, 0, 0, 0, err, lookup_s=took)

    def _fetch(self, c, spec: KVSpec, toks, salt, deadline_s: float, check_stale: bool = False,
               coalesced: bool = False) -> Op:
        before = _epoch(c) if check_stale else None  # (the checks' own round trips are not timed)
        t, t0 = time.time(), time.monotonic()
        want = got = wrong = stale = 0
        lookup_s, err, m = 0.0, "", None
        try:
            m = c.lookup(toks)
            lookup_s = time.monotonic() - t0
            want = m.num_chunks
        except Exception as e:  # noqa: BLE001 - lookup and fetch must never raise; record what did
            err = type(e).__name__
        if check_stale and m is not None and m.chunks:
            stale = self._stale(c, m, before)
            t0 += time.monotonic() - t0 - lookup_s  # take the check out of the fetch's time
        if m is not None:
            try:
                kv = c.fetch(m, deadline_s=deadline_s)
                got = kv.shape[2] // spec.chunk_tokens
                wrong = wrong_bytes(spec, kv, toks, salt)
            except Exception as e:  # noqa: BLE001
                err = type(e).__name__
        return Op(t, "fetch", time.monotonic() - t0, want, got, wrong, stale, err, coalesced, lookup_s)

    @staticmethod
    def _stale(c, match, epoch_before) -> int:
        """Holders in `match` that are not their node's current incarnation in Redis right after the lookup.
        Skipped (0) when the directory's epoch changed around the lookup (or could not be read): then no
        single truth applies."""
        from redis import RedisError

        try:
            table = c.directory.node_table()
        except RedisError:
            return 0
        if epoch_before is _UNKNOWN or table.epoch != epoch_before:
            return 0
        current = set(table.live) | set((table.dead_incarnations or {}).values())
        return sum(1 for ch in match.chunks for h in ch.holders if h.incarnation not in current)


_UNKNOWN = object()


def _epoch(c):
    from redis import RedisError

    try:
        return c.directory.node_table().epoch
    except RedisError:
        return _UNKNOWN


def on(node_id: str, **options):
    """A `Worker` placed on `node_id`."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return Worker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                          **options).remote()


def summarize(ops: list[Op]) -> dict:
    fetches = [o for o in ops if o.op == "fetch"]
    stores = [o for o in ops if o.op == "store"]
    return {
        "fetches": len(fetches), "stores": len(stores),
        "wrong_bytes": sum(max(o.wrong, 0) for o in fetches), "bad_prefixes": sum(o.wrong < 0 for o in fetches),
        "errors_raised": sum(bool(o.error) for o in ops),
        "error_names": sorted({o.error for o in ops if o.error}),
        "truncated_fetches": sum(o.got < o.want for o in fetches),
        "hits": sum(o.want > 0 for o in fetches), "chunks_fetched": sum(o.got for o in fetches),
        "stale_holders": sum(o.stale for o in fetches),
        "max_fetch_s": max((o.seconds for o in fetches), default=0.0),
        "max_lookup_s": max((o.lookup_s for o in fetches), default=0.0),
        "max_store_s": max((o.seconds for o in stores), default=0.0),
    }
