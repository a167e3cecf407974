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
    stats() -> dict, snapshot() -> NodeStats, check_integrity(...), locate(keys)   reads
    shutdown()                            mutates: unregisters, leaves the directory, frees the slab
    kill()                                stops as a crash would (tests): no leave, no unregister

The node is a facade over parts that own their state, all guarded by `lock`: the tier `Cascade` (built by
`tiers.build`), `Serving` (the pin table, every way a chunk is served, per-reader accounting), `Stores` (the
store path), `DiskIO` (the disk I/O threads), `SlabSums` (the device-checksum thread beside the slab), the
GPU-tier `Reservations` of same-node writers, `PullThrough` (with its own `Fetcher`), `Replicas` and
`LastCopies`; and, with their own locks, the
`Registrar` (the single writer of the node's directory entries and lease), the `Janitor`, a `NodeView` of its
peers, the `DataServer` and `Telemetry`. The node's own threads: one maintenance thread (pin and reservation
expiry, promotions, telemetry, the janitor; `maintenance_rounds` counts its passes) and the node-table relay.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import numpy as np
import redis

from kvmesh.cascade import Cascade
from kvmesh.config import KVMeshConfig
from kvmesh.directory import FIELD_BYTES, Directory, horizon_for
from kvmesh.diskio import DiskIO, Verify
from kvmesh.handle import NodeHandle, NodeHello, Pinned, Pulled
from kvmesh.janitor import Janitor
from kvmesh.lastcopy import LastCopies
from kvmesh.nodestats import NodeStats, Telemetry
from kvmesh.nodeview import NodeView, TableFile
from kvmesh.pullthrough import PullThrough
from kvmesh.registrar import Registrar
from kvmesh.replication import Replicas
from kvmesh.reservations import Reservations
from kvmesh.serving import Serving
from kvmesh.storing import REGISTER_WAIT_S, Stores
from kvmesh.telemetry import Records
from kvmesh.tiers.build import build_tiers, export_gpu
from kvmesh.tiers.cpu import SlabSums
from kvmesh.transport import DataServer
from kvmesh.wire import GpuReserved, NodeInfo, StoreItem
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
        cfg = self.config = config
        self.node_id = node_id
        self.stats_counts: Counter[str] = Counter()
        self.lock = threading.Lock()  # guards the cascade (tiers), the pins and the stats
        self._stop = threading.Event()
        self._closed = self._killed = False
        self.maintenance_rounds = 0  # passes of the maintenance thread done (tests wait on it, not on the clock)
        tiers = build_tiers(cfg, node_id, restarted, self.stats_counts)
        self.tier = tiers.cpu  # the slab every reader maps
        cascade = self.cascade = Cascade(tiers.cpu, tiers.gpu, tiers.disk, cfg.write_policy)
        lock, counts, post, event, stop = self.lock, self.stats_counts, self._post_changes, self._event, self._stop
        self.disk_io = DiskIO(cascade, lock, counts, post, event, stop, node_id)
        if tiers.disk is not None and tiers.recovered:  # readable at once (every disk read is verified); registered
            # once verified
            tiers.disk.adopt([(r.slot, r.key, r.group, r.nbytes, r.checksum) for r in tiers.recovered])
            for r in tiers.recovered:
                self.disk_io.put(Verify(r))
        self.data_server = None
        try:
            if cfg.peer_transport == "tcp":
                self.data_server = DataServer(
                    lambda keys, requester="": self.serving.pin_for_send(keys, requester),
                    lambda slots: self.serving.unpin_sent(slots),
                    host,
                    send_timeout_s=cfg.pin_ttl_s,
                )
            self.info = NodeInfo(
                node_id,
                actor_name,
                self.tier.path,
                self.tier.num_slots * cfg.slot_bytes,
                cfg.slot_bytes,
                self.data_server.address if self.data_server else "",
            )
            self.directory = Directory(cfg.redis_url, cfg.key_prefix)
            self.directory.table_horizon_ms = horizon_for(cfg.node_refresh_s)
            self.telemetry = Telemetry(Records(self.directory.redis, cfg.key_prefix), node_id)
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
                int(cfg.lease_s * 1000),
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
            tiers.close()
            raise
        self.reservations = Reservations(cascade, lock, counts, post, cfg.pin_ttl_s, self.info.slab_path)
        self.janitor.purge_later([self.registrar.lease.previous])
        self._gpu_exports = export_gpu(self.cascade.gpu, node_id, self.info.slab_path)
        # peers, for pull-throughs; each read also relayed to the clients on this node (nodeview.TableFile)
        self.view = NodeView(self.directory.node_table, 5.0, cfg.node_refresh_s, TableFile.beside(self.tier.path))
        self.peers = lambda node: NodeHandle.find(node, self.node_id)  # a peer's KVNode (without Ray: none)
        # the last copies of chunks other nodes read: handed to a peer instead of dropped (cluster eviction)
        self.last_copies = LastCopies(
            node_id,
            cfg.last_copy_window_s,
            cfg.handoff_max_bytes,
            cfg.recompute_bytes_per_s,
            self._count,
            self.directory,
            self.telemetry.records.k_stats,
            self._peer,
        )
        self.last_copies.watch(self.cascade, self.replicas)
        self.serving = Serving(cascade, lock, counts, node_id, cfg, self.last_copies, self.replicas, post, event, stop)
        self.serving.gpu_readable = bool(self._gpu_exports)
        self.stores = Stores(cascade, lock, counts, self.disk_io, post, self.registrar, stop)
        self.pull_through_part = PullThrough(
            node_id, lock, counts, cascade, self.replicas, self.view, self._peer, self.stores.store, post, cfg
        )
        self.slab_sums = SlabSums(self.tier, lock, counts, stop)
        # (every field the threads read is set above: the maintenance thread's first stats() may run at once)
        self._thread = threading.Thread(target=self._maintain, name="kvmesh-node-maintenance", daemon=True)
        self._thread.start()
        self.slab_sums.start()
        self._table_thread = threading.Thread(target=self._table_loop, name="kvmesh-node-table", daemon=True)
        self._table_thread.start()
        if self.cascade.disk is not None:
            self.disk_io.start(cfg.io_threads)
        log.info(
            "KVNode %s incarnation %d: %d slots of %d bytes at %s",
            node_id[:8],
            self.lease.incarnation,
            self.tier.num_slots,
            cfg.slot_bytes,
            self.tier.path,
        )

    def _peer(self, node_id: str):
        return self.peers(node_id)  # (looked up at each call: tests without Ray set `peers`)

    @property
    def lease(self):
        return self.registrar.lease

    @property
    def fenced(self) -> bool:
        return self.registrar.fenced

    @property
    def closed(self) -> bool:
        """Shut down (or killed): its handles refuse calls, as a dead actor's would."""
        return self._closed

    # -- readers (`Serving`) -------------------------------------------------------------------------------------
    def hello(self) -> NodeHello:
        return NodeHello(self.info.with_incarnation(self.lease.incarnation), self.config, self._gpu_exports)

    def pin(self, keys: list[bytes], requester: str = "", gpu: bool = False, hold_s: float = 0.0) -> Pinned:
        """`gpu`: the reader maps this node's GPU pools (CUDA IPC): the leading keys held in the GPU tier are pinned
        there and read device to device, the rest in the slab (brought into it from the other tiers). `hold_s`:
        how long the reader may still read the slots (`Serving.pin`)."""
        return self.serving.pin(keys, requester, gpu, hold_s)

    def unpin(self, pin_id: int) -> None:
        self.serving.unpin(pin_id)

    def pull(self, keys: list[bytes], requester: str = "") -> Pulled:
        return self.serving.pull(keys, requester)

    def report_corrupt(self, keys: list[bytes]) -> int:
        return self.serving.report_corrupt(keys)

    def pull_through(self, req: PullRequest) -> Pinned:
        with self.serving.pulling(req.keys):
            self.pull_through_part.run(req)
            # held for the reader while its fetch may still read the slots (a device sink adopts them)
            return self.pin(req.keys, self.node_id, hold_s=req.deadline_ms / 1000)

    def _registrable(self) -> list[tuple[bytes, bytes, int]]:
        """Caller holds the lock: what the directory should list (every chunk held, but those a pull-through
        brought only for its readers)."""
        return [c for c in self.cascade.ready_chunks() if not self.replicas.is_transient(c[1])]

    # -- stores (`Stores`) ---------------------------------------------------------------------------------------
    def store(self, items: list[StoreItem], buf: np.ndarray) -> int:
        return self.stores.store(items, buf)

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

    def post_changes(self) -> int:
        with self.lock:
            return self._post_changes()

    def _post_changes(self) -> int:
        """Caller holds the lock: hand what the cascade changed to the registrar (in order), and its disk writes to
        the I/O threads. Returns the registrar's sequence number for `wait`."""
        self.disk_io.put_writes()
        return self.registrar.post(self.replicas.filter_changes(self.cascade.drain()))

    # -- maintenance ---------------------------------------------------------------------------------------------
    def _maintain(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            self.serving.expire()
            self.reservations.expire()
            self.serving.run_promotions()
            self.publish()
            if not self.fenced:
                try:
                    self.janitor.round()
                except redis.RedisError as e:
                    log.debug("janitor round failed: %s", e)
            self.maintenance_rounds += 1

    def _table_loop(self) -> None:
        """The node table, read for this node's clients every `node_refresh_s` (they read the relay, not Redis)."""
        self.view.refresh()
        while not self._stop.wait(self.config.node_refresh_s):
            self.view.refresh()

    def _count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.stats_counts[name] += n

    def _event(self, kind: str, reason: str, detail: str = "") -> None:
        self.telemetry.event(kind, reason, detail)

    def publish(self) -> None:
        """Telemetry at the edge (each maintenance pass): the stats snapshot to Redis (the live page) and to Ray
        metrics. Readers gone from the node table, and not served for 10 leases, are forgotten first."""
        self.serving.forget_readers(self.view.table().by_node(), time.monotonic() - 10 * self.config.lease_s)
        self.telemetry.publish(self.stats())

    # -- reads ---------------------------------------------------------------------------------------------------
    def locate(self, keys: list[bytes]) -> list[list]:
        return self.serving.locate(keys)

    def snapshot(self) -> NodeStats:
        with self.lock:
            return NodeStats.collect(
                self.node_id,
                self.lease.incarnation,
                self.fenced,
                self.stats_counts,
                self.cascade,
                self.serving,
                self.slab_sums.queued(),
                self.disk_io.outstanding,
                self.last_copies,
                self.replicas,
            )

    def stats(self) -> dict:
        """The wire form of `snapshot()` (what the actor, `LocalHandle` and telemetry hand on)."""
        return self.snapshot().as_dict()

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
            self.registrar.check_listed(held, groups)

    # -- the end -------------------------------------------------------------------------------------------------
    def kill(self) -> None:
        """Stop as a crash would (a test's dead node): no leave, no unregister (the lease lapses, other nodes'
        janitors purge the entries); its handles refuse calls from now on, its peers' connections are refused,
        its directory connection and disk files close. The slab stays, as a killed process's does, until
        `shutdown` frees what is left."""
        if self._closed:
            return
        self._killed = True
        self._halt()
        self.registrar.stop()
        self._close_io()

    def shutdown(self) -> None:
        if self._closed and not self._killed:
            return
        if not self._killed:
            self._halt()
        if self.view.publish is not None:
            self.view.publish.remove()
        self.slab_sums.join(timeout=30)  # it reads the slab: done before the slab is unmapped
        self.pull_through_part.close()
        self.last_copies.shutdown()
        if not self._killed:
            with self.lock:
                held = self._registrable()
            self.registrar.shutdown(held)
            self._close_io()
        self._killed = False
        self.tier.close()
        if self.cascade.gpu is not None:
            self.cascade.gpu.close()

    def _halt(self) -> None:
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=5)
        self._table_thread.join(timeout=5)
        if self.data_server:
            self.data_server.shutdown()

    def _close_io(self) -> None:
        self.disk_io.join(timeout=5)
        self.directory.close()
        if self.cascade.disk is not None:
            self.cascade.disk.close()
