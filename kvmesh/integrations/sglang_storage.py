"""`KVMeshStorage`, SGLang's HiCache L3 backend in kvmesh (see kvmesh.integrations.sglang, the module SGLang is
configured with, for the design), and the patch that tells it of SGLang's weight updates (`follow_weight_updates`).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import weakref
from collections import Counter
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvmesh.client import KVMeshClient
from kvmesh.connecting import connect
from kvmesh.hashing import client_salt, root_hash
from kvmesh.integrations.identity import local_model_id
from kvmesh.integrations.sglang_generation import GenerationCounter
from kvmesh.integrations.sglang_spec import (
    chunk_view,
    page_keys,
    parse_options,
    pool_feature,
    server_args,
    spec_for_pool,
)
from kvmesh.raybootstrap import ensure_ray, local_node_id
from kvmesh.spec import KVSpec

log = logging.getLogger("kvmesh.sglang")

_LIVE: weakref.WeakSet = weakref.WeakSet()  # this process's backends, told of weight updates and flushes


def follow_weight_updates() -> None:
    """Tell this process's backends when SGLang loads other weights (`update_weights_from_disk`, `_from_tensor`,
    `_from_distributed`, `_from_ipc`: each ends in `flush_cache_after_weight_update`) and when it has emptied its
    own tiers since (`HiCacheController.reset`, which a flush runs). Without it the engine went on reading the old
    weights' pages for its prompts, and wrote its new weights' pages as the old ones' for engines that still run
    them. Patched once per process."""
    try:
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    except ImportError:  # (an SGLang that updates weights elsewhere, or not at all)
        log.warning("kvmesh: this SGLang's weight updates are not followed; restart engines to change weights")
        return
    updated, reset = SchedulerWeightUpdaterManager.flush_cache_after_weight_update, HiCacheController.reset
    if getattr(updated, "_kvmesh", False):
        return

    def flush_cache_after_weight_update(self, recv_req, *args, **kwargs):
        for backend in list(_LIVE):  # (before SGLang's flush, which ends the backends' stale state)
            backend.weights_updated(getattr(recv_req, "model_path", None), getattr(recv_req, "load_format", None))
        return updated(self, recv_req, *args, **kwargs)

    def reset_tiers(self, *args, **kwargs):
        out = reset(self, *args, **kwargs)
        for backend in list(_LIVE):
            backend.stale = False
        return out

    flush_cache_after_weight_update._kvmesh = True  # type: ignore[attr-defined]
    SchedulerWeightUpdaterManager.flush_cache_after_weight_update = flush_cache_after_weight_update
    HiCacheController.reset = reset_tiers


class KVMeshStorage(GenerationCounter, HiCacheStorage):
    """SGLang's L3 tier in kvmesh. Thread-safe: SGLang calls it from its prefetch and backup threads."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        self.storage_config = storage_config
        self.options = parse_options(storage_config.extra_config)
        if storage_config.is_mla_model:
            raise ValueError("kvmesh SGLang backend: MLA models are not supported (kvmesh chunks hold K and V)")
        if storage_config.should_split_heads:
            raise ValueError(
                "kvmesh SGLang backend: split-head storage (TP sizes of different engines mixed) is not supported"
            )
        client_salt(self.options.get("cache_salt"))  # (the client's: refused here, not when SGLang registers)
        self.counts: Counter[str] = Counter()  # becomes the client's counts (exported with them) once connected
        self.client: KVMeshClient | None = None  # these three are set once SGLang registers its host pool
        self.spec: KVSpec | None = None
        self.mem_pool_host: Any = None  # SGLang's host pool
        self._io = threading.Lock()  # fetch and store share the client's buffers
        self._gen_lock = threading.Lock()
        self._root = b""
        self._generation = 0
        self._group = b""
        self._gen_at = 0.0  # when the counter was last asked for
        self._gen_seen_at = 0.0  # when it was last read (or put back) by this engine
        self._gen_lost_at = 0.0  # when this engine, too long idle to put it back, first found it missing
        self._scratch: torch.Tensor | None = None
        self._loaded: str | None = None  # the identity of weights SGLang loaded since it started, if any
        # the weights changed and SGLang has not emptied its tiers since: the pages it backs up may be the old
        # weights' (a flush refused while requests ran leaves them there), so none is written
        self.stale = False
        self._metrics: dict[str, list] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }
        ensure_ray(self.options.get("ray_address"), "kvmesh-sglang")
        follow_weight_updates()
        _LIVE.add(self)

    # -- registration -------------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """SGLang hands over its host pool: its geometry completes the spec, and the client connects."""
        super().register_mem_pool_host(mem_pool_host)
        spec = spec_for_pool(self.storage_config, mem_pool_host, self.options, server_args(), self._loaded)
        if self.client is not None and spec == self.spec:
            return
        node_id = local_node_id(self.options.get("ray_node_id"))
        try:
            client = connect(
                spec, self.options.get("redis_url"), cache_salt=self.options.get("cache_salt"), node_id=node_id
            )
        except RuntimeError as e:
            if node_id is None or "Ray node" not in str(e):
                raise
            named = "extra_config['ray_node_id']" if self.options.get("ray_node_id") else "$KVMESH_RAY_NODE_ID"
            raise ValueError(f"kvmesh SGLang backend: {named} is {node_id!r}: {e}") from None
        client.counts.update(self.counts)
        # one switch (another spec: another generation counter, another chunk shape): a get or set on another
        # thread must not refresh the old spec's generation into `_generation` between the reset and the new root
        # (the forced refresh below would then write it into the new spec's counter), nor use a closed client
        with self._io, self._gen_lock:
            old = self.client
            self.client, self.spec, self.counts = client, spec, client.counts
            self._layout = mem_pool_host.layout
            self._page_shape = tuple(mem_pool_host.get_data_page(0, flat=False).shape)
            self._root = root_hash(spec.namespace, self.options.get("cache_salt"))
            self._scratch, self._generation, self._group, self._gen_at = None, 0, b"", 0.0
            self._gen_seen_at = self._gen_lost_at = 0.0
        if old is not None:
            old.close()
        self._refresh_generation(force=True)
        if spec.chunk_bytes * 8 < client.config.slot_bytes:
            log.warning(
                "kvmesh: an SGLang page is %d bytes but the nodes' slots are %d bytes; most of each slot "
                "is wasted (set slot_bytes near the page size)",
                spec.chunk_bytes,
                client.config.slot_bytes,
            )
        log.info("kvmesh SGLang backend on node %s: %s", client.node_id, spec)

    def weights_updated(self, model_path: str | None, load_format: str | None = None) -> None:
        """SGLang loaded other weights: from now on this engine's pages are theirs, under their identity (a local
        directory's fingerprint, shared with engines that run that checkpoint; any other weights, from tensors, a
        trainer or a hub name, get an identity of their own that no other engine shares); none is written until
        SGLang has emptied its tiers (`stale`)."""
        self.stale = True
        if model_path and os.path.isdir(model_path) and load_format != "dummy":
            self._loaded = local_model_id(model_path)
        else:
            self._loaded = f"weights-update:{secrets.token_hex(16)}"
        if self.mem_pool_host is None:  # (registered later: with these weights' identity)
            return
        try:
            self.register_mem_pool_host(self.mem_pool_host)
            self.counts["sglang_weight_updates"] += 1
        except Exception as e:  # never the old identity for the new weights: no L3 until the engine restarts
            log.warning("kvmesh: weights changed and the backend could not follow (%s); storage is off", e)
            self.counts["sglang_errors_weight_update"] += 1
            self.close()

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name != "kv":  # SGLang registers its pools at start-up: the engine refuses to start, naming why
            raise ValueError(
                f"kvmesh SGLang backend: the model has {pool_feature(name)} (host pool {name!r}), "
                f"which kvmesh does not support; only models with one uniform KV pool are"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    # -- queries ------------------------------------------------------------------------------------------------
    def _lookup(self, keys: list[str], count: bool = True):
        """The directory's match of `keys`; None while the generation is unknown (a miss)."""
        group = self._refresh_generation()
        assert self.client is not None, "registered"
        if not group:
            return None
        return self.client.lookup_keys(group, page_keys(group, keys), count=count)

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of `keys` some live node holds; one directory round trip."""
        if not keys:
            return 0
        if self.client is None:
            self.counts["sglang_not_registered"] += 1
            return 0
        try:
            match = self._lookup(list(keys))
            n = match.num_chunks if match is not None else 0
        except Exception as e:
            self.counts["sglang_errors_exists"] += 1
            log.warning("kvmesh: batch_exists failed: %s", e)
            return 0
        self.counts["sglang_exists_pages_asked"] += len(keys)
        self.counts["sglang_exists_pages_hit"] += n
        return n

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- reads --------------------------------------------------------------------------------------------------
    def _fetch(self, keys: list[str], write_page) -> int:
        """Fetch the leading cached pages of `keys`; `write_page(i, chunk)` puts page i where SGLang wants it.
        Returns how many pages arrived intact (a failed holder or the deadline truncates)."""
        match = self._lookup(keys, count=False)  # (SGLang asked `batch_exists` first: that lookup is counted)
        n = match.num_chunks if match is not None else 0
        if not n:
            return 0
        s = self.spec
        assert s is not None and self.client is not None, "registered"
        with self._io:
            if self._scratch is None or self._scratch.shape[2] < n * s.chunk_tokens:
                self._scratch = torch.zeros(s.kv_shape(max(n, 16) * s.chunk_tokens), dtype=s.torch_dtype)
            got = self.client.fetch(match, out=self._scratch, deadline_s=self.options.get("fetch_timeout_s"))
            k = got.shape[2] // s.chunk_tokens
            C = s.chunk_tokens
            for i in range(k):
                write_page(i, got[:, :, i * C : (i + 1) * C])
        return k

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Pages of `keys` into the host pool at `host_indices` (page_size slots per key), straight from the
        fetched chunks; True for each page that arrived."""
        t0 = time.monotonic()
        C = self.spec.chunk_tokens if self.spec is not None else 0  # (not registered: _guarded answers 0 pages)
        ok = self._guarded(
            "get",
            len(keys),
            lambda: self._fetch(list(keys), lambda i, chunk: self._host_page(int(host_indices[i * C])).copy_(chunk)),
        )
        self._note("prefetch", ok, t0)
        return [i < ok for i in range(len(keys))]

    def batch_get(self, keys: list[str], target_locations=None, target_sizes=None) -> list:
        """Older interface: pages into `target_locations`, flat tensors in the host pool's page layout."""
        if target_locations is None or len(target_locations) != len(keys):
            self.counts["sglang_errors_get"] += 1
            return [None] * len(keys)
        t0 = time.monotonic()
        ok = self._guarded(
            "get",
            len(keys),
            lambda: self._fetch(list(keys), lambda i, chunk: self._flat_page(target_locations[i]).copy_(chunk)),
        )
        self._note("prefetch", ok, t0)
        return [target_locations[i] if i < ok else None for i in range(len(keys))]

    def get(self, key: str, target_location=None, target_sizes=None):
        if self.client is None:  # not registered yet: a miss (SGLang's single-page get says so with None)
            self.counts["sglang_not_registered"] += 1
            return None
        if target_location is None:
            target_location = self.mem_pool_host.get_dummy_flat_data_page()
        return self.batch_get([key], [target_location])[0]

    # -- writes -------------------------------------------------------------------------------------------------
    def _store(self, keys: list[str], chunks: list[torch.Tensor]) -> bool:
        """Hand the pages not yet cached to the local node and wait until it holds them and registered them."""
        if self.stale:
            self.counts["sglang_set_stale"] += 1
            return False
        group = self._refresh_generation()
        if not group:  # (the generation is unknown for now: see _read_generation)
            self.counts["sglang_set_generation_unknown"] += 1
            return False
        assert self.client is not None, "registered"
        # (waited for at most a read's deadline: the lock is the prefetch thread's too, and a node that stalls
        # must not hold SGLang's reads behind a write for flush's default 30 s; a write not done by then is one
        # SGLang counts as failed, and the node still stores it)
        timeout = self.options.get("fetch_timeout_s", self.client.config.fetch_timeout_s)
        with self._io:  # (this store's own replies: a flush counted an earlier set's late reply as this one's)
            return self.client.store_keys_waited(group, page_keys(group, keys), chunks, timeout).ok

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        t0 = time.monotonic()
        P = self.spec.chunk_tokens if self.spec else 0
        ok = self._guarded(
            "set",
            len(keys),
            lambda: (
                len(keys)
                if self._store(list(keys), [self._host_page(int(host_indices[i * P])) for i in range(len(keys))])
                else 0
            ),
        )
        self._note("backup", ok, t0)
        return [ok == len(keys)] * len(keys)

    def batch_set(self, keys: list[str], values=None, target_locations=None, target_sizes=None) -> bool:
        """Older interface: `values` are flat tensors in the host pool's page layout."""
        if values is None or len(values) != len(keys):
            self.counts["sglang_errors_set"] += 1
            return False
        t0 = time.monotonic()
        ok = self._guarded(
            "set", len(keys), lambda: len(keys) if self._store(list(keys), [self._flat_page(v) for v in values]) else 0
        )
        self._note("backup", ok, t0)
        return ok == len(keys)

    def set(self, key: str, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    # -- helpers ------------------------------------------------------------------------------------------------
    def _host_page(self, index: int) -> torch.Tensor:
        return chunk_view(self.mem_pool_host.get_data_page(index, flat=False), self._layout)

    def _flat_page(self, flat: torch.Tensor) -> torch.Tensor:
        return chunk_view(flat.view(self._page_shape), self._layout)

    def _guarded(self, what: str, n: int, fn) -> int:
        """Run a batch call's body: any failure is a miss (0 pages), counted and logged, never raised."""
        if not n:
            return 0
        if self.client is None:
            self.counts["sglang_not_registered"] += 1
            return 0
        try:
            ok = fn()
        except Exception as e:
            self.counts[f"sglang_errors_{what}"] += 1
            log.warning("kvmesh: batch %s of %d pages failed: %s", what, n, e)
            ok = 0
        self.counts[f"sglang_{what}_pages_asked"] += n
        self.counts[f"sglang_{what}_pages_ok"] += ok
        return ok

    def _note(self, kind: str, pages: int, t0: float) -> None:
        if pages and self.spec is not None:
            dt = max(time.monotonic() - t0, 1e-9)
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(pages * self.spec.chunk_bytes / dt / 1e9)  # GB/s

    def get_stats(self):
        """SGLang's `StorageMetrics`: pages and GB/s of each get/set since the last call (kvmesh's own counters,
        misses by reason included, are in `counts` and exported with the client's)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m, self._metrics = self._metrics, {k: [] for k in self._metrics}
        return StorageMetrics(**m)

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            finally:
                self.client = None
