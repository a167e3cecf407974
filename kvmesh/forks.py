"""Processes forked from one that uses kvmesh. Ray's connection (its core worker: gRPC channels, threads) does not
survive `fork`: in a child, calls to a KVNode actor are never answered. A `KVMeshClient` belongs to the process
that made it (its threads, its Ray handles, its sockets to peers' data servers, its telemetry deltas), and
`kvmesh.connect` in a child that inherited its parent's Ray connection would wait on that dead connection. Both
raise `ForkedProcessError` instead (never a hang, a silent miss or a store that is never made).

    inherited_ray() -> int | None    the pid of the process whose Ray connection this process inherited through
                                     fork (and still uses), or None
"""

from __future__ import annotations

import os
import sys


class ForkedProcessError(RuntimeError):
    """A kvmesh call in a process forked from the one that owns what it needs (a client, a Ray connection)."""


def check_owner(pid: int, what: str) -> None:
    """A client belongs to the process that made it (`pid`). In a child forked from that process its threads are
    gone and its Ray calls are never answered (a fetch waited out its deadline and counted a miss, a store was
    counted as handed over and never made), and its kept peer connections are its parent's too (two processes
    reading replies off one socket can take each other's chunks)."""
    if os.getpid() != pid:
        raise ForkedProcessError(
            f"{what} on a KVMeshClient made in process {pid}, from which this process ({os.getpid()}) "
            "was forked: a client belongs to the process that made it; call kvmesh.connect in a process "
            "started otherwise (multiprocessing's 'spawn' start method, a Ray task or actor)"
        )


_inherited: tuple[object, int] | None = None  # (the Ray core worker this process inherited, the parent's pid)


def _ray_core_worker():
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        worker = ray._private.worker.global_worker
        return worker.core_worker if worker.connected else None
    except Exception:  # (a Ray without these internals: nothing known)
        return None


_parent_pid = os.getpid()


def _before_fork() -> None:
    global _parent_pid
    _parent_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _inherited
    core = _ray_core_worker()
    if core is not None:
        _inherited = (core, _parent_pid)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def inherited_ray() -> int | None:
    """The pid of the process whose Ray connection this process inherited through fork and still uses, or None
    (none inherited, or Ray connected anew since)."""
    if _inherited is None:
        return None
    core, parent = _inherited
    return parent if _ray_core_worker() is core else None
