"""KV identity: `KVSpec`, everything that makes KV bytes interpretable and reusable.

Two engines may share a chunk only if their specs are equal. The spec's `namespace` is a fixed-width digest of its
canonical encoding; it seeds every chunk hash (see `hashing.py`), so specs that differ in any field can never
produce the same chunk key.

Canonical encoding (written down once, never changed in place; a new layout bumps `SPEC_ENCODING_VERSION`):

    msgpack([b"kvmesh-spec", SPEC_ENCODING_VERSION, model_id, num_layers, num_kv_heads, head_dim, dtype,
             chunk_tokens, tp_rank, tp_size, lora_id or "", layout_version])
    ... followed, only when the spec has a KV cache group or a KV format, by two more elements:
             group:  [index, attention, window, [layer, ...]] or nil
             format: [engine, layout, version] or nil

msgpack packs ints in their smallest form and strings as UTF-8, so the bytes are the same in every process,
machine and Python version. `namespace = BLAKE2b-128(encoding, person=b"kvmesh.spec")`. A spec with neither a group
nor a format encodes exactly as before the two were added (the same namespace, the same chunk hashes).

Non-uniform KV. A model whose layers do not all attend alike (sliding-window layers beside full ones, a recurrent
state) has several KV cache groups; each is its own `KVSpec` with its `KVGroup` (`group_specs`), so its chunks live
under their own namespace and never mix with another group's. A sliding-window group's chunk i still names the
whole prefix up to its end (the same chained hash), but computing from token p on needs only the chunks from
`window_start_chunk(p)`.

KV format. `KVFormat` says how an integration wrote the chunk's bytes: the engine, the block layout or codec it
learned or selected, and the integration's format version (bumped whenever that integration changes how it writes
chunks). Engines that differ in any of them never share a chunk.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

import msgpack

SPEC_ENCODING_VERSION = 1
ATTENTION_KINDS = ("full", "sliding_window", "state")
# Version of the chunk layout [num_layers, 2, chunk_tokens, num_kv_heads, head_dim]; part of the identity.
CHUNK_LAYOUT_VERSION = 1

# torch dtype name -> element size in bytes. Only dtypes whose KV is stored as-is.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


MAX_FIELD = 2**31 - 1  # the largest integer field of a spec (a shape, an index, a version): one that fits int32


def _check_int(name: str, value, minimum: int) -> None:
    """`name` is a KVSpec field, or "Owner.field" for another type's."""
    name = name if "." in name else f"KVSpec.{name}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > MAX_FIELD:
        raise ValueError(f"{name} must be <= {MAX_FIELD}, got {value}")


def _check_str(owner: str, name: str, value) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{owner}.{name} must be a non-empty string, got {value!r}")


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV cache group of a model whose KV is not one uniform stack.

    `index` is the engine's group number (vLLM's `kv_cache_groups[i]`, SGLang's pool); `layers` the model's layer
    indices in it, in order; `attention` how they attend: "full", "sliding_window" (`window` = tokens a query
    sees, itself included, as in the model config's `sliding_window`) or "state" (a recurrent state, e.g. Mamba:
    described here so integrations can name it, but kvmesh stores per-token K/V only, so no spec holds one)."""

    index: int
    attention: str = "full"
    window: int = 0
    layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_int("KVGroup.index", self.index, 0)
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"KVGroup.attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.attention == "sliding_window":
            _check_int("KVGroup.window", self.window, 1)
        elif self.window != 0:
            raise ValueError(f"KVGroup.window is only for a sliding_window group, got {self.window!r}")
        if not isinstance(self.layers, tuple) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in self.layers
        ):
            raise ValueError(f"KVGroup.layers must be a tuple of layer indices, got {self.layers!r}")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError(f"KVGroup.layers holds a layer twice: {self.layers!r}")

    def encode(self) -> list:
        return [self.index, self.attention, self.window, list(self.layers)]


@dataclass(frozen=True, slots=True)
class KVFormat:
    """How an integration wrote a chunk's bytes: `engine` ("vllm", "sglang", "transformers", ...), `layout` (the
    engine's block layout or the codec the integration learned or selected, e.g. vLLM's CPU packing), `version`
    (the integration's format version, bumped when it changes how it writes chunks)."""

    engine: str
    layout: str
    version: int

    def __post_init__(self) -> None:
        _check_str("KVFormat", "engine", self.engine)
        _check_str("KVFormat", "layout", self.layout)
        _check_int("KVFormat.version", self.version, 1)

    def encode(self) -> list:
        return [self.engine, self.layout, self.version]


@dataclass(frozen=True, slots=True)
class KVSpec:
    """What a chunk of KV is. Frozen: equality of specs is the sharing rule.

    `num_kv_heads` is the number of KV heads held by this tensor-parallel shard (`tp_rank` of `tp_size`).
    """

    model_id: str  # model name plus revision or a weights fingerprint
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    chunk_tokens: int = 256
    tp_rank: int = 0
    tp_size: int = 1
    lora_id: str | None = None
    layout_version: int = CHUNK_LAYOUT_VERSION
    group: KVGroup | None = None  # the KV cache group these chunks belong to; None: the model's one uniform stack
    kv_format: KVFormat | None = None  # how the integration wrote the bytes; None: kvmesh's engine-neutral layout
    # Derived once at construction; not part of equality (it is a function of the fields above).
    namespace: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"KVSpec.model_id must be a non-empty string, got {self.model_id!r}")
        _check_int("num_layers", self.num_layers, 1)
        _check_int("num_kv_heads", self.num_kv_heads, 1)
        _check_int("head_dim", self.head_dim, 1)
        _check_int("chunk_tokens", self.chunk_tokens, 1)
        _check_int("tp_size", self.tp_size, 1)
        _check_int("tp_rank", self.tp_rank, 0)
        _check_int("layout_version", self.layout_version, 1)
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"KVSpec.tp_rank must be < tp_size ({self.tp_size}), got {self.tp_rank}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_SIZES:
            raise ValueError(f"KVSpec.dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")
        if self.lora_id is not None and (not isinstance(self.lora_id, str) or not self.lora_id):
            raise ValueError(f"KVSpec.lora_id must be None or a non-empty string, got {self.lora_id!r}")
        if self.group is not None:
            if not isinstance(self.group, KVGroup):
                raise ValueError(f"KVSpec.group must be a KVGroup or None, got {type(self.group).__name__}")
            if self.group.attention == "state":
                raise ValueError(
                    "KVSpec.group: a state group (recurrent state, e.g. Mamba) has no per-token K/V for kvmesh to store"
                )
            if self.group.layers and len(self.group.layers) != self.num_layers:
                raise ValueError(
                    f"KVSpec.group lists {len(self.group.layers)} layers, but num_layers is {self.num_layers}"
                )
        if self.kv_format is not None and not isinstance(self.kv_format, KVFormat):
            raise ValueError(f"KVSpec.kv_format must be a KVFormat or None, got {type(self.kv_format).__name__}")
        if self.layout_version != CHUNK_LAYOUT_VERSION:
            raise ValueError(
                f"KVSpec.layout_version {self.layout_version} is not supported "
                f"(this kvmesh writes layout {CHUNK_LAYOUT_VERSION})"
            )
        object.__setattr__(
            self, "namespace", hashlib.blake2b(self.canonical_bytes(), digest_size=16, person=b"kvmesh.spec").digest()
        )

    def canonical_bytes(self) -> bytes:
        fields = [
            b"kvmesh-spec",
            SPEC_ENCODING_VERSION,
            self.model_id,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.chunk_tokens,
            self.tp_rank,
            self.tp_size,
            self.lora_id or "",
            self.layout_version,
        ]
        if self.group is not None or self.kv_format is not None:  # else: the encoding of a plain spec, unchanged
            fields += [self.group.encode() if self.group else None, self.kv_format.encode() if self.kv_format else None]
        return msgpack.packb(fields, use_bin_type=True)

    @classmethod
    def from_canonical_bytes(cls, data: bytes) -> KVSpec:
        o = msgpack.unpackb(data, raw=False)
        if not isinstance(o, list) or len(o) not in (12, 14) or o[0] != b"kvmesh-spec" or o[1] != SPEC_ENCODING_VERSION:
            raise ValueError("not a kvmesh spec encoding")
        group = kv_format = None
        if len(o) == 14:
            if o[12] is not None:
                index, attention, window, layers = o[12]
                group = KVGroup(index, attention, window, tuple(layers))
            if o[13] is not None:
                kv_format = KVFormat(*o[13])
        return cls(o[2], o[3], o[4], o[5], o[6], o[7], o[8], o[9], o[10] or None, o[11], group, kv_format)

    @property
    def window(self) -> int:
        """Tokens a query of this group attends to (itself included); 0 for full attention."""
        return self.group.window if self.group is not None else 0

    def window_start_chunk(self, boundary: int) -> int:
        """The first chunk whose KV is needed to compute tokens from `boundary` on: 0 for full attention; for a
        sliding window of W tokens, the chunk holding token `boundary - W + 1` (the oldest one the query at
        `boundary` attends to)."""
        if not self.window:
            return 0
        return max(0, boundary - self.window + 1) // self.chunk_tokens

    @property
    def element_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def kv_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of KV for `num_tokens` tokens: [num_layers, 2 (K, V), num_tokens, num_kv_heads, head_dim]."""
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        return self.kv_shape(self.chunk_tokens)

    @property
    def token_bytes(self) -> int:
        """Bytes of KV per token (all layers, K and V)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def chunk_bytes(self) -> int:
        return self.token_bytes * self.chunk_tokens


def group_specs(base: KVSpec, groups) -> tuple[KVSpec, ...]:
    """One spec per KV cache group of a model: `base` (model, dtype, heads, head dim, chunk tokens, TP, LoRA,
    format) with each group's layer count and `KVGroup`. A model with one full-attention group gets `base` itself
    (group None): its chunks are those of a uniform model. Raises ValueError for a state group, a layer in two
    groups, or two groups with one index."""
    groups = tuple(groups)
    if not groups:
        raise ValueError("a model has at least one KV cache group")
    if len({g.index for g in groups}) != len(groups):
        raise ValueError("KV cache groups must have distinct indices")
    seen: set[int] = set()
    for g in groups:
        if seen & set(g.layers):
            raise ValueError(f"layer(s) {sorted(seen & set(g.layers))} are in more than one KV cache group")
        seen |= set(g.layers)
    if len(groups) == 1 and groups[0].attention == "full":
        return (base if base.group is None else replace(base, group=None),)
    return tuple(replace(base, num_layers=len(g.layers) or base.num_layers, group=g) for g in groups)
