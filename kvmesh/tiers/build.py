"""A node's tiers, built from its configuration: the CPU slab every reader maps (under `shm_dir`, fitted to what
that file system has free), the disk tier (its directory claimed, what a previous process left there recovered)
and the GPU tier; the GPU pools' CUDA IPC exports for same-node readers; and the slab helpers (the slabs of dead
processes, removed).

    build_tiers(cfg, node_id, restarted, counts) -> Tiers    a first start that cannot have a tier fails, said in
                                                             one line naming the setting; a restart goes without it
    export_gpu(gpu, node_id, slab_path) -> (packed exports)   none where IPC is not possible here
    remove_stale_slabs(shm_dir) -> int, fit_slots(...), setting_error(...)
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.config import KVMeshConfig
from kvmesh.tiers.cpu import CpuTier

if TYPE_CHECKING:
    from kvmesh.tiers.disk import DiskTier
    from kvmesh.tiers.gpu import GpuTier

log = logging.getLogger("kvmesh.node")

# a slab, its table relay, and the relay's temp file (`TableFile.write`: a node killed mid-write leaves it)
_SLAB_RE = re.compile(r"^kvmesh-(?P<node>[0-9a-f]+)-(?P<pid>\d+)-[0-9a-f]+(\.nodes(\.\d+\.\d+)?)?$")


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


@dataclass
class Tiers:
    cpu: CpuTier
    gpu: GpuTier | None = None
    disk: DiskTier | None = None
    recovered: list = field(default_factory=list)  # chunks the disk tier found at start-up (readable, unverified)

    def close(self) -> None:
        self.cpu.close()
        if self.gpu is not None:
            self.gpu.close()
        if self.disk is not None:
            self.disk.close()  # (and its directory's lock: a next try takes the same directory and its chunks)


def build_tiers(cfg: KVMeshConfig, node_id: str, restarted: bool, counts: Counter) -> Tiers:
    """`restarted` (Ray restarted this node's actor): a disk or GPU tier that cannot be had now is left out, not an
    error (counted in `counts`: disk_unavailable, gpu_unavailable)."""
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
        cpu = CpuTier(path, num_slots, cfg.slot_bytes)
    except OSError as e:
        raise setting_error("shm_dir", cfg.shm_dir, e) from e
    disk = None
    try:  # (a first start that fails here leaves no slab file behind: its pid lives on, nothing would clean it)
        disk, recovered = _disk_tier(cfg, node_id, restarted, counts) if cfg.disk_bytes else (None, [])
        gpu = _gpu_tier(cfg, node_id, restarted, counts)
    except BaseException:
        if disk is not None:
            disk.close()
        cpu.close()
        raise
    return Tiers(cpu, gpu, disk, recovered)


def _disk_tier(cfg: KVMeshConfig, node_id: str, restarted: bool, counts: Counter):
    """The disk tier and the chunks it recovered. Where its directory cannot be used (a disk that went
    read-only or full, a directory without permission) a first start fails, said in one line; a restart
    (`restarted`) leaves the tier out and says so (`disk_unavailable`): Ray does not retry a restarted
    actor whose creation fails, and the node would lose its other tiers with it, for good."""
    from kvmesh.tiers.disk import DiskTier, claim_directory

    disk, lock_fd = None, None
    try:
        disk_path, lock_fd = claim_directory(cfg.disk_dir, node_id)  # not named by the node id: see there
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
        if not restarted:
            raise setting_error("disk_dir", cfg.disk_dir, e) from e
        counts["disk_unavailable"] += 1
        log.error("KVNode %s: the disk tier at %s cannot be used (%s): none", node_id[:8], cfg.disk_dir, e)
        return None, []


def _gpu_tier(cfg: KVMeshConfig, node_id: str, restarted: bool, counts: Counter):
    if not cfg.gpu_bytes:
        return None
    import torch  # only nodes asked for a GPU tier import it

    if cfg.gpu_device.startswith("cuda") and not torch.cuda.is_available():
        # one configuration serves every node of a cluster; a node without a GPU goes without the tier
        log.warning("KVNode %s: gpu_bytes is set but this node has no CUDA device: no GPU tier", node_id[:8])
        return None
    from kvmesh.tiers.gpu import GpuTier
    from kvmesh.tiers.gpu_ipc import GpuIpcError

    try:
        return GpuTier(cfg.gpu_bytes // cfg.slot_bytes, cfg.slot_bytes, cfg.gpu_device)
    except (torch.cuda.OutOfMemoryError, GpuIpcError) as e:  # (a restart before the old process's memory is
        out_of_memory = not isinstance(e, GpuIpcError) or e.reason == "out_of_memory"  # freed, or another's)
        if not (restarted and out_of_memory):
            raise
        counts["gpu_unavailable"] += 1
        log.error("KVNode %s: no room for the GPU tier on %s (%s): none", node_id[:8], cfg.gpu_device, e)
        return None


def export_gpu(gpu: GpuTier | None, node_id: str, slab_path: str) -> tuple[bytes, ...]:
    """The GPU tier's pools for same-node readers (CUDA IPC); none where the tier is absent, on a CPU stand-in
    device, or IPC is not possible here (readers then get GPU-tier chunks through the slab)."""
    if gpu is None:
        return ()
    from kvmesh.tiers.gpu_ipc import GpuIpcError

    try:  # the node id, not the incarnation, names the pools: a re-join keeps them (they are the same memory)
        return tuple(e.pack() for e in gpu.exports(node_id, slab_path))
    except GpuIpcError as e:
        log.info(
            "KVNode %s: GPU tier not exported (%s): readers get its chunks through the slab", node_id[:8], e.reason
        )
        return ()
