"""Model identity for engine integrations: what names a model's weights in a `KVSpec.model_id`.

    model_fingerprint(path) -> str   BLAKE2b-64 over a local model directory's config and weight files
    local_model_id(path) -> str      "<directory name>@<fingerprint>": the model_id the SGLang and vLLM
                                     integrations derive for a local model directory

A hub name alone is not an identity (its weights change under it); a revision or a fingerprint is. Engines of
different kinds (vLLM, SGLang, a transformers worker) share chunks of one local model when they use the same
`local_model_id` and agree on the rest of the spec.
"""

from __future__ import annotations

import hashlib
import os


def model_fingerprint(path: str) -> str:
    """BLAKE2b-64 over a local model (or LoRA adapter) directory's config and weight files (names, sizes,
    bytes)."""
    h = hashlib.blake2b(digest_size=8, person=b"kvmesh.weights")
    names = sorted(
        n
        for n in os.listdir(path)
        if n in ("config.json", "adapter_config.json") or n.endswith((".safetensors", ".bin", ".pt", ".gguf"))
    )
    for name in names:
        full = os.path.join(path, name)
        h.update(f"{name}|{os.path.getsize(full)}|".encode())
        with open(full, "rb") as f:
            while block := f.read(8 << 20):
                h.update(block)
    return h.hexdigest()


def local_model_id(path: str) -> str:
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a local model directory")
    return f"{os.path.basename(os.path.normpath(path))}@{model_fingerprint(path)}"
