"""`KVMeshConfig`: the one configuration object. Built at the root (`kvmesh.start`, `kvmesh.connect`, the CLI) and
handed down; everything below takes plain arguments from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class KVMeshConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "kvmesh"  # every Redis key starts with this, so kvmesh can share a Redis

    # KVNode tiers
    cpu_bytes: int = 1 * GiB  # shared-memory CPU tier per node
    slot_bytes: int = 4 * MiB  # one chunk per slot; chunks larger than this cannot be stored
    shm_dir: str = "/dev/shm"
    gpu_bytes: int = 0  # GPU tier per node, above the CPU tier; 0 = none (the KVNode must see a GPU to use it)
    gpu_device: str = "cuda"
    promote_on_hit: bool = True  # a hit on a CPU-only chunk copies it up into the GPU tier

    # liveness
    lease_s: float = 5.0  # a node's directory entries die this long after its last heartbeat
    heartbeat_s: float = 1.0
    pin_ttl_s: float = 30.0  # a reader's pin is released after this even if the reader never unpins

    # client
    lookup_timeout_s: float = 0.5  # a directory lookup slower than this is a miss
    fetch_timeout_s: float = 10.0  # default deadline for a whole fetch
    node_refresh_s: float = 0.5  # how stale a client's view of live nodes may get
    pull_batch_bytes: int = 32 * MiB  # peer pulls are split into batches of about this size, pipelined
    peer_transport: str = "tcp"  # "tcp": KVNodes' DataServers (fast); "ray": Ray's object store only

    def __post_init__(self) -> None:
        for name in ("cpu_bytes", "slot_bytes", "pull_batch_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"KVMeshConfig.{name} must be a positive integer, got {v!r}")
        if isinstance(self.gpu_bytes, bool) or not isinstance(self.gpu_bytes, int) or self.gpu_bytes < 0:
            raise ValueError(f"KVMeshConfig.gpu_bytes must be a non-negative integer, got {self.gpu_bytes!r}")
        if 0 < self.gpu_bytes < self.slot_bytes:
            raise ValueError(f"KVMeshConfig.gpu_bytes ({self.gpu_bytes}) must hold at least one slot "
                             f"of slot_bytes ({self.slot_bytes})")
        if self.cpu_bytes < self.slot_bytes:
            raise ValueError(f"KVMeshConfig.cpu_bytes ({self.cpu_bytes}) must hold at least one slot "
                             f"of slot_bytes ({self.slot_bytes})")
        for name in ("lease_s", "heartbeat_s", "pin_ttl_s", "lookup_timeout_s", "fetch_timeout_s",
                     "node_refresh_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"KVMeshConfig.{name} must be a positive number, got {v!r}")
        if self.heartbeat_s * 2 > self.lease_s:
            raise ValueError(f"KVMeshConfig.heartbeat_s ({self.heartbeat_s}) must be at most half of "
                             f"lease_s ({self.lease_s})")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"KVMeshConfig.redis_url must be a redis://, rediss:// or unix:// URL, "
                             f"got {self.redis_url!r}")
        if self.peer_transport not in ("tcp", "ray"):
            raise ValueError(f"KVMeshConfig.peer_transport must be 'tcp' or 'ray', got {self.peer_transport!r}")
        if not self.key_prefix or "{" in self.key_prefix or "}" in self.key_prefix:
            raise ValueError(f"KVMeshConfig.key_prefix must be non-empty without braces, got {self.key_prefix!r}")

    @property
    def num_slots(self) -> int:
        return self.cpu_bytes // self.slot_bytes

    def replace(self, **changes) -> "KVMeshConfig":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown kvmesh option(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
