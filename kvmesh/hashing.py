"""Chained chunk hashes: the keys under which chunks are stored, looked up and transferred.

Byte layout (written down once; see also `spec.py` for the namespace):

    h_0 = BLAKE2b-128(namespace ‖ salt,               person=b"kvmesh.salt")
    h_i = BLAKE2b-128(h_{i-1} ‖ tokens_i as <u4 × C, person=b"kvmesh.chunk")

`namespace` is the spec's 16-byte digest, `salt` the tenant's `cache_salt` as UTF-8 bytes (empty when none), and
`tokens_i` the i-th run of `chunk_tokens` (C) token ids as little-endian uint32. Only full chunks get a hash. h_i
names the whole prefix up to the end of chunk i: equal hashes mean equal spec, salt and token prefix.

Never Python's `hash()`, never pickle, never a random seed: the same tokens give the same bytes in every process.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Callable

import numpy as np

HASH_BYTES = 16
MAX_TOKEN_ID = 2**32 - 1
CHUNK_PERSON = b"kvmesh.chunk"
_ARRAY_U4 = next((c for c in "IL" if array.array(c).itemsize == 4), None)  # the array typecode of uint32

_native_chain: Callable[[bytes, memoryview, int, bytes], list[bytes]] | None
try:  # the chain in C (setup.py builds it where a C compiler is; optional)
    from kvmesh._chainhash import chain as _native_chain
except ImportError:  # pragma: no cover - a build without a compiler
    _native_chain = None


def as_tokens(tokens, name: str = "tokens") -> np.ndarray:
    """Normalise token ids to a contiguous little-endian uint32 array.

    Accepts a list/tuple of ints, a 1-D integer torch tensor or a 1-D integer numpy array. Anything else raises
    `TypeError`; ids outside [0, 2**32) raise `ValueError`. Both name the argument. A list is converted in one C
    pass (`_list_fast`); only a list that pass refuses is scanned element by element, for the error's words.
    """
    if isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, (list, tuple)):
        fast = _list_fast(tokens)
        if fast is not None:
            return fast
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in tokens):
            raise TypeError(f"{name} must contain only ints")
        try:
            arr = np.asarray(tokens, dtype=np.int64) if tokens else np.zeros(0, dtype=np.int64)
        except OverflowError:
            raise ValueError(f"{name} holds a token id outside [0, {MAX_TOKEN_ID}]") from None
    elif type(tokens).__module__.startswith("torch") and hasattr(tokens, "detach"):
        import torch

        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got dtype {tokens.dtype}")
        if tokens.layout != torch.strided or tokens.device.type == "meta":
            raise ValueError(f"{name} must be a dense tensor with data, got a {tokens.layout} one on {tokens.device}")
        arr = tokens.detach().to("cpu").numpy()
    else:
        raise TypeError(
            f"{name} must be a list of ints, a 1-D integer torch.Tensor or numpy array, got {type(tokens).__name__}"
        )
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must have an integer dtype, got {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID):
        raise ValueError(f"{name} holds a token id outside [0, {MAX_TOKEN_ID}]")
    return np.ascontiguousarray(arr, dtype="<u4")


def _list_fast(tokens: list | tuple) -> np.ndarray | None:
    """A list of token ids as uint32 in one C pass (`array.array("I")`, ~8x faster than the per-element type scan:
    0.9 ms for 131k ids), or None where that pass refuses it or might have taken a bool; the exact path then
    decides (and words the error). The pass refuses what is not an integer (floats, strings, np.bool_) and what is
    outside [0, 2**32). A bool converts to 0 or 1, so only the ids <= 1 are looked at one by one. One difference
    from the exact path: an element that is not an int but converts through `__index__` (a 0-d integer array or
    tensor) is taken as its value."""
    if _ARRAY_U4 is None:
        return None
    try:
        arr = np.frombuffer(array.array(_ARRAY_U4, tokens), dtype=np.uint32)
    except (TypeError, OverflowError, ValueError):
        return None
    for i in np.flatnonzero(arr <= 1).tolist():
        t = tokens[i]
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            return None
    return np.ascontiguousarray(arr, dtype="<u4")  # (a copy only on a big-endian host)


def root_hash(namespace: bytes, cache_salt: str | bytes | None = None) -> bytes:
    """h_0: the namespace with the tenant's salt mixed in."""
    if len(namespace) != HASH_BYTES:
        raise ValueError(f"namespace must be {HASH_BYTES} bytes, got {len(namespace)}")
    return hashlib.blake2b(namespace + salt_bytes(cache_salt), digest_size=HASH_BYTES, person=b"kvmesh.salt").digest()


def salt_bytes(cache_salt: str | bytes | None, name: str = "cache_salt") -> bytes:
    if cache_salt is None:
        return b""
    if isinstance(cache_salt, str):
        return cache_salt.encode("utf-8")
    if isinstance(cache_salt, bytes):
        return cache_salt
    raise TypeError(f"{name} must be str, bytes or None, got {type(cache_salt).__name__}")


def client_salt(cache_salt: str | bytes | None) -> bytes:
    """A client's (tenant's) salt: `salt_bytes`, without NUL, which separates it from a call's own salt."""
    salt = salt_bytes(cache_salt)
    if b"\0" in salt:
        raise ValueError("cache_salt of a client must not contain NUL (it separates the client's from a call's salt)")
    return salt


def call_salt(client: bytes, cache_salt: str | bytes | None) -> bytes:
    """The salt of one call: the client's (the tenant's, `client_salt`), with the call's own behind it,
    "<client>\\0<call>", as vLLM's connector puts a request's salt behind its engine's. A call's salt never replaces
    the client's: a client salted for one tenant cannot name its way into another tenant's or the unsalted chunks.
    An empty call salt is none. (Salts keep apart tenants that do not know each other's salt: they are names, not
    access control; an unsalted client that passes a tenant's salt per call reads that tenant's chunks.)"""
    call = salt_bytes(cache_salt)
    if not call:
        return client
    return client + b"\0" + call if client else call


def chunk_hashes(
    namespace: bytes, tokens: np.ndarray, chunk_tokens: int, cache_salt: str | bytes | None = None
) -> list[bytes]:
    """Hashes h_1..h_n of the full chunks of `tokens` (a uint32 array from `as_tokens`).

    The chain is sequential, so its cost is BLAKE2b's own (9 compressions per 256-token chunk) plus what runs per
    chunk around it. kvmesh._chainhash (C, built with the package) runs the whole chain in one call; where it was
    not built, `python_chain` computes the same bytes."""
    assert tokens.dtype == np.dtype("<u4") and tokens.flags.c_contiguous
    n = len(tokens) // chunk_tokens
    data = tokens[: n * chunk_tokens].data.cast("B")  # (the array's own memoryview)
    prev = root_hash(namespace, cache_salt)
    if _native_chain is not None:
        return _native_chain(prev, data, chunk_tokens * 4, CHUNK_PERSON)
    return python_chain(prev, data, chunk_tokens * 4)


def python_chain(prev: bytes, data: memoryview, step: int) -> list[bytes]:
    """The chain in Python: a copy of one personalised state instead of building the parameter block anew, slices of
    one memoryview instead of new bytes, no attribute look-ups in the loop."""
    n = len(data) // step
    fresh = hashlib.blake2b(digest_size=HASH_BYTES, person=CHUNK_PERSON).copy
    out = [b""] * n
    for i in range(n):
        h = fresh()
        h.update(prev)
        h.update(data[i * step : (i + 1) * step])
        out[i] = prev = h.digest()
    return out


def native_chain_built() -> bool:
    """Whether kvmesh._chainhash (the chain in C) was built with this install."""
    return _native_chain is not None
