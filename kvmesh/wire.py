"""Messages between workers and KVNodes, and the node record kept in the directory.

Every message is a msgpack array whose first element is its version. Fields are only ever appended; a decoder
accepts longer arrays of its version and ignores the extra fields. Decoders check every field they use and raise
`WireError` (a `ValueError`) on anything malformed, so a bad message can never crash a KVNode. Bulk chunk bytes
travel beside the header as one contiguous uint8 buffer, chunks back to back in header order; never pickled.

    NodeInfo      [1, node_id, actor_name, slab_path, slab_bytes, slot_bytes, data_addr]
    PinRequest    [1, [key, ...], requester node id, gpu, hold_ms]
                  gpu: the reader can read the node's GPU tier device to device (CUDA IPC); hold_ms: how long the
                  reader may still read the slots (its fetch's deadline): the pin lasts that, then the node's pin TTL
    PinReply      [1, pin_id, [[slot, nbytes, checksum], ...], slab_path, [[gpu slot, nbytes, device sum], ...],
                  [device sum or nil, ...]]
                  the leading chunks, pinned: first those in the GPU tier (asked with gpu: device sums as u64),
                  then the rest in the CPU slab; the last field, one per slab chunk, is its device checksum
                  (tiers.devsum, as u64) where the node has recorded one, else nil (a reply without it: none known)
    PullRequest   [1, [key, ...], requester node id]
    PullReply     [1, [[nbytes, checksum], ...]]  + buffer              leading chunks found and verified
    StoreRequest  [1, [[group, key, nbytes, checksum], ...]] + buffer
    PullThrough   [1, [key, ...], group, nbytes, holder node id, transport, deadline_ms, holder incarnation]
                  a reader asks its own node to bring the chunks from the holder (replied with a PinReply)
    GpuReserve    [1, [[group, key, nbytes], ...], requester node id]
                  a same-node writer that maps the node's GPU pools asks for GPU-tier slots for new chunks
    GpuReserved   [1, reservation_id, [slot or nil, ...], slab_path]   one per chunk asked for; nil: none (held
                  already, too big, or no room: the writer stores it through the host path); slab_path names the
                  node incarnation whose pools the slots index
    GpuCommit     [1, reservation_id, [device sum (u64) or nil, ...]]  one per chunk asked for (nil: not written,
                  the slot is released); replied with the number of chunks that became readable
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import msgpack

from kvmesh.hashing import HASH_BYTES

VERSION = 1
MAX_KEYS = 1 << 16  # chunks per message; a 16 M-token prompt at 256 tokens per chunk


class WireError(ValueError):
    """A malformed message."""


def _unpack(data, what: str) -> list:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"{what}: expected bytes, got {type(data).__name__}")
    try:
        obj = msgpack.unpackb(
            data, raw=False, strict_map_key=True, max_bin_len=1 << 24, max_str_len=1 << 16, max_array_len=MAX_KEYS * 4
        )
    except Exception as e:
        raise WireError(f"{what}: not msgpack ({e})") from None
    if not isinstance(obj, list) or not obj:
        raise WireError(f"{what}: expected a non-empty array")
    if obj[0] != VERSION:
        raise WireError(f"{what}: unsupported version {obj[0]!r}")
    return obj


def _field(obj: list, i: int, typ, what: str):
    if len(obj) <= i:
        raise WireError(f"{what}: missing field {i}")
    v = obj[i]
    if typ is int:
        ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
    else:
        ok = isinstance(v, typ)
    if not ok:
        raise WireError(f"{what}: field {i} must be {typ.__name__}, got {type(v).__name__}")
    return v


def _keys(v, what: str) -> list[bytes]:
    if not isinstance(v, list) or len(v) > MAX_KEYS:
        raise WireError(f"{what}: keys must be a list of at most {MAX_KEYS}")
    for k in v:
        if not isinstance(k, bytes) or len(k) != HASH_BYTES:
            raise WireError(f"{what}: every key must be {HASH_BYTES} bytes")
    return v


def _rows(v, width: int, what: str) -> list[list]:
    if not isinstance(v, list) or len(v) > MAX_KEYS:
        raise WireError(f"{what}: rows must be a list of at most {MAX_KEYS}")
    for r in v:
        if not isinstance(r, list) or len(r) < width:
            raise WireError(f"{what}: every row must have {width} fields")
    return v


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node_id: str
    actor_name: str
    slab_path: str
    slab_bytes: int
    slot_bytes: int
    data_addr: str = ""  # host:port of the node's DataServer; empty when it serves pulls through Ray only
    incarnation: int = 0  # not on the wire: the directory keeps it beside the record

    def pack(self) -> bytes:
        return msgpack.packb(
            [VERSION, self.node_id, self.actor_name, self.slab_path, self.slab_bytes, self.slot_bytes, self.data_addr],
            use_bin_type=True,
        )

    @classmethod
    def unpack(cls, data, incarnation: int = 0) -> NodeInfo:
        o = _unpack(data, "NodeInfo")
        return cls(
            _field(o, 1, str, "NodeInfo"),
            _field(o, 2, str, "NodeInfo"),
            _field(o, 3, str, "NodeInfo"),
            _field(o, 4, int, "NodeInfo"),
            _field(o, 5, int, "NodeInfo"),
            _field(o, 6, str, "NodeInfo"),
            incarnation,
        )

    def with_incarnation(self, incarnation: int) -> NodeInfo:
        return replace(self, incarnation=incarnation)


def pack_keys(keys: list[bytes], requester: str = "", gpu: bool = False, hold_ms: int = 0) -> bytes:
    """PinRequest and PullRequest (the requester's node id lets the holder account its traffic)."""
    return msgpack.packb([VERSION, list(keys), requester, bool(gpu), int(hold_ms)], use_bin_type=True)


def unpack_pin_request(data) -> tuple[list[bytes], str, bool, int]:
    """(keys, requester, gpu, hold_ms) of a PinRequest; hold_ms is clamped to [0, MAX_DEADLINE_MS]."""
    keys, requester = unpack_request(data, "PinRequest")
    o = _unpack(data, "PinRequest")
    hold = o[4] if len(o) > 4 and isinstance(o[4], int) and not isinstance(o[4], bool) else 0
    return keys, requester, len(o) > 3 and o[3] is True, max(0, min(MAX_DEADLINE_MS, hold))


def unpack_keys(data, what: str = "request") -> list[bytes]:
    return unpack_request(data, what)[0]


def unpack_request(data, what: str = "request") -> tuple[list[bytes], str]:
    o = _unpack(data, what)
    requester = o[2] if len(o) > 2 and isinstance(o[2], str) else ""
    return _keys(_field(o, 1, list, what), what), requester[:128]


@dataclass(frozen=True, slots=True)
class PinnedChunk:
    slot: int
    nbytes: int
    checksum: int
    devsum: int | None = None  # a slab chunk's device checksum (tiers.devsum), where its node has recorded one


U64 = (1 << 64) - 1


def pack_pin_reply(pin_id: int, chunks: list[PinnedChunk], slab_path: str, gpu: Sequence[PinnedChunk] = ()) -> bytes:
    return msgpack.packb(
        [
            VERSION,
            pin_id,
            [[c.slot, c.nbytes, c.checksum] for c in chunks],
            slab_path,
            [[c.slot, c.nbytes, c.checksum & U64] for c in gpu],
            [None if c.devsum is None else c.devsum & U64 for c in chunks],
        ]
    )


def _pinned_rows(v, what: str) -> list[list]:
    rows = _rows(v, 3, what)
    for r in rows:
        if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= U64 for x in r[:3]):
            raise WireError(f"{what}: slots, sizes and checksums must be non-negative 64-bit ints")
    return rows


def unpack_pin_reply(data) -> tuple[int, list[PinnedChunk], str, list[PinnedChunk]]:
    """(pin id, pinned slab chunks, path of the slab the slots index, pinned GPU-tier chunks)."""
    o = _unpack(data, "PinReply")
    rows = _pinned_rows(_field(o, 2, list, "PinReply"), "PinReply")
    gpu = _pinned_rows(o[4], "PinReply") if len(o) > 4 and isinstance(o[4], list) else []
    signed = [_int64(r[2]) for r in gpu]  # device sums are int64
    sums: list[int | None] = [None] * len(rows)
    if len(o) > 5 and o[5] is not None:  # (an older node sends none: its slab chunks are checked with xxh3)
        v = o[5]
        if (
            not isinstance(v, list)
            or len(v) != len(rows)
            or not all(x is None or (isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= U64) for x in v)
        ):
            raise WireError("PinReply: device sums must be one u64 or nil per slab chunk")
        sums = [None if x is None else _int64(x) for x in v]
    return (
        _field(o, 1, int, "PinReply"),
        [PinnedChunk(r[0], r[1], r[2], d) for r, d in zip(rows, sums)],
        _field(o, 3, str, "PinReply"),
        [PinnedChunk(r[0], r[1], c) for r, c in zip(gpu, signed)],
    )


def _int64(x: int) -> int:
    """A u64 on the wire back to the int64 it stands for."""
    return x - (1 << 64) if x >= 1 << 63 else x


def pack_chunk_header(rows: list[tuple[int, int]]) -> bytes:
    """PullReply header: (nbytes, checksum) per chunk."""
    return msgpack.packb([VERSION, [list(r) for r in rows]])


def unpack_chunk_header(data) -> list[tuple[int, int]]:
    o = _unpack(data, "PullReply")
    rows = _rows(_field(o, 1, list, "PullReply"), 2, "PullReply")
    out = []
    for r in rows:
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in r[:2]):
            raise WireError("PullReply: sizes and checksums must be non-negative ints")
        out.append((r[0], r[1]))
    return out


@dataclass(frozen=True, slots=True)
class StoreItem:
    group: bytes
    key: bytes
    nbytes: int
    checksum: int


def pack_store(items: list[StoreItem]) -> bytes:
    return msgpack.packb([VERSION, [[i.group, i.key, i.nbytes, i.checksum] for i in items]], use_bin_type=True)


def unpack_store(data) -> list[StoreItem]:
    o = _unpack(data, "StoreRequest")
    rows = _rows(_field(o, 1, list, "StoreRequest"), 4, "StoreRequest")
    out = []
    for r in rows:
        g, k, n, c = r[:4]
        if not (isinstance(g, bytes) and len(g) == HASH_BYTES and isinstance(k, bytes) and len(k) == HASH_BYTES):
            raise WireError("StoreRequest: group and key must be 16 bytes")
        if not (
            isinstance(n, int)
            and not isinstance(n, bool)
            and n > 0
            and isinstance(c, int)
            and not isinstance(c, bool)
            and c >= 0
        ):
            raise WireError("StoreRequest: nbytes must be a positive int and checksum a non-negative int")
        out.append(StoreItem(g, k, n, c))
    return out


MAX_DEADLINE_MS = 600_000
PEER_TRANSPORTS = ("tcp", "ray")


@dataclass(frozen=True, slots=True)
class PullThrough:
    """A reader's request to its own KVNode: pin `keys` here, pulling from `holder` those not here yet. The node
    finds the holder's address in the directory itself: a reader names nodes, never addresses to connect to."""

    keys: list[bytes]
    group: bytes  # the directory group the chunks are registered in once they land
    nbytes: int  # bytes of each chunk (the reader's spec): a holder's chunk of another size is refused
    holder: str  # node id of the holder to pull from
    transport: str  # "tcp": the holder's DataServer; "ray": its actor, through Ray's object store
    deadline_ms: int  # how long the node may spend on it
    incarnation: int = 0  # the holder's incarnation the reader's lookup named (a node table that knows another
    # one is out of date: the node reads it again before it connects)


def pack_pull_through(p: PullThrough) -> bytes:
    return msgpack.packb(
        [VERSION, list(p.keys), p.group, p.nbytes, p.holder, p.transport, p.deadline_ms, p.incarnation],
        use_bin_type=True,
    )


def unpack_pull_through(data) -> PullThrough:
    what = "PullThrough"
    o = _unpack(data, what)
    keys = _keys(_field(o, 1, list, what), what)
    group = _field(o, 2, bytes, what)
    if len(group) != HASH_BYTES:
        raise WireError(f"{what}: group must be {HASH_BYTES} bytes")
    nbytes = _field(o, 3, int, what)
    holder, transport = _field(o, 4, str, what), _field(o, 5, str, what)
    deadline_ms = _field(o, 6, int, what)
    if nbytes == 0 or not 0 < len(holder) <= 128 or transport not in PEER_TRANSPORTS or deadline_ms > MAX_DEADLINE_MS:
        raise WireError(
            f"{what}: nbytes must be positive, holder a node id, transport one of {PEER_TRANSPORTS} "
            f"and deadline_ms at most {MAX_DEADLINE_MS}"
        )
    inc = o[7] if len(o) > 7 and isinstance(o[7], int) and not isinstance(o[7], bool) and o[7] >= 0 else 0
    return PullThrough(keys, group, nbytes, holder, transport, deadline_ms, inc)


@dataclass(frozen=True, slots=True)
class GpuReserved:
    """GPU-tier slots reserved for a same-node writer until `commit` (or the node's TTL releases them)."""

    reservation_id: int
    slots: list[int | None]  # per chunk asked for: its slot, or None (the writer takes the host path for it)
    slab_path: str  # the incarnation the slots belong to (the writer's pool exports must name the same)


def pack_gpu_reserve(items: Sequence[StoreItem], requester: str = "") -> bytes:
    """GpuReserve: (group, key, nbytes) of each item; its checksum is not sent (the writer's device sum is)."""
    return msgpack.packb([VERSION, [[i.group, i.key, i.nbytes] for i in items], requester], use_bin_type=True)


def unpack_gpu_reserve(data) -> tuple[list[StoreItem], str]:
    what = "GpuReserve"
    o = _unpack(data, what)
    out = []
    for r in _rows(_field(o, 1, list, what), 3, what):
        g, k, n = r[:3]
        if not (
            isinstance(g, bytes)
            and len(g) == HASH_BYTES
            and isinstance(k, bytes)
            and len(k) == HASH_BYTES
            and isinstance(n, int)
            and not isinstance(n, bool)
            and n > 0
        ):
            raise WireError(f"{what}: group and key must be {HASH_BYTES} bytes and nbytes a positive int")
        out.append(StoreItem(g, k, n, 0))
    requester = o[2] if len(o) > 2 and isinstance(o[2], str) else ""
    return out, requester[:128]


def pack_gpu_reserved(r: GpuReserved) -> bytes:
    return msgpack.packb([VERSION, r.reservation_id, list(r.slots), r.slab_path], use_bin_type=True)


def unpack_gpu_reserved(data) -> GpuReserved:
    what = "GpuReserved"
    o = _unpack(data, what)
    slots = _field(o, 2, list, what)
    if len(slots) > MAX_KEYS or not all(
        s is None or (isinstance(s, int) and not isinstance(s, bool) and s >= 0) for s in slots
    ):
        raise WireError(f"{what}: slots must be non-negative ints or nil")
    return GpuReserved(_field(o, 1, int, what), slots, _field(o, 3, str, what))


def pack_gpu_commit(reservation_id: int, sums: Sequence[int | None]) -> bytes:
    return msgpack.packb([VERSION, reservation_id, [None if s is None else s & U64 for s in sums]])


def unpack_gpu_commit(data) -> tuple[int, list[int | None]]:
    what = "GpuCommit"
    o = _unpack(data, what)
    sums = _field(o, 2, list, what)
    if len(sums) > MAX_KEYS or not all(
        x is None or (isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= U64) for x in sums
    ):
        raise WireError(f"{what}: device sums must be u64 or nil")
    return _field(o, 1, int, what), [None if x is None else _int64(x) for x in sums]
