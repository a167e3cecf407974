"""`KVNode`: owns one Ray node's tiers. A plain class with typed methods; `actor.KVNodeActor` is its wire edge,
which `kvmesh.start` runs as a threaded Ray actor (so a long pull never blocks a pin).

    hello() -> NodeHello                  reads: NodeInfo, incarnation and config, for clients on this node
    pin(keys, requester) -> Pinned        mutates: pins the leading run of held chunks for a same-node reader
    unpin(pin_id)                         mutates
    pull(keys, requester) -> Pulled       reads: the leading run of held chunks, verified, for a peer (the Ray path;
                                          the node's DataServer serves the same over TCP, see transport.py)
    store(items, buf) -> int              mutates: places chunks in the tiers; returns once they are registered
    reserve_gpu(items, requester) -> GpuReserved   mutates: GPU-tier slots for chunks a same-node writer copies
                                          in device to device (`gpu_ipc.write_chunks`); released after pin_ttl_s
                                          unless committed
    commit_gpu(reservation_id, sums) -> int   mutates: checks each written slot against the writer's device sum;
                                          the chunks that match become readable and are registered
    report_corrupt(keys) -> int           mutates: re-verifies the named chunks, drops the bad ones
    pull_through(PullThrough) -> Pinned   mutates: pins the leading run here, first pulling from the holder the
                                          chunks not here yet (`pullthrough.py`, through the data plane)
    stats() -> dict, check_integrity(...) reads
    shutdown()                            mutates: unregisters, leaves the directory, frees the slab

The node is a facade over parts that own their state: the tier `Cascade` and the pins (under `lock`), the
`Registrar` (the single writer of the node's directory entries and lease), the GPU-tier `Reservations` of
same-node writers, the `Janitor`, the `PullThrough` (with its own `Fetcher`), a `NodeView` of its peers, and the
`DataServer`. Threads: Ray's request threads, the registrar's, one maintenance thread (pin expiry, promotions,
telemetry, the janitor), the disk I/O threads, and one device-checksum thread (`_devsum_loop`: the device
checksums of CPU-slab chunks, which pins hand to readers so that a device sink verifies those chunks on the GPU;
see tiers.cpu and tiers.devsum).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import queue
import re
import secrets
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import redis

from kvmesh.cascade import Cascade
from kvmesh.config import KVMeshConfig
from kvmesh.dataplane.fetcher import Fetcher
from kvmesh.dataplane.sources import Env
from kvmesh.directory import FIELD_BYTES, Directory, horizon_for
from kvmesh.handle import NodeHandle, NodeHello, Pinned, Pulled
from kvmesh.janitor import Janitor
from kvmesh.lastcopy import LastCopies
from kvmesh.nodeview import NodeView, TableFile
from kvmesh.pullthrough import PullThrough
from kvmesh.registrar import Registrar
from kvmesh.replication import Replicas
from kvmesh.reservations import Reservations
from kvmesh.telemetry import RayExporter, Records, export_node_stats
from kvmesh.tiers import TIER_DISK, TIER_NAMES, checksum
from kvmesh.tiers.cpu import CpuTier
from kvmesh.transport import DataClient, DataServer
from kvmesh.wire import MAX_DEADLINE_MS, GpuReserved, NodeInfo, PinnedChunk, StoreItem, WireError
from kvmesh.wire import PullThrough as PullRequest

log = logging.getLogger("kvmesh.node")


def _advise(directory: Directory) -> None:
    """Say once, at the node's start, what in the directory server's settings makes kvmesh slow."""
    try:
        advice = directory.encoding_advice()
    except Exception:  # (a node stopped at once: its directory closed)
        return
    if advice:
        log.warning("%s", advice)


# a slab, its table relay, and the relay's temp file (`TableFile.write`: a node killed mid-write leaves it)
_SLAB_RE = re.compile(r"^kvmesh-(?P<node>[0-9a-f]+)-(?P<pid>\d+)-[0-9a-f]+(\.nodes(\.\d+\.\d+)?)?$")
MAX_HOLD_S = MAX_DEADLINE_MS / 1000  # the longest a reader may ask a pin to be held beyond the pin TTL
PIN_WAIT_S = 1.0  # a pin waits at most this long for chunks it cannot bring into the slab this moment
WRITEBACK_WAIT_S = 2.0  # a store waits at most this long, in all, for write-back buffers (then evictions drop)
REGISTER_WAIT_S = 3.0  # a store returns once its chunks are registered, or after this (they stay queued)
MAX_PENDING_EVENTS = 200  # live-page events kept while Redis is away (it keeps the last 200 anyway)


def remove_stale_slabs(shm_dir: str = "/dev/shm") -> int:
    """Unlink slabs (and their node-table relays) whose KVNode process is gone (killed with SIGKILL, or its node
    removed). Returns how many."""
    removed = 0
    for name in os.listdir(shm_dir):
        m = _SLAB_RE.match(name)
        if not m:
            continue
        try:
            os.kill(int(m["pid"]), 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed += 1
            except OSError:
                pass
        except PermissionError:
            pass
    return removed


def setting_error(name: str, path: str, e: OSError) -> OSError:
    """`e`, from setting up a tier at `path`, as the same kind of error naming the setting (`KVMeshConfig.<name>`):
    a start that fails says which option to change ("File exists" for a path that is a file says little)."""
    if isinstance(e, FileExistsError) and not os.path.isdir(path):
        e = NotADirectoryError(errno.ENOTDIR, "Not a directory")
    return type(e)(e.errno, f"KVMeshConfig.{name} {path!r} cannot be used: {e.strerror or e}")


def fit_slots(num_slots: int, slot_bytes: int, free_bytes: int) -> int:
    """The CPU tier's slots: as configured, or, where the shared-memory file system cannot hold that many (a
    sparse slab bigger than /dev/shm would die of SIGBUS when touched), as many as half its free space holds (the
    other half is left to Ray's object store, which lives there too)."""
    if num_slots * slot_bytes <= free_bytes:
        return num_slots
    return max(1, free_bytes // 2 // slot_bytes)


class KVNode:
    def __init__(
        self,
        config: KVMeshConfig,
        node_id: str,
        actor_name: str = "",
        host: str = "127.0.0.1",
        restarted: bool = False,
    ) -> None:
        """`restarted` (Ray restarted this node's actor): a disk or GPU tier that cannot be had now is left out,
        not an error (a first start fails instead, said in one line)."""
        self._restarted = restarted
        self.config = config
        self.node_id = node_id
        self.stats_counts: Counter[str] = Counter()
        self.lock = threading.Lock()  # guards the cascade (tiers), the pins and the stats
        # pin id -> (slab slots, GPU-tier slots, monotonic deadline)
        self._pins: dict[int, tuple[list[int], list[int], float]] = {}
        self._pulling: Counter[bytes] = Counter()  # keys -> pull-throughs between their start and their pin
        # from a random start: an unpin a client meant for this node's previous process (Ray restarted it under the
        # same handle) must not release a pin of this one
        self._pin_ids = itertools.count(secrets.randbits(48) + 1)
        cfg = self.config
        path = os.path.join(cfg.shm_dir, f"kvmesh-{node_id[:16].lower()}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.makedirs(cfg.shm_dir, exist_ok=True)
            remove_stale_slabs(cfg.shm_dir)
            st = os.statvfs(cfg.shm_dir)
        except OSError as e:
            raise setting_error("shm_dir", cfg.shm_dir, e) from e
        num_slots = fit_slots(cfg.num_slots, cfg.slot_bytes, st.f_bavail * st.f_frsize)
        if num_slots < cfg.num_slots:  # one config for every node; this one's /dev/shm is smaller
            log.warning(
                "KVNode %s: cpu_bytes %d does not fit the %d bytes free in %s: a CPU tier of %d slots",
                node_id[:8],
                cfg.cpu_bytes,
                st.f_bavail * st.f_frsize,
                cfg.shm_dir,
                num_slots,
            )
        try:
            self.tier = CpuTier(path, num_slots, cfg.slot_bytes)  # the slab every reader maps
        except OSError as e:
            raise setting_error("shm_dir", cfg.shm_dir, e) from e
        disk = None
        try:  # (a first start that fails here leaves no slab file behind: its pid lives on, nothing would clean it)
            disk, recovered = self._disk_tier() if cfg.disk_bytes else (None, [])
            gpu = self._gpu_tier()
        except BaseException:
            if disk is not None:
                disk.close()
            self.tier.close()
            raise
        self.cascade = Cascade(self.tier, gpu, disk, cfg.write_policy)
        self._io: queue.SimpleQueue = queue.SimpleQueue()  # disk writes and the start-up verification (I/O threads)
        self._io_outstanding = 0  # items put on `_io` and not done yet, queued or in an I/O thread's hands (lock)
        if disk is not None and recovered:  # readable at once (every disk read is verified); registered once
            # verified below
            disk.adopt([(r.slot, r.key, r.group, r.nbytes, r.checksum) for r in recovered])
            for r in recovered:
                self._io_put(("verify", r))
        self._promote: list[bytes] = []  # keys hit on the CPU tier, promoted by the maintenance thread
        self._served: Counter[str] = Counter()  # bytes served, by requesting node id
        self._served_at: dict[str, float] = {}  # when each was last served (monotonic)
        self._group_hits: Counter[bytes] = Counter()  # chunk hits by prompt group (first-chunk hash)
        self._pending_events: list = []
        self.data_server = None
        try:
            if cfg.peer_transport == "tcp":
                self.data_server = DataServer(self._pin_for_send, self._unpin_sent, host, send_timeout_s=cfg.pin_ttl_s)
            self.info = NodeInfo(
                node_id,
                actor_name,
                path,
                num_slots * cfg.slot_bytes,
                cfg.slot_bytes,
                self.data_server.address if self.data_server else "",
            )
            self.directory = Directory(cfg.redis_url, cfg.key_prefix)
            self.directory.table_horizon_ms = horizon_for(cfg.node_refresh_s)
            # (off the start: a directory that does not answer yet must not hold the node's start up)
            threading.Thread(target=_advise, args=(self.directory,), name="kvmesh-advice", daemon=True).start()
            # what pull-throughs keep (hot-prefix replicas) and what they only brought for their readers
            self.replicas = Replicas(
                self.directory.redis,
                cfg.key_prefix,
                node_id,
                cfg.replicate_min_readers,
                cfg.replicate_window_s,
                cfg.replicate_max_bytes,
            )
            self.janitor = Janitor(
                self.directory, node_id, cfg.lease_s, lambda: self.registrar.lease, self._count, self._event
            )
            self.registrar = Registrar(
                self.directory,
                self.info,
                self._lease_ms,
                cfg.heartbeat_s,
                self.lock,
                self._registrable,
                self.cascade.holds_group,
                self._count,
                self._event,
                self.janitor.purge_later,
            )
        except Exception:  # (a failed start leaves nothing behind: KVNodeActor may try again in this process)
            if self.data_server:
                self.data_server.shutdown()
            if getattr(self, "directory", None) is not None:
                self.directory.close()
            self.tier.close()
            if self.cascade.gpu is not None:
                self.cascade.gpu.close()
            if disk is not None:
                disk.close()  # (and its directory's lock: a next try takes the same directory and its chunks)
            raise
        self.reservations = Reservations(
            self.cascade, self.lock, self.stats_counts, self._post_changes, cfg.pin_ttl_s, self.info.slab_path
        )
        self.janitor.purge_later([self.registrar.lease.previous])
        self._gpu_exports = self._export_gpu()
        # peers, for pull-throughs; each read also relayed to the clients on this node (nodeview.TableFile)
        self.view = NodeView(self.directory.node_table, 5.0, cfg.node_refresh_s, TableFile.beside(path))
        self.peers = lambda node: NodeHandle.find(node, self.node_id)  # a peer's KVNode (without Ray: none)
        self._peers = DataClient()  # this node's connections to peers' DataServers
        self._pull_pool = ThreadPoolExecutor(4, thread_name_prefix="kvmesh-node-pull")
        self.pull_through_part = PullThrough(
            self,
            Fetcher(Env(node_id, None, None, 0, lambda n: self.peers(n), self.view, self._peers, self._pull_pool)),
            self._count,
        )
        self._records = Records(self.directory.redis, cfg.key_prefix)
        # the last copies of chunks other nodes read: handed to a peer instead of dropped (cluster eviction)
        self.last_copies = LastCopies(
            node_id,
            cfg.last_copy_window_s,
            cfg.handoff_max_bytes,
            cfg.recompute_bytes_per_s,
            self._count,
            self.directory,
            self._records.k_stats,
            lambda n: self.peers(n),
        )
        self.cascade.on_leave = self._on_leave
        self.cascade.on_written = self._on_written
        # chunks that left the slab for a disk write still in flight: key -> whether a replica; judged by
        # `last_copies` once the write ends (saved on disk, or leaving the node if the disk refused it)
        self._leaving_to_disk: dict[bytes, bool] = {}
        self._ray_metrics = RayExporter()
        self._last_published: dict = {}
        self._stop = threading.Event()
        self._closed = False
        self._devsum_busy = 0  # chunks the device-checksum thread is working on now (under the lock)
        self._io_threads: list[threading.Thread] = []
        # (every field the threads read is set above: the maintenance thread's first stats() may run at once)
        self._thread = threading.Thread(target=self._maintain, name="kvmesh-node-maintenance", daemon=True)
        self._thread.start()
        self._devsum_thread = threading.Thread(target=self._devsum_loop, name="kvmesh-node-devsum", daemon=True)
        self._devsum_thread.start()
        self._table_thread = threading.Thread(target=self._table_loop, name="kvmesh-node-table", daemon=True)
        self._table_thread.start()
        if disk is not None:
            for i in range(cfg.io_threads):
                t = threading.Thread(target=self._io_loop, name=f"kvmesh-node-io-{i}", daemon=True)
                t.start()
                self._io_threads.append(t)
        log.info(
            "KVNode %s incarnation %d: %d slots of %d bytes at %s",
            node_id[:8],
            self.lease.incarnation,
            num_slots,
            cfg.slot_bytes,
            path,
        )

    def _disk_tier(self):
        """The disk tier and the chunks it recovered. Where its directory cannot be used (a disk that went
        read-only or full, a directory without permission) a first start fails, said in one line; a restart
        (`restarted`) leaves the tier out and says so (`disk_unavailable`): Ray does not retry a restarted
        actor whose creation fails, and the node would lose its other tiers with it, for good."""
        from kvmesh.tiers.disk import DiskTier, claim_directory

        cfg, disk, lock_fd = self.config, None, None
        try:
            disk_path, lock_fd = claim_directory(cfg.disk_dir, self.node_id)  # not named by the node id: see there
            disk = DiskTier(
                disk_path,
                cfg.disk_bytes // cfg.slot_bytes,
                cfg.slot_bytes,
                direct_io=cfg.disk_direct_io,
                lock_fd=lock_fd,
            )
            return disk, disk.recover()
        except OSError as e:
            if disk is not None:
                disk.close()
            elif lock_fd is not None:
                os.close(lock_fd)
            if not self._restarted:
                raise setting_error("disk_dir", cfg.disk_dir, e) from e
            self.stats_counts["disk_unavailable"] += 1
            log.error("KVNode %s: the disk tier at %s cannot be used (%s): none", self.node_id[:8], cfg.disk_dir, e)
            return None, []

    def _gpu_tier(self):
        cfg = self.config
        if not cfg.gpu_bytes:
            return None
        import torch  # only nodes asked for a GPU tier import it

        if cfg.gpu_device.startswith("cuda") and not torch.cuda.is_available():
            # one configuration serves every node of a cluster; a node without a GPU goes without the tier
            log.warning("KVNode %s: gpu_bytes is set but this node has no CUDA device: no GPU tier", self.node_id[:8])
            return None
        from kvmesh.tiers.gpu import GpuTier
        from kvmesh.tiers.gpu_ipc import GpuIpcError

        try:
            return GpuTier(cfg.gpu_bytes // cfg.slot_bytes, cfg.slot_bytes, cfg.gpu_device)
        except (torch.cuda.OutOfMemoryError, GpuIpcError) as e:  # (a restart before the old process's memory is
            out_of_memory = not isinstance(e, GpuIpcError) or e.reason == "out_of_memory"  # freed, or another's)
            if not (self._restarted and out_of_memory):
                raise
            self.stats_counts["gpu_unavailable"] += 1
            log.error("KVNode %s: no room for the GPU tier on %s (%s): none", self.node_id[:8], cfg.gpu_device, e)
            return None

    def _export_gpu(self) -> tuple[bytes, ...]:
        """The GPU tier's pools for same-node readers (CUDA IPC); none where the tier is absent, on a CPU stand-in
        device, or IPC is not possible here (readers then get GPU-tier chunks through the slab)."""
        gpu = self.cascade.gpu
        if gpu is None:
            return ()
        from kvmesh.tiers.gpu_ipc import GpuIpcError

        try:  # the node id, not the incarnation, names the pools: a re-join keeps them (they are the same memory)
            return tuple(e.pack() for e in gpu.exports(self.node_id, self.info.slab_path))
        except GpuIpcError as e:
            log.info(
                "KVNode %s: GPU tier not exported (%s): readers get its chunks through the slab",
                self.node_id[:8],
                e.reason,
            )
            return ()

    @property
    def _lease_ms(self) -> int:
        return int(self.config.lease_s * 1000)

    @property
    def lease(self):
        return self.registrar.lease

    @property
    def fenced(self) -> bool:
        return self.registrar.fenced

    # -- same-node readers ---------------------------------------------------------------------------------------
    def hello(self) -> NodeHello:
        return NodeHello(self.info.with_incarnation(self.lease.incarnation), self.config, self._gpu_exports)

    def pin(self, keys: list[bytes], requester: str = "", gpu: bool = False, hold_s: float = 0.0) -> Pinned:
        """`gpu`: the reader maps this node's GPU pools (CUDA IPC): the leading keys held in the GPU tier are pinned
        there and read device to device, the rest in the slab (brought into it from the other tiers). `hold_s`:
        how long the reader may still read the slots (what is left of its fetch's deadline: a device sink reads
        adopted slots until its fetch ends): the pin lapses `pin_ttl_s` after that, never while it may be read."""
        on_gpu = self._pin_gpu(keys) if gpu else []
        slots = self._pin_host(keys[len(on_gpu) :]) if len(on_gpu) < len(keys) else []
        with self.lock:
            self._account(requester or self.node_id, slots)
            pin_id = next(self._pin_ids)
            if slots or on_gpu:
                expires = time.monotonic() + min(max(0.0, hold_s), MAX_HOLD_S) + self.config.pin_ttl_s
                self._pins[pin_id] = (slots, [s for s, _ in on_gpu], expires)
            recs = [self.tier.record(s) for s in slots]
            rows = [PinnedChunk(s, r.nbytes, r.checksum, r.devsum) for s, r in zip(slots, recs)]
            self.stats_counts["pins"] += 1
            self.stats_counts["pinned_chunks"] += len(slots) + len(on_gpu)
            self.stats_counts["pinned_gpu_chunks"] += len(on_gpu)
        gpu_rows = []
        if on_gpu:
            gpu_tier = self.cascade.gpu
            assert gpu_tier is not None  # (they were pinned in it)
            gpu_rows = [PinnedChunk(s, gpu_tier.record(s).nbytes, c) for s, c in on_gpu]
        return Pinned(pin_id, rows, self.info.slab_path, gpu_rows)

    def _pin_gpu(self, keys: list[bytes]) -> list[tuple[int, int]]:
        """Pin the leading run of `keys` held in a CUDA GPU tier: (slot, device checksum) each."""
        gpu = self.cascade.gpu
        if gpu is None or not self._gpu_exports:
            return []
        with self.lock:
            slots = gpu.pin(keys)  # (and touches them in the GPU tier's LRU)
        return [(s, gpu.device_sum(s)) for s in slots]  # (the sum of a chunk placed moments ago may still be queued)

    def _pin_host(self, keys: list[bytes]) -> list[int]:
        """Pin the leading run of `keys` in the CPU slab: GPU-only chunks are copied into it, disk-only ones
        read into it (without the lock held). Call without the lock. A chunk this node holds but cannot bring in
        this moment (another reader's read of it in flight; every slot pinned by other readers) is waited for,
        up to PIN_WAIT_S: readers of the same prompt, or more windowed fetches than the slab holds at once, would
        otherwise cut each other short."""
        slots = self._pin_host_once(keys)
        until = time.monotonic() + PIN_WAIT_S
        while len(slots) < len(keys) and time.monotonic() < until and not self._stop.is_set():
            with self.lock:
                if not self.cascade.holds(keys[len(slots)]):
                    break  # (not here at all: the run ends)
            time.sleep(0.002)
            slots += self._pin_host_once(keys[len(slots) :])
        return slots

    def _pin_host_once(self, keys: list[bytes]) -> list[int]:
        with self.lock:
            n, reads = self.cascade.prepare_host(keys)
        ok = self.cascade.run_reads(reads) if reads else []
        with self.lock:
            corrupt = self.cascade.discard_corrupt()
            self.stats_counts["corrupt_dropped"] += corrupt
            slots = self.cascade.finish_host(keys, n, reads, ok)
            if self.cascade.gpu is not None and self.config.promote_on_hit:
                self._promote.extend(keys[: len(slots)])
            if reads or corrupt:
                self._post_changes()
        if corrupt:  # (the reader's fetch ends there as "not_held": this node no longer holds it)
            log.warning("KVNode %s dropped %d corrupt chunk(s) of its own tiers", self.node_id[:8], corrupt)
            self._event("corrupt_chunk", "checksum", f"{corrupt} chunk(s) dropped")
        return slots

    def _account(self, requester: str, slots: list[int]) -> None:
        """Caller holds the lock: traffic by requesting node, and hits by prompt group (most reused prefixes)."""
        if not slots:
            return
        nbytes = 0
        for s in slots:
            rec = self.tier.record(s)
            nbytes += rec.nbytes
            self._group_hits[rec.group] += 1
            if requester != self.node_id and rec.key is not None:
                self.last_copies.read_by_peer(rec.key)
        self._served[requester] += nbytes
        self._served_at[requester] = time.monotonic()
        if len(self._group_hits) > 4096:  # keep the top ones only
            self._group_hits = Counter(dict(self._group_hits.most_common(1024)))

    def unpin(self, pin_id: int) -> None:
        with self.lock:
            entry = self._pins.pop(pin_id, None)
            if entry is not None:
                self._release_pin(entry)

    def _release_pin(self, entry) -> None:
        slots, gpu_slots, _deadline = entry
        keys = [self.tier.record(s).key for s in slots]
        self.tier.unpin(slots)
        if gpu_slots:
            assert self.cascade.gpu is not None  # (they were pinned in it)
            keys += [self.cascade.gpu.record(s).key for s in gpu_slots]
            self.cascade.gpu.unpin(gpu_slots)
        if self.replicas.transient_chunks:
            self._drop_transient(keys)

    def report_corrupt(self, keys: list[bytes]) -> int:
        """A reader found other bytes than a chunk's checksum says: each copy of `keys` held in memory (GPU tier,
        CPU slab) is checked here, and a chunk with a bad copy is dropped from every tier and the directory.
        (Disk copies are checked on every read.) Returns how many were dropped."""
        bad: set[bytes | None] = set()
        for tier in (self.cascade.gpu, self.tier):
            if tier is None:
                continue
            with self.lock:
                slots = [s for k in keys for s in tier.pin([k])]
            try:  # (a slot still being written is not judged)
                bad.update(tier.record(s).key for s in slots if tier.record(s).ready and not tier.verify(s))
            finally:
                with self.lock:
                    tier.unpin(slots)
        bad_keys = [k for k in keys if k in bad]  # (a pinned slot holds a chunk)
        self._drop(bad_keys)
        return len(bad_keys)

    # -- peers ---------------------------------------------------------------------------------------------------
    def pull(self, keys: list[bytes], requester: str = "") -> Pulled:
        slots = self._pin_host(keys)
        with self.lock:
            self._account(requester or "?", slots)
            sizes = [self.tier.record(s).nbytes for s in slots]
        out = np.empty(sum(sizes), dtype=np.uint8)
        rows, bad, off = [], [], 0
        try:
            for s, n in zip(slots, sizes):
                dst = out[off : off + n]
                np.copyto(dst, np.frombuffer(self.tier.chunk_view(s), dtype=np.uint8))
                c = checksum(dst)
                if c != self.tier.record(s).checksum:
                    bad.append(s)
                    break
                rows.append((n, c))
                off += n
        finally:
            with self.lock:
                bad_keys = [k for s in bad if (k := self.tier.record(s).key) is not None]  # (pinned: held)
                self.tier.unpin(slots)
                self.stats_counts["pulls"] += 1
                self.stats_counts["pulled_chunks"] += len(rows)
                self.stats_counts["pulled_bytes"] += off
        self._drop(bad_keys)
        return Pulled(rows, out[:off])

    def _pin_for_send(
        self, keys: list[bytes], requester: str = ""
    ) -> tuple[list[int], list[tuple[int, int]], list[memoryview]]:
        """For the DataServer: pin the leading run of `keys`; the client verifies the checksums it receives."""
        slots = self._pin_host(keys)
        with self.lock:
            self._account(requester or "?", slots)
            rows = [(self.tier.record(s).nbytes, self.tier.record(s).checksum) for s in slots]
            self.stats_counts["pulls"] += 1
            self.stats_counts["pulled_chunks"] += len(slots)
            self.stats_counts["pulled_bytes"] += sum(n for n, _ in rows)
        return slots, rows, [self.tier.chunk_view(s) for s in slots]

    def _unpin_sent(self, slots: list[int]) -> None:
        with self.lock:
            self.tier.unpin(slots)

    def pull_through(self, req: PullRequest) -> Pinned:
        with self.lock:  # (from its transfer, or another reader's, to its pin: what one reader's unpin must not
            self._pulling.update(req.keys)  # drop under another: readers waiting on a shared transfer got none)
        try:
            self.pull_through_part.run(req)
            # held for the reader while its fetch may still read the slots (a device sink adopts them)
            pinned = self.pin(req.keys, self.node_id, hold_s=req.deadline_ms / 1000)
        finally:
            with self.lock:  # chunks pulled only for readers, that none of them pinned (evicted meanwhile): gone now
                self._pulling.subtract(req.keys)
                for key in req.keys:
                    if self._pulling[key] <= 0:
                        del self._pulling[key]
                self._drop_transient(req.keys)
        return pinned

    def _on_leave(self, slot: int, rec, below: int | None) -> None:
        """Caller (the cascade, evicting from the slab) holds the lock; the chunk's bytes are still in `slot`."""
        if below is not None and below != TIER_DISK:
            return  # (a copy stays in the GPU tier above)
        if below == TIER_DISK and self.cascade.writing(rec.key):  # not on disk yet: the disk may refuse it
            self._leaving_to_disk[rec.key] = self.replicas.is_replica(rec.key)
            return
        self.last_copies.leaving(
            rec.key,
            rec.group,
            rec.nbytes,
            rec.checksum,
            lambda: self.tier.chunk_view(slot),
            below is not None,
            self.replicas.is_replica(rec.key),
        )

    def _on_written(self, job, ok: bool) -> None:
        """Caller (the cascade, ending a disk write) holds the lock; the chunk's bytes are still in `job.data`."""
        key = job.ticket.key
        replica = self._leaving_to_disk.pop(key, None)
        if replica is None:
            return  # (it never left the slab for this write)
        if not ok and self.cascade.best_tier(key) is not None:
            return  # (back in the slab meanwhile: it leaves again later)
        data = job.data
        self.last_copies.leaving(key, job.group, job.nbytes, job.checksum, lambda: memoryview(data), ok, replica)

    def _registrable(self) -> list[tuple[bytes, bytes, int]]:
        """Caller holds the lock: what the directory should list (every chunk held, but those a pull-through
        brought only for its readers)."""
        return [c for c in self.cascade.ready_chunks() if not self.replicas.is_transient(c[1])]

    def _drop_transient(self, keys) -> None:
        """Caller holds the lock: forget the transient chunks among `keys` that no reader pins any more (a pinned
        one goes at its last unpin). Never registered, so the directory hears nothing."""
        self.stats_counts["transient_dropped"] += self.replicas.drop_unpinned(
            [k for k in keys if k not in self._pulling], self.cascade
        )

    # -- stores --------------------------------------------------------------------------------------------------
    def store(self, items: list[StoreItem], buf: np.ndarray) -> int:
        if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size != sum(i.nbytes for i in items):
            raise WireError("StoreRequest: buffer size does not match the header")
        offsets = list(itertools.accumulate((i.nbytes for i in items), initial=0))
        counts: Counter[str] = Counter()
        waits_until = time.monotonic() + WRITEBACK_WAIT_S
        # Last chunk first: the policy then holds a prompt's head as most recent, so eviction trims tails.
        for idx in range(len(items) - 1, -1, -1):
            item = items[idx]
            if item.nbytes > self.tier.slot_bytes:
                counts["store_refused_too_big"] += 1
                continue
            src = buf[offsets[idx] : offsets[idx + 1]]
            if not self._writeback_room(waits_until):
                counts["store_writeback_waits_expired"] += 1
            with self.lock:
                ticket = self.cascade.prepare(item.key, item.group, item.nbytes)
                top = self.cascade.top
                for job in self.cascade.take_writes():  # (to the disk now, not at the end: they free buffers)
                    self._io_put(("write", job))
            if ticket is None:
                counts["store_skipped" if self.cascade.holds(item.key) else "store_refused_full"] += 1
                continue
            if top is self.tier:  # copy, then check what landed
                dst = np.frombuffer(self.tier.buffer(ticket.slot), dtype=np.uint8)[: item.nbytes]
                np.copyto(dst, src)
                ok = checksum(dst) == item.checksum
            else:  # check the bytes before they go up to the device
                ok = checksum(src) == item.checksum
                if ok:
                    import torch

                    top.buffer(ticket.slot)[: item.nbytes].copy_(torch.from_numpy(src))
            with self.lock:
                if ok:
                    self.cascade.complete(ticket, item.checksum)
                else:
                    self.cascade.abort(ticket)
            counts["stored_chunks" if ok else "store_corrupt_in_transit"] += 1
        with self.lock:
            self.stats_counts.update(counts)
            seq = self._post_changes()
        self.registrar.wait(seq, REGISTER_WAIT_S)
        return counts["stored_chunks"]

    def _writeback_room(self, until: float) -> bool:
        """Before a store evicts with every write-back buffer in use (a burst larger than the slab): wait, not
        under the lock, until the disk writers give one back, so that the evicted chunk goes to the disk instead of
        being dropped (a prompt's middle dropped makes its tail on disk useless to a lookup). False if `until`
        came first (a disk much slower than the stores: then they drop, as before, counted)."""
        while True:
            with self.lock:
                if not self.cascade.writeback_full():
                    return True
            if time.monotonic() >= until or self._stop.is_set():
                return False
            time.sleep(0.001)

    def reserve_gpu(self, items: list[StoreItem], requester: str = "") -> GpuReserved:
        """Slots in the GPU tier for chunks a same-node writer copies in device to device, evicting down the
        cascade as a store does (`reservations.Reservations`). None for a chunk held already, bigger than a slot,
        or without room (the writer stores those through the host path)."""
        return self.reservations.reserve(items)

    def commit_gpu(self, reservation_id: int, sums: list[int | None]) -> int:
        """The writer's device sums of what it wrote into the reserved slots (None: not written). Returns once the
        chunks that match are registered, as `store` does."""
        stored, seq = self.reservations.commit(reservation_id, sums)
        if seq:
            self.registrar.wait(seq, REGISTER_WAIT_S)
        return stored

    def _drop(self, keys: list[bytes]) -> None:
        """Forget corrupt chunks: out of every tier and out of the directory."""
        if not keys:
            return
        with self.lock:
            for key in keys:
                self.cascade.discard(key)
                self._leaving_to_disk.pop(key, None)  # (dropped: neither saved on disk nor handed off)
            self.stats_counts["corrupt_dropped"] += len(keys)
            self._post_changes()
        log.warning("KVNode %s dropped %d corrupt chunk(s)", self.node_id[:8], len(keys))
        self._event("corrupt_chunk", "checksum", f"{len(keys)} chunk(s) dropped")

    def post_changes(self) -> int:
        with self.lock:
            return self._post_changes()

    def _post_changes(self) -> int:
        """Caller holds the lock: hand what the cascade changed to the registrar (in order), and its disk writes to
        the I/O threads. Returns the registrar's sequence number for `wait`."""
        for job in self.cascade.take_writes():
            self._io_put(("write", job))
        return self.registrar.post(self.replicas.filter_changes(self.cascade.drain()))

    # -- maintenance ---------------------------------------------------------------------------------------------
    def _maintain(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            self._expire_pins()
            self.reservations.expire()
            self._run_promotions()
            self._publish()
            if self.fenced:
                continue
            try:
                self.janitor.round()
            except redis.RedisError as e:
                log.debug("janitor round failed: %s", e)

    def _table_loop(self) -> None:
        """The node table, read for this node's clients every `node_refresh_s` (they read the relay, not Redis)."""
        self.view.refresh()
        while not self._stop.wait(self.config.node_refresh_s):
            self.view.refresh()

    def _count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.stats_counts[name] += n

    def _publish(self) -> None:
        """Telemetry at the edge: the stats snapshot to Redis (the live page) and to Ray metrics."""
        self._forget_readers()
        stats = self.stats()
        export_node_stats(self._ray_metrics, self.node_id, stats, self._last_published)
        self._last_published = stats
        try:
            self._records.node_stats(self.node_id, stats)
            events, self._pending_events = self._pending_events, []
            for kind, reason, detail in events:
                self._records.event(self.node_id, kind, reason, detail)
        except redis.RedisError:
            pass

    def _event(self, kind: str, reason: str, detail: str = "") -> None:
        if len(self._pending_events) < MAX_PENDING_EVENTS:  # (Redis away: the live page keeps no more than that)
            self._pending_events.append((kind, reason, detail))

    def _forget_readers(self) -> None:
        """Bytes served to readers that are no longer in the node table, and were not served for 10 leases, go (a
        node id gone for good, e.g. a replaced machine, would otherwise stay one more entry of every stats snapshot
        and one more metric series, for this node's life). A table this node could not read (empty) forgets
        nobody."""
        live = self.view.table().by_node()
        if not live:
            return
        idle = time.monotonic() - 10 * self.config.lease_s
        with self.lock:
            for reader in [r for r in self._served if r not in live and self._served_at.get(r, 0.0) < idle]:
                del self._served[reader]
                self._served_at.pop(reader, None)

    def _io_put(self, work) -> None:
        """Caller holds the lock (or no I/O thread runs yet)."""
        self._io_outstanding += 1
        self._io.put(work)

    def _io_loop(self) -> None:
        disk = self.cascade.disk
        while not self._stop.is_set():
            try:
                kind, item = self._io.get(timeout=0.5)
            except queue.Empty:
                continue
            assert disk is not None  # (writes and start-up verifications exist only with a disk tier)
            try:
                self._io_one(disk, kind, item)
            except Exception:  # (an I/O thread that died would leave every later write queued for good)
                log.exception("KVNode %s: disk %s failed", self.node_id[:8], kind)
            finally:
                with self.lock:
                    self._io_outstanding -= 1

    def _io_one(self, disk, kind: str, item) -> None:
        if kind == "write":
            ok, no_space = True, False
            try:
                disk.write_chunk(item.ticket.slot, item.data, item.nbytes, item.ticket.key, item.group, item.checksum)
            except OSError as e:
                ok, no_space = False, e.errno == errno.ENOSPC
                code = errno.errorcode.get(e.errno or 0, "EIO")  # (exported by its errno name: disk_write_E*)
                self._count(f"disk_write_{code}")
                log.warning(
                    "KVNode %s: disk write failed (%s); the chunk stays where it was or is dropped",
                    self.node_id[:8],
                    e,
                )
                self._event("disk_write_failed", code, str(e))
            except Exception:  # noqa: BLE001 - not an I/O error (a bug): the write is ended as failed all the same,
                ok = False  # else its disk slot, buffer and pending entry (and a last-copy decision) stay for good
                log.exception("KVNode %s: disk write failed", self.node_id[:8])
            with self.lock:
                self.cascade.finish_write(item, ok)
                if no_space:  # a disk tier bigger than its file system's free space: the next writes evict from
                    disk.park_unbacked(item.ticket.slot)  # the slots that have their blocks, instead of failing
                    # for good (this slot too: blocks of an earlier, smaller chunk do not make room for this one)
                self._post_changes()
        elif kind == "verify":  # a chunk found on disk at start-up: register it once its bytes check out
            failed = None
            try:
                good = checksum(disk.read_chunk(item.slot, item.nbytes)) == item.checksum
            except OSError as e:  # unreadable, not known corrupt: dropped, counted as a disk read error
                good, failed = False, errno.errorcode.get(e.errno or 0, "EIO")
            with self.lock:
                if disk.record(item.slot).key != item.key:
                    return  # already gone (evicted or read and found corrupt)
                if good:
                    self.cascade.record_change(item.group, item.key)
                    self.stats_counts["disk_recovered"] += 1
                else:
                    if failed is not None:
                        self.cascade.count_read_error(failed)
                    else:
                        try:
                            disk.invalidate(item.slot)
                        except OSError as e:  # (a disk that refuses writes now: the record stays, and the
                            # next start verifies it again; this one drops the chunk all the same)
                            log.warning("KVNode %s: a corrupt disk record stays (%s)", self.node_id[:8], e)
                        self.stats_counts["disk_recovery_corrupt"] += 1
                    self.cascade.discard(item.key)
                self._post_changes()

    def _devsum_loop(self) -> None:
        """Record the device checksum of every chunk that becomes readable in the CPU slab (stores, copies from the
        GPU tier, disk reads, pull-throughs), a few at a time. Off the store path on purpose: a store returns as
        soon as its chunks are verified and registered, and a reader that pins a chunk before its sum is recorded
        checks it with xxh3, as it did before sums existed. A chunk whose bytes no longer match its xxh3 gets no
        sum (its next reader finds it corrupt and reports it, as before)."""
        from kvmesh.tiers.devsum import Coefficients

        coefficients = Coefficients()  # the constants, built once for this thread
        while not self._stop.is_set():
            with self.lock:
                work = self.tier.take_devsum_work(4)
                self._devsum_busy = len(work)
            if not work:
                self._stop.wait(0.02)
                continue
            sums: list[int | None] = []
            try:
                for w in work:
                    sums.append(self.tier.compute_devsum(w, coefficients))
            finally:
                sums += [None] * (len(work) - len(sums))
                with self.lock:
                    for w, d in zip(work, sums):
                        self.tier.finish_devsum(w, d)
                    self._devsum_busy = 0
                    recorded = sum(d is not None for d in sums)
                    self.stats_counts["slab_devsums"] += recorded
                    self.stats_counts["slab_devsums_refused"] += len(sums) - recorded

    def _run_promotions(self) -> None:
        with self.lock:
            keys, self._promote = self._promote, []
            if keys:
                self.cascade.promote(list(dict.fromkeys(keys)))
                self._post_changes()

    def _expire_pins(self) -> None:
        now = time.monotonic()
        with self.lock:
            for pin_id in [p for p, (_, _, deadline) in self._pins.items() if deadline < now]:
                self._release_pin(self._pins.pop(pin_id))
                self.stats_counts["pins_expired"] += 1

    def locate(self, keys: list[bytes]) -> list[list]:
        """Per key, [tier name, file, byte offset] of each copy held in the CPU slab or on disk (diagnostics, and
        the tests that damage a chunk where it lies)."""
        out = []
        with self.lock:
            for key in keys:
                where = []
                slot = self.tier.slot_of(key)
                if slot is not None:
                    where.append(["cpu", self.tier.path, slot * self.tier.slot_bytes])
                disk = self.cascade.disk
                if disk is not None and (dslot := disk.slot_of(key)) is not None:
                    where.append(["disk", disk.path, disk.data_offset(dslot)])
                out.append(where)
        return out

    def stats(self) -> dict:
        with self.lock:
            d: dict[str, Any] = dict(self.stats_counts)
            c = self.cascade
            d.update(
                c.counts,
                evictions=sum(c.evictions.values()),
                evictions_by_tier=dict(c.evictions),
                tier_flows=[[src, dst, n, c.flow_bytes[(src, dst)]] for (src, dst), n in c.flows.items()],
            )
            d.update(
                node_id=self.node_id,
                pid=os.getpid(),
                incarnation=self.lease.incarnation,
                chunks=len(self.tier),
                used_bytes=self.tier.used_bytes,
                # (less the slots /dev/shm has no memory for now: a peer handing a chunk off looks for room)
                capacity_bytes=(self.tier.num_slots - self.tier.unbacked_slots) * self.tier.slot_bytes,
                free_bytes=self.tier.free_bytes,  # (in free slots: what a handoff looks for; see SlotPool.free_bytes)
                pinned=sum(len(s) + len(g) for s, g, _ in self._pins.values()),
                fenced=self.fenced,
                slab_devsums_queued=self.tier.devsum_queued() + self._devsum_busy,
                slab_unbacked_refusals=self.tier.unbacked_refusals,
                slab_unbacked_slots=self.tier.unbacked_slots,
            )
            disk = self.cascade.disk
            if disk is not None:
                d.update(
                    disk_chunks=len(disk),
                    disk_used_bytes=disk.used_bytes,
                    disk_capacity_bytes=(disk.num_slots - disk.unbacked_slots) * disk.slot_bytes,
                    disk_free_bytes=disk.free_bytes,
                    disk_unbacked_slots=disk.unbacked_slots,
                    disk_direct_io=disk.direct_io,
                    disk_pending_io=self._io_outstanding,  # (queued, and those an I/O thread is doing)
                )
            gpu = self.cascade.gpu
            if gpu is not None:
                d.update(
                    gpu_chunks=len(gpu),
                    gpu_used_bytes=gpu.used_bytes,
                    gpu_capacity_bytes=gpu.num_slots * gpu.slot_bytes,
                )
            d["tiers"] = [
                {
                    "tier": TIER_NAMES[t.tier_id],
                    "chunks": len(t),
                    "used_bytes": t.used_bytes,
                    "capacity_bytes": (t.num_slots - t.unbacked_slots) * t.slot_bytes,
                    # a chunk takes a whole slot whatever its size: how full a tier is (what evicts) is chunks of
                    # slots, not bytes of capacity (a tier full of a small model's chunks holds few bytes)
                    "slots": t.num_slots - t.unbacked_slots,
                }
                for t in self.cascade.tiers()
            ]
            d.update(self.last_copies.counts)
            d["saved_last_copies"] = d["last_copy_saved_disk"] + d.get("handoff_ok", 0)
            d.update(
                replicated_chunks=self.replicas.replicated_chunks,
                replicated_bytes=self.replicas.replicated_bytes,
                transient_chunks=self.replicas.transient_chunks,
            )
            d["served_bytes"] = dict(self._served)
            d["top_prefixes"] = [[g.hex(), n] for g, n in self._group_hits.most_common(10)]
            d["time"] = time.time()
        return d

    def check_integrity(self, verify_checksums: bool = True, directory: bool = False) -> None:
        """The tiers' invariants (and every chunk's checksum); with `directory`, also that the directory lists
        exactly the chunks held, each at its best tier, under this incarnation: nothing held is unfindable and
        nothing findable is missing. Call it while no stores or reads are in flight."""
        if directory:
            self.post_changes()
            assert self.registrar.flush(10.0), "directory updates are still pending"
        with self.lock:
            self.cascade.check_integrity(verify_checksums=verify_checksums)
            unlisted = self.registrar.unlisted()  # (an entry already full of other holders: tried again later)
            registrable = self._registrable()
            held = {(g, k[:FIELD_BYTES]): t for g, k, t in registrable if (g, k) not in unlisted}
            groups = {g for g, _k, _t in registrable}
        if directory and not self.fenced:
            listed = self.directory.entries_of(self.lease.incarnation)
            unfindable = held.keys() - listed.keys()
            phantom = listed.keys() - held.keys()
            assert not unfindable, f"{len(unfindable)} chunk(s) held but not in the directory"
            assert not phantom, f"{len(phantom)} directory entries for chunks not held"
            moved = [c for c, t in held.items() if listed[c] != t]
            assert not moved, f"{len(moved)} directory entries name the wrong tier"
            indexed = self.directory.redis.smembers(self.directory.own_key(self.lease.incarnation))
            assert indexed == groups, (
                f"the purge index lists {len(indexed - groups)} group(s) not held and misses {len(groups - indexed)}"
            )

    @property
    def closed(self) -> bool:
        """Shut down (or killed): its handles refuse calls, as a dead actor's would."""
        return self._closed

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=5)
        self._table_thread.join(timeout=5)
        if self.view.publish is not None:
            self.view.publish.remove()
        self._devsum_thread.join(timeout=30)  # it reads the slab: done before the slab is unmapped
        if self.data_server:
            self.data_server.shutdown()
        self._peers.close()
        self._pull_pool.shutdown(wait=False)
        self.last_copies.shutdown()
        with self.lock:
            held = self._registrable()
        self.registrar.shutdown(held)
        for t in self._io_threads:
            t.join(timeout=5)
        self.directory.close()
        self.tier.close()
        if self.cascade.gpu is not None:
            self.cascade.gpu.close()
        if self.cascade.disk is not None:
            self.cascade.disk.close()
