"""`KVNode`: owns one Ray node's tiers and its directory registrations. A plain class; `mesh.py` wraps it as a
Ray actor (threaded, so a long pull never blocks a pin). Every public method takes and returns wire messages
(`wire.py`) or numpy buffers, validates them, and turns bad input into `WireError` rather than crashing.

    hello() -> bytes                      NodeInfo, incarnation and config, for clients on this node
    pin(PinRequest) -> PinReply           mutates: pins the leading run of held chunks for a same-node reader
    unpin(pin_id)                         mutates
    pull(PullRequest) -> (header, buf)    reads: the leading run of held chunks, verified, for a peer (the Ray
                                          path; the node's DataServer serves the same over TCP, see transport.py)
    store(StoreRequest, buf) -> int       mutates: places chunks in the CPU tier, registers them
    report_corrupt(PinRequest) -> int     mutates: re-verifies the named chunks, drops the bad ones
    pull_through(PullThrough) -> PinReply mutates: pins the leading run here for a same-node reader, first pulling
                                          from the holder the chunks not here yet; concurrent readers of a chunk
                                          share its one transfer (`inflight.py`), and the chunks pulled stay
                                          here, registered (a replica), for the readers that come later
    stats() -> dict                       reads
    shutdown()                            mutates: unregisters, leaves the directory, frees the slab

A background thread heartbeats the node's lease, re-registers everything after the directory lost it, and
releases pins whose reader vanished.
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
from collections import Counter, defaultdict

import msgpack
import numpy as np
import redis

from kvmesh.config import KVMeshConfig
from kvmesh.directory import FIELD_BYTES, Directory, Lease
from kvmesh.telemetry import RayExporter, Records, export_node_stats
from kvmesh.tiers import TIER_NAMES, checksum
from kvmesh.cascade import Cascade
from kvmesh.tiers.cpu import CpuTier
from kvmesh.inflight import InflightPulls
from kvmesh.transport import ChecksumError, DataClient, DataServer
from kvmesh.wire import (NodeInfo, PinnedChunk, StoreItem, WireError, pack_chunk_header, pack_keys, pack_pin_reply,
                         pack_store, unpack_chunk_header, unpack_keys, unpack_pull_through, unpack_request,
                         unpack_store)

log = logging.getLogger("kvmesh.node")
_SLAB_RE = re.compile(r"^kvmesh-(?P<node>[0-9a-f]+)-(?P<pid>\d+)-[0-9a-f]+$")


def remove_stale_slabs(shm_dir: str = "/dev/shm") -> int:
    """Unlink slabs whose KVNode process is gone (killed with SIGKILL, or its node removed). Returns how many."""
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


def fit_slots(num_slots: int, slot_bytes: int, free_bytes: int) -> int:
    """The CPU tier's slots: as configured, or, where the shared-memory file system cannot hold that many (a
    sparse slab bigger than /dev/shm would die of SIGBUS when touched), as many as half its free space holds (the
    other half is left to Ray's object store, which lives there too)."""
    if num_slots * slot_bytes <= free_bytes:
        return num_slots
    return max(1, free_bytes // 2 // slot_bytes)


class KVNode:
    def __init__(self, config: KVMeshConfig | dict, node_id: str, actor_name: str = "",
                 host: str = "127.0.0.1") -> None:
        self.config = config if isinstance(config, KVMeshConfig) else KVMeshConfig(**config)
        self.node_id = node_id
        self.stats_counts: Counter[str] = Counter()
        self._lock = threading.Lock()  # guards the tier, pins and stats
        self._pins: dict[int, tuple[list[int], float]] = {}  # pin id -> (slots, monotonic deadline)
        self._pin_ids = itertools.count(1)
        self._dirty = False  # a directory update failed; its changes are sent again on the next heartbeat
        self._unregistered = False  # a re-registration after a resync failed; it is redone on the next heartbeat
        self.fenced = False  # a newer incarnation of this node exists; stop registering
        cfg = self.config
        node_tag = node_id[:16].lower()
        os.makedirs(cfg.shm_dir, exist_ok=True)
        remove_stale_slabs(cfg.shm_dir)
        path = os.path.join(cfg.shm_dir, f"kvmesh-{node_tag}-{os.getpid()}-{secrets.token_hex(4)}")
        st = os.statvfs(cfg.shm_dir)
        num_slots = fit_slots(cfg.num_slots, cfg.slot_bytes, st.f_bavail * st.f_frsize)
        if num_slots < cfg.num_slots:  # one config for every node; this one's /dev/shm is smaller
            log.warning("KVNode %s: cpu_bytes %d does not fit the %d bytes free in %s: a CPU tier of %d slots",
                        node_id[:8], cfg.cpu_bytes, st.f_bavail * st.f_frsize, cfg.shm_dir, num_slots)
        self.tier = CpuTier(path, num_slots, cfg.slot_bytes)  # the slab every reader maps
        gpu = None
        if cfg.gpu_bytes:
            import torch  # only nodes asked for a GPU tier import it

            if cfg.gpu_device.startswith("cuda") and not torch.cuda.is_available():
                # one configuration serves every node of a cluster; a node without a GPU goes without the tier
                log.warning("KVNode %s: gpu_bytes is set but this node has no CUDA device: no GPU tier",
                            node_id[:8])
            else:
                from kvmesh.tiers.gpu import GpuTier

                gpu = GpuTier(cfg.gpu_bytes // cfg.slot_bytes, cfg.slot_bytes, cfg.gpu_device)
        disk = None
        if cfg.disk_bytes:
            from kvmesh.tiers.disk import DiskTier, claim_directory

            disk_path, lock_fd = claim_directory(cfg.disk_dir, node_id)  # not named by the node id: see there
            disk = DiskTier(disk_path, cfg.disk_bytes // cfg.slot_bytes, cfg.slot_bytes,
                            direct_io=cfg.disk_direct_io, lock_fd=lock_fd)
        self.cascade = Cascade(self.tier, gpu, disk, cfg.write_policy)
        self._io = queue.SimpleQueue()  # disk writes and the start-up verification, run by the I/O threads
        recovered = disk.recover() if disk is not None else []
        if recovered:  # readable at once (every disk read is verified); registered once verified below
            disk.adopt([(r.slot, r.key, r.group, r.nbytes, r.checksum) for r in recovered])
            for r in recovered:
                self._io.put(("verify", r))
        self._promote: list[bytes] = []  # keys hit on the CPU tier, promoted by the maintenance thread
        self._inflight = InflightPulls()  # chunks being pulled from peers for this node's readers (under _lock)
        self._peers = DataClient()  # this node's connections to peers' DataServers, for pull_through
        self._peer_table = None  # the directory's node table, read at most every node_refresh_s (pull_through)
        self._peer_table_at = -1e9
        self._served: Counter[str] = Counter()  # bytes served, by requesting node id
        self._group_hits: Counter[bytes] = Counter()  # chunk hits by prompt group (first-chunk hash)
        self.data_server = None
        try:
            if cfg.peer_transport == "tcp":
                self.data_server = DataServer(self._pin_for_send, self._unpin_sent, host)
            self.info = NodeInfo(node_id, actor_name, path, num_slots * cfg.slot_bytes, cfg.slot_bytes,
                                 self.data_server.address if self.data_server else "")
            self.directory = Directory(cfg.redis_url, cfg.key_prefix)
            self.lease: Lease = self.directory.join(self.info, self._lease_ms)
            self._server = self.directory.server_identity()  # the Redis server(s) this incarnation registered with
            self._to_purge: list[int] = [self.lease.previous] if self.lease.previous else []
        except Exception:
            if self.data_server:
                self.data_server.shutdown()
            self.tier.close()
            raise
        self._records = Records(self.directory.redis, cfg.key_prefix)
        self._ray_metrics = RayExporter()
        self._last_published: dict = {}
        self._pending_events: list = []
        self._dead_since: dict[int, float] = {}  # lapsed incarnation -> when the janitor first saw it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._maintain, name="kvmesh-node-heartbeat", daemon=True)
        self._thread.start()
        self._io_threads = []
        if disk is not None:
            for i in range(cfg.io_threads):
                t = threading.Thread(target=self._io_loop, name=f"kvmesh-node-io-{i}", daemon=True)
                t.start()
                self._io_threads.append(t)
        log.info("KVNode %s incarnation %d: %d slots of %d bytes at %s", node_id[:8], self.lease.incarnation,
                 num_slots, cfg.slot_bytes, path)

    @property
    def _lease_ms(self) -> int:
        return int(self.config.lease_s * 1000)

    # -- same-node readers ---------------------------------------------------------------------------------------
    def hello(self) -> bytes:
        return msgpack.packb([1, self.info.pack(), self.lease.incarnation, self.config.to_dict()],
                             use_bin_type=True)

    def pin(self, request: bytes) -> bytes:
        keys, _requester = unpack_request(request, "PinRequest")
        slots = self._pin_host(keys)
        with self._lock:
            self._account(self.node_id, slots)
            pin_id = next(self._pin_ids)
            if slots:
                self._pins[pin_id] = (slots, time.monotonic() + self.config.pin_ttl_s)
            rows = [PinnedChunk(s, self.tier.record(s).nbytes, self.tier.record(s).checksum) for s in slots]
            self.stats_counts["pins"] += 1
            self.stats_counts["pinned_chunks"] += len(slots)
        return pack_pin_reply(pin_id, rows, self.info.slab_path)

    def _pin_host(self, keys: list[bytes]) -> list[int]:
        """Pin the leading run of `keys` in the CPU slab: GPU-only chunks are copied into it, disk-only ones
        read into it (without the lock held). Call without the lock."""
        with self._lock:
            n, reads = self.cascade.prepare_host(keys)
        ok = self.cascade.run_reads(reads) if reads else []
        with self._lock:
            self.cascade.discard_corrupt()
            slots = self.cascade.finish_host(keys, n, reads, ok)
            if self.cascade.gpu is not None and self.config.promote_on_hit:
                self._promote.extend(keys[:len(slots)])
        if reads:
            self._sync_directory()
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
        self._served[requester] += nbytes
        if len(self._group_hits) > 4096:  # keep the top ones only
            self._group_hits = Counter(dict(self._group_hits.most_common(1024)))

    def unpin(self, pin_id: int) -> None:
        if isinstance(pin_id, bool) or not isinstance(pin_id, int):
            raise WireError(f"pin_id must be an int, got {type(pin_id).__name__}")
        with self._lock:
            entry = self._pins.pop(pin_id, None)
            if entry is not None:
                self.tier.unpin(entry[0])

    def report_corrupt(self, request: bytes) -> int:
        keys = unpack_keys(request, "PinRequest")
        with self._lock:
            slots = self.tier.pin(keys)
        bad = []
        try:
            for s in slots:
                if not self.tier.verify(s):
                    bad.append(s)
        finally:
            with self._lock:
                bad_chunks = [(self.tier.record(s).group, self.tier.record(s).key) for s in bad]
                self.tier.unpin(slots)
        self._drop(bad_chunks)
        return len(bad_chunks)

    # -- peers ---------------------------------------------------------------------------------------------------
    def pull(self, request: bytes) -> tuple[bytes, np.ndarray]:
        keys, requester = unpack_request(request, "PullRequest")
        slots = self._pin_host(keys)
        with self._lock:
            self._account(requester or "?", slots)
            sizes = [self.tier.record(s).nbytes for s in slots]
        out = np.empty(sum(sizes), dtype=np.uint8)
        rows, bad, off = [], [], 0
        try:
            for s, n in zip(slots, sizes):
                dst = out[off:off + n]
                np.copyto(dst, np.frombuffer(self.tier.chunk_view(s), dtype=np.uint8))
                c = checksum(dst)
                if c != self.tier.record(s).checksum:
                    bad.append(s)
                    break
                rows.append((n, c))
                off += n
        finally:
            with self._lock:
                bad_chunks = [(self.tier.record(s).group, self.tier.record(s).key) for s in bad]
                self.tier.unpin(slots)
                self.stats_counts["pulls"] += 1
                self.stats_counts["pulled_chunks"] += len(rows)
                self.stats_counts["pulled_bytes"] += off
        self._drop(bad_chunks)
        return pack_chunk_header(rows), out[:off]

    def _pin_for_send(self, keys: list[bytes], requester: str = "") -> tuple[list[int], list[tuple[int, int]],
                                                                           list[memoryview]]:
        """For the DataServer: pin the leading run of `keys`; the client verifies the checksums it receives."""
        slots = self._pin_host(keys)
        with self._lock:
            self._account(requester or "?", slots)
            rows = [(self.tier.record(s).nbytes, self.tier.record(s).checksum) for s in slots]
            self.stats_counts["pulls"] += 1
            self.stats_counts["pulled_chunks"] += len(slots)
            self.stats_counts["pulled_bytes"] += sum(n for n, _ in rows)
        return slots, rows, [self.tier.chunk_view(s) for s in slots]

    def _unpin_sent(self, slots: list[int]) -> None:
        with self._lock:
            self.tier.unpin(slots)

    # -- pull-through: one transfer per chunk for all the readers of this node -----------------------------------
    def pull_through(self, request: bytes) -> bytes:
        req = unpack_pull_through(request)
        deadline = time.monotonic() + req.deadline_ms / 1000
        with self._lock:
            mine, theirs = self._inflight.claim(req.keys, self.cascade.holds)
        pulled = 0
        try:
            if mine:
                pulled = self._pull_from_peer(req, mine, deadline)
        finally:
            with self._lock:
                events = self._inflight.release(mine)
                self.stats_counts["pull_through_calls"] += 1
                self.stats_counts["pull_through_pulled_chunks"] += pulled
                self.stats_counts["pull_through_waited_chunks"] += len(theirs)
            for ev in events:
                ev.set()
        for ev in theirs.values():  # another reader's transfer of these chunks; the tier says how it went
            if not ev.wait(max(0.0, deadline - time.monotonic())):
                break
        return self.pin(pack_keys(req.keys, self.node_id))

    def _pull_from_peer(self, req, keys: list[bytes], deadline: float) -> int:
        """Bring the leading run of `keys` from the holder into this node's tiers and register it; returns how
        many chunks landed. Failures end the run early and are counted, never raised."""
        info = self._peer_info(req.holder)
        if info is None or info.node_id == self.node_id:
            self._count("pull_through_holder_unknown")
            return 0
        with self._lock:
            direct = self.cascade.top is self.tier and req.nbytes <= self.tier.slot_bytes
        if req.transport == "tcp" and info.data_addr and direct:
            return self._pull_tcp_into_slab(req, keys, info.data_addr, deadline)
        try:  # through Ray (or above a GPU tier): into a buffer, then the store path checks and places it
            if req.transport == "tcp" and info.data_addr:
                buf = np.empty(len(keys) * req.nbytes, dtype=np.uint8)
                sums: list[int] = []
                k, err = self._peers.pull(info.data_addr, keys, req.nbytes,
                                          lambda j: [buf[j * req.nbytes:(j + 1) * req.nbytes]], deadline,
                                          self.node_id, sums)
                rows = list(zip([req.nbytes] * k, sums))
                if isinstance(err, ChecksumError):
                    self._report_to_holder(req.holder, keys[k:k + 1])
            else:
                import ray

                from kvmesh.mesh import NAMESPACE

                if not ray.is_initialized():  # a KVNode outside Ray (tests): no Ray path; never start a Ray here
                    raise ConnectionError("not inside a Ray cluster")
                actor = ray.get_actor(info.actor_name, namespace=NAMESPACE)
                header, buf = ray.get(actor.pull.remote(pack_keys(keys, self.node_id)),
                                      timeout=max(0.0, deadline - time.monotonic()))
                rows = unpack_chunk_header(header)
                err = None
        except Exception as e:  # Ray errors, a vanished actor, a timeout: a shorter read
            self._count(f"pull_through_error_{type(e).__name__}")
            return 0
        if err is not None:
            self._count(f"pull_through_error_{type(err).__name__}")
        n = 0
        while n < len(rows) and rows[n][0] == req.nbytes and (n + 1) * req.nbytes <= buf.size:
            n += 1
        if not n:
            return 0
        items = [StoreItem(req.group, key, req.nbytes, c) for key, (_, c) in zip(keys, rows[:n])]
        return self.store(pack_store(items), buf[: n * req.nbytes])

    def _pull_tcp_into_slab(self, req, keys: list[bytes], address: str, deadline: float) -> int:
        """Receive straight into reserved slab slots (the socket writes the shared memory; the checksum is
        checked as the bytes arrive), then make them readable and register them."""
        tickets = []
        protect = frozenset(req.keys)
        with self._lock:
            for key in keys:
                t = self.cascade.prepare(key, req.group, req.nbytes, protect)
                if t is None:  # no unpinned slot to evict, or a store of it just began
                    break
                tickets.append(t)
        sums: list[int] = []
        k = 0
        try:
            if tickets:
                k, err = self._peers.pull(
                    address, keys[:len(tickets)], req.nbytes,
                    lambda j: [np.frombuffer(self.tier.buffer(tickets[j].slot), dtype=np.uint8)[: req.nbytes]],
                    deadline, self.node_id, sums)
                if err is not None:
                    self._count(f"pull_through_error_{type(err).__name__}")
                    if isinstance(err, ChecksumError):  # the holder's copy is bad: it re-verifies and drops it
                        self._report_to_holder(req.holder, keys[k:k + 1])
        finally:
            with self._lock:
                for j, t in enumerate(tickets):
                    if j < k:
                        self.cascade.complete(t, sums[j])
                    else:
                        self.cascade.abort(t)
                self.stats_counts["stored_chunks"] += k
        self._sync_directory()
        return k

    def _report_to_holder(self, holder: str, keys: list[bytes]) -> None:
        try:
            import ray

            from kvmesh.mesh import NAMESPACE, actor_name

            if ray.is_initialized():
                ray.get_actor(actor_name(holder), namespace=NAMESPACE).report_corrupt.remote(pack_keys(keys))
        except Exception as e:  # the holder is gone: nothing to tell
            log.debug("could not report a corrupt chunk to %s: %s", holder[:8], e)

    def _peer_info(self, node_id: str) -> NodeInfo | None:
        """The live holder's record, from a node table at most node_refresh_s old (read again if it is older and
        does not name the holder)."""
        table = self._peer_table
        if table is not None and (info := table.get(node_id)) is not None \
                and time.monotonic() - self._peer_table_at <= self.config.node_refresh_s:
            return info
        try:
            self._peer_table, self._peer_table_at = self.directory.node_table().by_node(), time.monotonic()
        except redis.RedisError:
            return None
        return self._peer_table.get(node_id)

    # -- stores --------------------------------------------------------------------------------------------------
    def store(self, request: bytes, data) -> int:
        items = unpack_store(request)
        buf = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
        if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size != sum(i.nbytes for i in items):
            raise WireError("StoreRequest: buffer size does not match the header")
        offsets = list(itertools.accumulate((i.nbytes for i in items), initial=0))
        counts: Counter[str] = Counter()
        # Last chunk first: the policy then holds a prompt's head as most recent, so eviction trims tails.
        for idx in range(len(items) - 1, -1, -1):
            item = items[idx]
            if item.nbytes > self.tier.slot_bytes:
                counts["store_refused_too_big"] += 1
                continue
            src = buf[offsets[idx]:offsets[idx + 1]]
            with self._lock:
                ticket = self.cascade.prepare(item.key, item.group, item.nbytes)
                top = self.cascade.top
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
            with self._lock:
                if ok:
                    self.cascade.complete(ticket, item.checksum)
                else:
                    self.cascade.abort(ticket)
            counts["stored_chunks" if ok else "store_corrupt_in_transit"] += 1
        with self._lock:
            self.stats_counts.update(counts)
        self._sync_directory()
        return counts["stored_chunks"]

    def _drop(self, chunks: list[tuple[bytes, bytes]]) -> None:
        """Forget corrupt chunks: out of every tier and out of the directory."""
        if not chunks:
            return
        with self._lock:
            for _group, key in chunks:
                self.cascade.discard(key)
            self.stats_counts["corrupt_dropped"] += len(chunks)
        log.warning("KVNode %s dropped %d corrupt chunk(s)", self.node_id[:8], len(chunks))
        self._event("corrupt_chunk", "checksum", f"{len(chunks)} chunk(s) dropped")
        self._sync_directory()

    def _sync_directory(self) -> None:
        """Tell the directory what the cascade changed: each chunk's best tier now, or that it is gone."""
        with self._lock:
            changes = self.cascade.drain()
            for job in self.cascade.take_writes():
                self._io.put(("write", job))
        if not changes or self.fenced:
            return
        removed: dict[bytes, list[bytes]] = defaultdict(list)
        by_tier: dict[int, dict[bytes, list[bytes]]] = defaultdict(lambda: defaultdict(list))
        for (group, key), tier in changes.items():
            if tier is None:
                removed[group].append(key)
            else:
                by_tier[tier][group].append(key)
        try:
            for group, keys in removed.items():
                self.directory.unregister(self.lease, group, keys)
            for tier, groups in by_tier.items():
                for group, keys in groups.items():
                    self.directory.register(self.lease, tier, group, keys)
            if removed:  # groups this node no longer holds anything of leave its purge index
                self.directory.disown(self.lease, list(removed), self._holds_no_chunk_of)
        except redis.RedisError as e:
            # Put the changes back (newer ones made meanwhile win) so the next heartbeat sends them again: a
            # removal that did not reach Redis must not leave the entry behind. Both calls are idempotent.
            with self._lock:
                for change, tier in changes.items():
                    self.cascade.changes.setdefault(change, tier)
                self.stats_counts["directory_errors"] += 1
            self._dirty = True
            log.warning("KVNode %s: directory update failed (%s); will retry", self.node_id[:8], e)

    def _holds_no_chunk_of(self, group: bytes) -> bool:
        with self._lock:
            return not self.cascade.holds_group(group)

    # -- maintenance ---------------------------------------------------------------------------------------------
    def _maintain(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            self._expire_pins()
            self._run_promotions()
            self._publish()
            if self.fenced:
                continue
            try:
                self._janitor()
            except redis.RedisError as e:
                log.debug("janitor round failed: %s", e)
            try:
                state = self.directory.heartbeat(self.lease, self._lease_ms)
                if state == "ok" and self.directory.server_identity() != self._server:
                    state = "resync"  # a restarted or failed-over Redis: it may lack or keep entries wrongly
                    self._count("directory_server_changed")
                if state == "resync":
                    self._resync()
                elif state == "fenced":
                    self.fenced = True
                    log.warning("KVNode %s incarnation %d was superseded; no longer registering",
                                self.node_id[:8], self.lease.incarnation)
                elif self._unregistered:
                    self._reregister()
                elif self._dirty:
                    self._dirty = False
                    self._sync_directory()
            except redis.RedisError as e:
                with self._lock:
                    self.stats_counts["directory_errors"] += 1
                log.debug("heartbeat failed: %s", e)

    # -- janitor: purging what dead and superseded incarnations left behind --------------------------------------
    def _janitor(self) -> None:
        """Each heartbeat: purge this node's own previous incarnation once; and, on the one node that holds the
        janitor claim, end the leases of nodes Ray reports dead and purge incarnations that lapsed. Readers never
        see such entries anyway (they check incarnations and leases); purging gives back their memory, and Ray's
        word ends a dead node's lease before it would lapse."""
        d = self.directory
        while self._to_purge:
            inc = self._to_purge[0]
            n = d.purge(inc)
            self._to_purge.pop(0)
            self._count("purged_entries", n)
        if not d.claim("janitor", f"{self.node_id}:{self.lease.incarnation}", int(self._lease_ms)):
            return
        table = d.node_table()
        for node_id in self._ray_dead_nodes(table):
            info = table.by_node()[node_id]
            if d.expire(node_id, info.incarnation):
                self._count("ray_reported_dead")
                self._event("node_dead", "ray", node_id[:12])
                self._purge(node_id, info.incarnation)
        now = time.monotonic()
        for node_id, inc in (table.dead_incarnations or {}).items():
            first = self._dead_since.setdefault(inc, now)
            # A short grace for a heartbeat that is merely late, so that the purge lands within 2 lease periods of
            # the node's death (lapse <= 1 lease, first seen <= 1 heartbeat later, then this). Purging a node that
            # was alive after all is safe: its next heartbeat finds its row gone, and it re-joins and re-registers.
            if now - first >= self.config.lease_s / 4:
                self._purge(node_id, inc)
        self._dead_since = {i: t for i, t in self._dead_since.items()
                            if i in (table.dead_incarnations or {}).values()}

    def _purge(self, node_id: str, inc: int) -> None:
        if self.directory.claim(f"purge:{inc}", self.node_id, 60_000):
            self._count("purged_entries", self.directory.purge(inc))
            self.directory.forget(node_id, inc)
            self._count("purged_incarnations")

    def _ray_dead_nodes(self, table) -> list[str]:
        """Live directory nodes that Ray's GCS says are dead (only inside a Ray cluster)."""
        try:
            import ray

            if not ray.is_initialized():
                return []
            dead = {n["NodeID"] for n in ray.nodes() if not n.get("Alive", True)}
        except Exception:  # no Ray here, or its GCS did not answer: the leases still decide
            return []
        return [node_id for node_id in table.by_node() if node_id in dead and node_id != self.node_id]

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.stats_counts[name] += n

    def _publish(self) -> None:
        """Telemetry at the edge: the stats snapshot to Redis (the live page) and to Ray metrics."""
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
        self._pending_events.append((kind, reason, detail))

    def _io_loop(self) -> None:
        disk = self.cascade.disk
        while not self._stop.is_set():
            try:
                kind, item = self._io.get(timeout=0.5)
            except queue.Empty:
                continue
            if kind == "write":
                ok = True
                try:
                    disk.write_chunk(item.ticket.slot, item.data, item.nbytes, item.ticket.key, item.group,
                                     item.checksum)
                except OSError as e:
                    ok = False
                    with self._lock:
                        self.stats_counts[f"disk_write_{errno.errorcode.get(e.errno, 'error')}"] += 1
                    log.warning("KVNode %s: disk write failed (%s); the chunk stays where it was or is dropped",
                                self.node_id[:8], e)
                    self._event("disk_write_failed", errno.errorcode.get(e.errno, "error"), str(e))
                with self._lock:
                    self.cascade.finish_write(item, ok)
            elif kind == "verify":  # a chunk found on disk at start-up: register it once its bytes check out
                try:
                    good = checksum(disk.read_chunk(item.slot, item.nbytes)) == item.checksum
                except OSError:
                    good = False
                with self._lock:
                    if disk.record(item.slot).key != item.key:
                        continue  # already gone (evicted or read and found corrupt)
                    if good:
                        self.cascade.changes[(item.group, item.key)] = self.cascade.best_tier(item.key)
                        self.stats_counts["disk_recovered"] += 1
                    else:
                        disk.invalidate(item.slot)
                        self.cascade.discard(item.key)
                        self.stats_counts["disk_recovery_corrupt"] += 1
            self._sync_directory()

    def _run_promotions(self) -> None:
        with self._lock:
            keys, self._promote = self._promote, []
            if keys:
                self.cascade.promote(list(dict.fromkeys(keys)))
        if keys:
            self._sync_directory()

    def _expire_pins(self) -> None:
        now = time.monotonic()
        with self._lock:
            for pin_id in [p for p, (_, deadline) in self._pins.items() if deadline < now]:
                self.tier.unpin(self._pins.pop(pin_id)[0])
                self.stats_counts["pins_expired"] += 1

    def _resync(self) -> None:
        """The directory lost this node (restarted empty, or failed over): re-join under a new incarnation so
        nothing registered before can be mistaken for current, then register everything held."""
        old = self.lease.incarnation
        self._server = self.directory.server_identity()
        self.lease = self.directory.join(self.info, self._lease_ms, old)
        # What the old incarnation registered in this Redis before the heartbeat noticed (an emptied Redis does
        # not know it as "previous") is dead now; give its memory back too.
        for inc in dict.fromkeys((self.lease.previous, old)):
            if inc and inc != self.lease.incarnation:
                self._to_purge.append(inc)
        with self._lock:
            self.stats_counts["resyncs"] += 1
        log.warning("KVNode %s re-joined the directory as incarnation %d", self.node_id[:8], self.lease.incarnation)
        self._event("resync", "directory_lost", f"incarnation {self.lease.incarnation}")
        self._reregister()

    def _reregister(self) -> None:
        self._unregistered = True  # until every held chunk is registered under the current incarnation
        with self._lock:
            chunks = self.cascade.ready_chunks()
            self.cascade.drain()  # everything is registered afresh below
        by_tier: dict[int, dict[bytes, list[bytes]]] = defaultdict(lambda: defaultdict(list))
        for group, key, tier in chunks:
            by_tier[tier][group].append(key)
        for tier, groups in by_tier.items():  # a RedisError leaves _unregistered set: the next heartbeat redoes it
            self.directory.register_many(self.lease, tier, groups)
        self._unregistered = False

    def stats(self) -> dict:
        with self._lock:
            d = dict(self.stats_counts)
            c = self.cascade
            d.update(c.counts, evictions=sum(c.evictions.values()), evictions_by_tier=dict(c.evictions),
                     tier_flows=[[src, dst, n, c.flow_bytes[(src, dst)]] for (src, dst), n in c.flows.items()])
            d.update(node_id=self.node_id, pid=os.getpid(), incarnation=self.lease.incarnation, chunks=len(self.tier),
                     used_bytes=self.tier.used_bytes, capacity_bytes=self.tier.num_slots * self.tier.slot_bytes,
                     pinned=sum(len(s) for s, _ in self._pins.values()), fenced=self.fenced)
            disk = self.cascade.disk
            if disk is not None:
                d.update(disk_chunks=len(disk), disk_used_bytes=disk.used_bytes,
                         disk_capacity_bytes=disk.num_slots * disk.slot_bytes, disk_direct_io=disk.direct_io,
                         disk_pending_io=self._io.qsize())
            gpu = self.cascade.gpu
            if gpu is not None:
                d.update(gpu_chunks=len(gpu), gpu_used_bytes=gpu.used_bytes,
                         gpu_capacity_bytes=gpu.num_slots * gpu.slot_bytes)
            d["tiers"] = [{"tier": TIER_NAMES[t.tier_id], "chunks": len(t), "used_bytes": t.used_bytes,
                           "capacity_bytes": t.num_slots * t.slot_bytes} for t in self.cascade._tiers()]
            d["served_bytes"] = dict(self._served)
            d["top_prefixes"] = [[g.hex(), n] for g, n in self._group_hits.most_common(10)]
            d["time"] = time.time()
        return d

    def check_integrity(self, verify_checksums: bool = True, directory: bool = False) -> None:
        """The tiers' invariants (and every chunk's checksum); with `directory`, also that the directory lists
        exactly the chunks held, each at its best tier, under this incarnation: nothing held is unfindable and
        nothing findable is missing. Call it while no stores or reads are in flight."""
        if directory:
            self._sync_directory()
        with self._lock:
            self.cascade.check_integrity(verify_checksums=verify_checksums)
            held = {(g, k[:FIELD_BYTES]): t for g, k, t in self.cascade.ready_chunks()}
        if directory and not self.fenced:
            assert not (self._dirty or self._unregistered), "directory updates are still pending"
            listed = self.directory.entries_of(self.lease.incarnation)
            unfindable = held.keys() - listed.keys()
            phantom = listed.keys() - held.keys()
            assert not unfindable, f"{len(unfindable)} chunk(s) held but not in the directory"
            assert not phantom, f"{len(phantom)} directory entries for chunks not held"
            moved = [c for c, t in held.items() if listed[c] != t]
            assert not moved, f"{len(moved)} directory entries name the wrong tier"
            indexed = self.directory.redis.smembers(self.directory.own_key(self.lease.incarnation))
            groups = {g for g, _ in held}
            assert indexed == groups, (f"the purge index lists {len(indexed - groups)} group(s) not held and misses "
                                       f"{len(groups - indexed)}")

    def shutdown(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        if self.data_server:
            self.data_server.shutdown()
        self._peers.close()
        try:
            with self._lock:
                for group, key, _tier in self.cascade.ready_chunks():
                    self.cascade.changes[(group, key)] = None
            self._sync_directory()
            self.directory.leave(self.lease)
        except redis.RedisError:
            pass  # the lease lapses on its own
        for t in self._io_threads:
            t.join(timeout=5)
        self.directory.close()
        self.tier.close()
        if self.cascade.gpu is not None:
            self.cascade.gpu.close()
        if self.cascade.disk is not None:
            self.cascade.disk.close()
