"""Argument checks of the client's public calls, in one place. Each raises `TypeError`/`ValueError` naming the
argument: a bad argument is the caller's mistake, said at once, never a miss or a truncated fetch later."""

from __future__ import annotations

import numpy as np
import torch

from kvmesh.hashing import HASH_BYTES
from kvmesh.match import Match
from kvmesh.spec import KVSpec

MAX_DEADLINE_S = 86400.0  # a fetch deadline longer than a day is a mistake (threading waits overflow near 1e10 s)


def flag(name: str, value) -> None:
    """A flag argument is True or False: a string such as "no" is truthy, and would turn the option on."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def non_negative_int(name: str, value, what: str = "") -> None:
    """An int >= 0 (numpy integers too; a bool is no count). `what`: the unit, said in the message."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative int{what}, got {value!r}")


def seconds(name: str, value) -> None:
    """A wait in seconds, >= 0 (nan is refused: no wait takes it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")


def deadline(value) -> None:
    """A fetch's `deadline_s`: None (the config's), or seconds in (0, MAX_DEADLINE_S]."""
    if value is not None and (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value <= MAX_DEADLINE_S  # (nan and inf too: no wait takes them)
    ):
        raise ValueError(f"deadline_s must be a number of seconds in (0, {MAX_DEADLINE_S:g}], got {value!r}")


def device(value) -> torch.device:
    """`value` as a torch.device: the CPU, or a CUDA device that this process can use."""
    try:
        d = torch.device(value)
    except (RuntimeError, TypeError, UnicodeError):  # torch's words for a bad name or type (a name given as bytes
        # that are not UTF-8: a bare UnicodeDecodeError that named nothing)
        raise ValueError(f"device must be 'cpu', a CUDA device or a torch.device, got {value!r}") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device is {value!r}, but CUDA is not available in this process")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise ValueError(f"device is {value!r}, but this process sees {torch.cuda.device_count()} CUDA device(s)")
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be the CPU or a CUDA device, got {value!r}")
    return d


def match(spec: KVSpec, value) -> None:
    if not isinstance(value, Match):
        raise TypeError(f"match must be a kvmesh Match from lookup(), got {type(value).__name__}")
    if value.namespace != spec.namespace or value.chunk_tokens != spec.chunk_tokens:
        raise ValueError("match was made for a different KVSpec than this client's")


def out(spec: KVSpec, value, num_tokens: int) -> None:
    """A fetch's `out=`: contiguous, on the CPU, of the spec's dtype and shape, with room for `num_tokens`."""
    s = spec
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype != s.torch_dtype or value.device.type != "cpu" or not value.is_contiguous():
        raise ValueError(f"out must be a contiguous CPU tensor of dtype {s.dtype}")
    if (
        value.dim() != 5
        or value.shape[0] != s.num_layers
        or value.shape[1] != 2
        or value.shape[2] < num_tokens
        or value.shape[3] != s.num_kv_heads
        or value.shape[4] != s.head_dim
    ):
        raise ValueError(
            f"out must have shape [{s.num_layers}, 2, >= {num_tokens}, {s.num_kv_heads}, "
            f"{s.head_dim}], got {list(value.shape)}"
        )


def kv(spec: KVSpec, value, num_tokens: int) -> torch.Tensor:
    """A store's `kv`, detached, its last dimension dense."""
    s = spec
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"kv must be a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided or value.device.type not in ("cpu", "cuda"):
        raise ValueError(f"kv must be a dense CPU or CUDA tensor, got a {value.layout} one on {value.device}")
    if value.dtype != s.torch_dtype:
        raise ValueError(f"kv has dtype {value.dtype}, but the spec says {s.dtype}")
    if (
        value.dim() != 5
        or value.shape[0] != s.num_layers
        or value.shape[1] != 2
        or value.shape[3] != s.num_kv_heads
        or value.shape[4] != s.head_dim
    ):
        raise ValueError(
            f"kv must have shape [{s.num_layers}, 2, n, {s.num_kv_heads}, {s.head_dim}], got {list(value.shape)}"
        )
    if value.shape[2] < num_tokens:
        raise ValueError(f"kv holds {value.shape[2]} tokens, fewer than the {num_tokens} in tokens")
    value = value.detach()
    return value if value.stride(-1) == 1 else value.contiguous()


def keys(group, value) -> None:
    if not isinstance(group, bytes) or len(group) != HASH_BYTES:
        raise ValueError(f"group must be {HASH_BYTES} bytes")
    if not isinstance(value, (list, tuple)) or not all(isinstance(k, bytes) and len(k) == HASH_BYTES for k in value):
        raise ValueError(f"keys must be a list of {HASH_BYTES}-byte chunk keys")


def chunks(spec: KVSpec, value, num_keys: int) -> None:
    """`store_keys`' chunks: one tensor of the spec's dtype and `chunk_shape` per key, dense, all on one device."""
    s = spec
    if not isinstance(value, (list, tuple)) and not (isinstance(value, torch.Tensor) and value.dim() >= 1):
        raise TypeError(f"chunks must be a list or tuple of tensors (one per key), got {type(value).__name__}")
    if len(value) != num_keys:
        raise ValueError(f"chunks has {len(value)} entries for {num_keys} keys")
    for c in value:
        if not isinstance(c, torch.Tensor) or c.dtype != s.torch_dtype or tuple(c.shape) != s.chunk_shape:
            raise ValueError(f"each chunk must be a {s.dtype} tensor of shape {list(s.chunk_shape)}")
        if c.layout != torch.strided or c.device.type not in ("cpu", "cuda"):
            raise ValueError(f"each chunk must be a dense CPU or CUDA tensor, got a {c.layout} one on {c.device}")
        if c.device != value[0].device:
            raise ValueError(f"all chunks must be on one device, got {value[0].device} and {c.device}")
