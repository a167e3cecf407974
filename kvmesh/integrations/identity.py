"""Model identity for engine integrations: what names a model's weights in a `KVSpec.model_id`.

    model_fingerprint(path) -> str   BLAKE2b-64 over a local model directory's config and weight files (kept in a
                                     cache by the files' stat: a large model is read once, not per process)
    local_model_id(path) -> str      "<directory name>@<fingerprint>": the model_id the SGLang and vLLM
                                     integrations derive for a local model directory

A hub name alone is not an identity (its weights change under it); a revision or a fingerprint is. Engines of
different kinds (vLLM, SGLang, a transformers worker) share chunks of one local model when they use the same
`local_model_id` and agree on the rest of the spec.
"""

from __future__ import annotations

import hashlib
import os
import time

WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CACHE_MIN_AGE_S = 2.0  # files changed more recently than this are hashed but their fingerprint is not kept


def model_fingerprint(path: str) -> str:
    """BLAKE2b-64 over a local model (or LoRA adapter) directory's config and weight files (names, sizes,
    bytes). Reading every byte of a large model takes minutes, in every engine process (each TP rank), so the
    result is kept in a cache file named by the files' stat (size, mtime, ctime, inode, device;
    `$KVMESH_CACHE_DIR`, else `~/.cache/kvmesh`) and read from there while none of them changed. As git does for
    its index, a fingerprint is kept only when every file is older than CACHE_MIN_AGE_S: a file rewritten later
    gets a later timestamp, even on a file system whose clock is coarse. Where the cache cannot be written, the
    files are hashed each time."""
    names = sorted(
        n for n in os.listdir(path) if n in ("config.json", "adapter_config.json") or n.endswith(WEIGHT_FILES)
    )
    stats = _stats(path, names)
    cache = _cache_file(path, stats)
    try:
        with open(cache, encoding="ascii") as f:
            cached = f.read().strip()
        if len(cached) == 16:
            return cached
    except (OSError, ValueError):
        pass
    h = hashlib.blake2b(digest_size=8, person=b"kvmesh.weights")
    for name in names:
        full = os.path.join(path, name)
        h.update(f"{name}|{os.path.getsize(full)}|".encode())
        with open(full, "rb") as f:
            while block := f.read(8 << 20):
                h.update(block)
    fingerprint = h.hexdigest()
    settled = all(time.time_ns() - st[2] > CACHE_MIN_AGE_S * 1e9 for st in stats)  # (by mtime; ctime is in the key)
    if settled and _stats(path, names) == stats:  # (nothing changed while it was read)
        try:
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            tmp = f"{cache}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="ascii") as f:
                f.write(fingerprint)
            os.replace(tmp, cache)
        except OSError:
            pass
    return fingerprint


def _stats(path: str, names: list[str]) -> list[tuple]:
    out = []
    for name in names:
        st = os.stat(os.path.join(path, name))
        out.append((name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev))
    return out


def _cache_file(path: str, stats: list[tuple]) -> str:
    root = os.environ.get("KVMESH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kvmesh"
    )
    key = hashlib.blake2b(repr((os.path.realpath(path), stats)).encode(), digest_size=16).hexdigest()
    return os.path.join(root, "fingerprints", key)


def local_model_id(path: str) -> str:
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a local model directory")
    return f"{os.path.basename(os.path.normpath(path))}@{model_fingerprint(path)}"
