"""`KVMeshConfig`: the one configuration object. Built at the root (`kvmesh.start`, `kvmesh.connect`, the CLI) and
handed down; everything below takes plain arguments from it.

`KVMeshConfig.load(path)` reads a YAML file of field names, then `KVMESH_<FIELD>` environment variables (which win),
then explicit overrides. Sizes may be written with units ("4GiB", "512MiB"), booleans as true/false/yes/no/1/0.
Unknown keys, in the file or as KVMESH_ variables, are errors that name the key and where it came from.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping
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
    disk_dir: str = ""  # local directory of the disk tier (a subdirectory per node); "" = no disk tier
    disk_bytes: int = 0  # disk tier budget per node
    write_policy: str = "write_back"  # "write_back": to disk on CPU eviction; "write_through": every chunk
    disk_direct_io: bool = True  # O_DIRECT where the file system allows it
    io_threads: int = 2  # disk I/O threads per node

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
    # peer chunks come through this node's KVNode, which pulls each chunk once however many of its readers want it
    # at the same time, and keeps it (registered), so later readers on this node hit locally
    coalesce_pulls: bool = False

    # hot-prefix replication (pull-throughs, i.e. coalesce_pulls): a node keeps (and registers) the chunks it pulled
    # of a prompt group once at least replicate_min_readers distinct nodes pulled that group within
    # replicate_window_s (itself included); below that, pulled chunks serve their readers and are dropped.
    # 1 = every pull-through keeps what it pulls
    replicate_min_readers: int = 1
    replicate_window_s: float = 60.0
    replicate_max_bytes: int = 0  # bound on the bytes of replicas one node keeps; 0 = only its tiers bound them

    # cluster eviction: a chunk leaving a node's last tier that other nodes read within last_copy_window_s, and of
    # which no other copy is known, is handed to the live peer with the most room instead of dropped, when the
    # recompute it would cost (at recompute_bytes_per_s of KV made by prefill) outweighs the move; at most
    # handoff_max_bytes wait for a handoff at once. last_copy_window_s 0 = off
    last_copy_window_s: float = 60.0
    recompute_bytes_per_s: int = 256 * MiB
    handoff_max_bytes: int = 64 * MiB

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # (annotations are strings here: `from __future__ import annotations`)
            v = getattr(self, f.name)
            if f.type == "str" and not isinstance(v, str):
                raise ValueError(f"KVMeshConfig.{f.name} must be a string, got {v!r}")
            if f.type == "bool" and not isinstance(v, bool):
                raise ValueError(f"KVMeshConfig.{f.name} must be true or false, got {v!r}")
        for name in ("cpu_bytes", "slot_bytes", "pull_batch_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"KVMeshConfig.{name} must be a positive integer, got {v!r}")
        if isinstance(self.gpu_bytes, bool) or not isinstance(self.gpu_bytes, int) or self.gpu_bytes < 0:
            raise ValueError(f"KVMeshConfig.gpu_bytes must be a non-negative integer, got {self.gpu_bytes!r}")
        if 0 < self.gpu_bytes < self.slot_bytes:
            raise ValueError(
                f"KVMeshConfig.gpu_bytes ({self.gpu_bytes}) must hold at least one slot "
                f"of slot_bytes ({self.slot_bytes})"
            )
        if isinstance(self.disk_bytes, bool) or not isinstance(self.disk_bytes, int) or self.disk_bytes < 0:
            raise ValueError(f"KVMeshConfig.disk_bytes must be a non-negative integer, got {self.disk_bytes!r}")
        if self.disk_bytes and not self.disk_dir:
            raise ValueError("KVMeshConfig.disk_bytes needs a disk_dir")
        if 0 < self.disk_bytes < self.slot_bytes:
            raise ValueError(f"KVMeshConfig.disk_bytes ({self.disk_bytes}) must hold at least one slot")
        if self.write_policy not in ("write_back", "write_through"):
            raise ValueError(
                f"KVMeshConfig.write_policy must be 'write_back' or 'write_through', got {self.write_policy!r}"
            )
        if isinstance(self.io_threads, bool) or not isinstance(self.io_threads, int) or self.io_threads < 1:
            raise ValueError(f"KVMeshConfig.io_threads must be a positive integer, got {self.io_threads!r}")
        if (
            isinstance(self.replicate_min_readers, bool)
            or not isinstance(self.replicate_min_readers, int)
            or self.replicate_min_readers < 1
        ):
            raise ValueError(
                f"KVMeshConfig.replicate_min_readers must be a positive integer, got {self.replicate_min_readers!r}"
            )
        if (
            isinstance(self.replicate_max_bytes, bool)
            or not isinstance(self.replicate_max_bytes, int)
            or self.replicate_max_bytes < 0
        ):
            raise ValueError(
                f"KVMeshConfig.replicate_max_bytes must be a non-negative integer, got {self.replicate_max_bytes!r}"
            )
        if (
            isinstance(self.recompute_bytes_per_s, bool)
            or not isinstance(self.recompute_bytes_per_s, int)
            or self.recompute_bytes_per_s <= 0
        ):
            raise ValueError(
                f"KVMeshConfig.recompute_bytes_per_s must be a positive integer, got {self.recompute_bytes_per_s!r}"
            )
        if (
            isinstance(self.handoff_max_bytes, bool)
            or not isinstance(self.handoff_max_bytes, int)
            or self.handoff_max_bytes < 0
        ):
            raise ValueError(
                f"KVMeshConfig.handoff_max_bytes must be a non-negative integer, got {self.handoff_max_bytes!r}"
            )
        v = self.last_copy_window_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_DURATION_S:
            raise ValueError(
                f"KVMeshConfig.last_copy_window_s must be a number of seconds in [0, {MAX_DURATION_S:g}], got {v!r}"
            )
        if self.cpu_bytes < self.slot_bytes:
            raise ValueError(
                f"KVMeshConfig.cpu_bytes ({self.cpu_bytes}) must hold at least one slot "
                f"of slot_bytes ({self.slot_bytes})"
            )
        for name in (
            "lease_s",
            "heartbeat_s",
            "pin_ttl_s",
            "lookup_timeout_s",
            "fetch_timeout_s",
            "node_refresh_s",
            "replicate_window_s",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= MAX_DURATION_S:
                raise ValueError(
                    f"KVMeshConfig.{name} must be a number of seconds in (0, {MAX_DURATION_S:g}], got {v!r}"
                )  # (nan and inf too: no wait, socket timeout or lease in milliseconds takes them)
        if self.heartbeat_s * 2 > self.lease_s:
            raise ValueError(
                f"KVMeshConfig.heartbeat_s ({self.heartbeat_s}) must be at most half of lease_s ({self.lease_s})"
            )
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"KVMeshConfig.redis_url must be a redis://, rediss:// or unix:// URL, got {self.redis_url!r}"
            )
        if self.peer_transport not in ("tcp", "ray"):
            raise ValueError(f"KVMeshConfig.peer_transport must be 'tcp' or 'ray', got {self.peer_transport!r}")
        if not self.key_prefix or "{" in self.key_prefix or "}" in self.key_prefix:
            raise ValueError(f"KVMeshConfig.key_prefix must be non-empty without braces, got {self.key_prefix!r}")

    @property
    def num_slots(self) -> int:
        return self.cpu_bytes // self.slot_bytes

    def replace(self, **changes) -> KVMeshConfig:
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown kvmesh option(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, options: Mapping) -> KVMeshConfig:
        """A config another process sent (`to_dict`): options this release does not know (a node of a later
        release has more) are left out, with their names logged once."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown and tuple(unknown) not in _dropped:
            _dropped.add(tuple(unknown))
            log = logging.getLogger("kvmesh")
            log.warning("kvmesh: options of a later release left out here: %s", ", ".join(unknown))
        return cls(**{k: v for k, v in options.items() if k in known})

    @classmethod
    def load(cls, path: str | None = None, env: Mapping[str, str] | None = None, **overrides) -> KVMeshConfig:
        env = os.environ if env is None else env
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict = {}
        path = path or env.get("KVMESH_CONFIG") or None
        if path:
            import yaml

            try:
                with open(path) as f:
                    data = yaml.safe_load(f) or {}
            except OSError as e:
                raise ValueError(f"kvmesh config {path}: {e.strerror}") from None
            except yaml.YAMLError as e:
                raise ValueError(f"kvmesh config {path} is not valid YAML: {e}") from None
            if not isinstance(data, dict):
                raise ValueError(f"kvmesh config {path} must be a mapping of option: value")
            for k, v in data.items():
                if k not in fields:
                    raise ValueError(f"kvmesh config {path}: unknown option {k!r} (known: {', '.join(sorted(fields))})")
                if v is None:  # `option:` with nothing after it (YAML's null), not the string "None"
                    raise ValueError(f"kvmesh config {path}: option {k!r} has no value (leave it out for its default)")
                values[k] = _convert(k, v, fields[k].type, f"{path}: {k}")
        for name, raw in env.items():
            if not name.startswith("KVMESH_") or name in _NOT_OPTIONS:
                continue
            k = name[len("KVMESH_") :].lower()
            if k not in fields:
                raise ValueError(
                    f"environment variable {name} names no kvmesh option "
                    f"(known: {', '.join('KVMESH_' + f.upper() for f in sorted(fields))})"
                )
            values[k] = _convert(k, raw, fields[k].type, name)
        values.update(overrides)
        try:
            return cls(**values)
        except TypeError as e:
            raise ValueError(str(e)) from None


MAX_DURATION_S = 86400.0  # a duration option longer than a day is a mistake (and waits overflow near 1e10 s)
_dropped: set[tuple[str, ...]] = set()  # unknown option names already logged by from_dict

# kvmesh's own environment variables that are not options (so that KVMESH_* typos are still caught)
_NOT_OPTIONS = {
    "KVMESH_CONFIG",
    "KVMESH_REDIS_SERVER",
    "KVMESH_REDIS_TLS_SERVER",
    "KVMESH_REDIS_CA_CERTS",
    "KVMESH_COMMIT",
    "KVMESH_STATE_DIR",
    "KVMESH_DEBUG",
    "KVMESH_RAY_NODE_ID",
}
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_size(text) -> int:
    """'4GiB' -> 4294967296; ints pass through."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 4GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _convert(name: str, value, typ, where: str):
    # `typ`: a dataclass field's type, which `from __future__ import annotations` keeps as its string. A YAML value
    # of another type is refused, not coerced: `io_threads: 2.5` is no thread count, `lease_s: true` no duration
    # and `key_prefix: [a]` no prefix (they read as 2, 1.0 and "['a']")
    if isinstance(value, (list, dict)) or (isinstance(value, bool) and typ != "bool"):
        raise ValueError(f"{where}: not a{'n' if typ == 'int' else ''} {typ}: {value!r}")
    if typ == "int" and isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{where}: not an integer: {value!r}")
    try:
        if typ == "int":
            return parse_size(value) if name.endswith(("_bytes", "_bytes_per_s")) else int(value)
        if typ == "float":
            return float(value)
        if typ == "bool":
            if isinstance(value, bool):
                return value
            v = str(value).strip().lower()
            if v in ("1", "true", "yes", "on"):
                return True
            if v in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {value!r}")
        return str(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def redact_url(url: str) -> str:
    """`url` with its password (if any, in `user:password@` or redis-py's `?password=`) replaced by `***`: for
    pages, logs and messages."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # (an unreadable URL might hide a password anywhere)
        return "<unreadable url>"
    query = parse_qsl(parts.query, keep_blank_values=True)
    if parts.password is None and not any(k == "password" for k, _ in query):
        return url
    if any(k == "password" for k, _ in query):
        parts = parts._replace(query=urlencode([(k, "***" if k == "password" else v) for k, v in query], safe="*/"))
    if parts.password is not None:
        user = parts.username or ""
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        parts = parts._replace(netloc=f"{user}:***@{host}" + (f":{port}" if port else ""))
    return urlunsplit(parts)
