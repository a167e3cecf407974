"""KV identity: `KVSpec`, everything that makes KV bytes interpretable and reusable.

Two engines may share a chunk only if their specs are equal. The spec's `namespace` is a fixed-width digest of its
canonical encoding; it seeds every chunk hash (see `hashing.py`), so specs that differ in any field can never
produce the same chunk key.

Canonical encoding (written down once, never changed in place; a new layout bumps `SPEC_ENCODING_VERSION`):

    msgpack([b"kvmesh-spec", SPEC_ENCODING_VERSION, model_id, num_layers, num_kv_heads, head_dim, dtype,
             chunk_tokens, tp_rank, tp_size, lora_id or "", layout_version])

msgpack packs ints in their smallest form and strings as UTF-8, so the bytes are the same in every process,
machine and Python version. `namespace = BLAKE2b-128(encoding, person=b"kvmesh.spec")`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import msgpack

SPEC_ENCODING_VERSION = 1
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


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"KVSpec.{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"KVSpec.{name} must be >= {minimum}, got {value}")


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
        if self.layout_version != CHUNK_LAYOUT_VERSION:
            raise ValueError(f"KVSpec.layout_version {self.layout_version} is not supported "
                             f"(this kvmesh writes layout {CHUNK_LAYOUT_VERSION})")
        object.__setattr__(self, "namespace", hashlib.blake2b(self.canonical_bytes(), digest_size=16,
                                                              person=b"kvmesh.spec").digest())

    def canonical_bytes(self) -> bytes:
        return msgpack.packb([b"kvmesh-spec", SPEC_ENCODING_VERSION, self.model_id, self.num_layers,
                              self.num_kv_heads, self.head_dim, self.dtype, self.chunk_tokens, self.tp_rank,
                              self.tp_size, self.lora_id or "", self.layout_version], use_bin_type=True)

    @classmethod
    def from_canonical_bytes(cls, data: bytes) -> "KVSpec":
        o = msgpack.unpackb(data, raw=False)
        if not isinstance(o, list) or len(o) < 12 or o[0] != b"kvmesh-spec" or o[1] != SPEC_ENCODING_VERSION:
            raise ValueError("not a kvmesh spec encoding")
        return cls(o[2], o[3], o[4], o[5], o[6], o[7], o[8], o[9], o[10] or None, o[11])

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
