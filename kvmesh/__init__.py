"""kvmesh: a distributed, shared KV-cache service for LLM inference on Ray.

    kvmesh.start(redis_url=...)      one KVNode actor per Ray node (idempotent)
    kvmesh.connect(spec)             a KVMeshClient in any Ray driver, task or actor
    kvmesh.stop()                    remove the KVNodes
    kvmesh.DirectoryUnavailable      what start and connect raise when the directory (Redis) cannot be used
    kvmesh.ForkedProcessError        what a client's calls raise in a process forked from the one that made it,
                                     and connect in a child that inherited its parent's Ray connection

Ray is imported only when these are called, so specs, hashing and the tiers work without it.
"""

from kvmesh.config import KVMeshConfig
from kvmesh.forks import ForkedProcessError
from kvmesh.mesh import start, stop
from kvmesh.spec import KVFormat, KVGroup, KVSpec

__all__ = [
    "KVSpec",
    "KVGroup",
    "KVFormat",
    "KVMeshConfig",
    "KVMeshClient",
    "Match",
    "DirectoryUnavailable",
    "ForkedProcessError",
    "start",
    "stop",
    "connect",
]
__version__ = "0.1.0"


def connect(spec, redis_url=None, **kwargs):
    """A `KVMeshClient` for `spec` in this process; see `kvmesh.connecting.connect`."""
    from kvmesh.connecting import connect as _connect

    return _connect(spec, redis_url, **kwargs)


def __getattr__(name):
    if name in ("KVMeshClient", "Match", "ChunkMatch"):
        from kvmesh import client

        return getattr(client, name)
    if name == "DirectoryUnavailable":  # (with redis-py behind it: imported when asked for, like the client)
        from kvmesh.directory import DirectoryUnavailable

        return DirectoryUnavailable
    raise AttributeError(f"module 'kvmesh' has no attribute {name!r}")
