"""Golden values of a pinned engine version (tests/vllm/golden.json, tests/sglang/golden.json): recorded with
KVMESH_RECORD_GOLDEN=1 after checking a new engine, compared on every other run."""

import json
import os

import pytest


def check_golden(path: str, key: str, got: dict, skip_unrecorded_layout: bool = False) -> None:
    """Compare `got` with the golden recorded under `key` ("<engine>==<version> <layout>"), recording it first
    when KVMESH_RECORD_GOLDEN=1. `skip_unrecorded_layout`: a layout of this engine version with no golden (another
    CPU kernel family: its namespace and numerics are its own) still has its engine and format version checked
    against the recorded ones, then skips; otherwise a missing golden fails."""
    goldens = json.load(open(path)) if os.path.exists(path) else {}
    if os.environ.get("KVMESH_RECORD_GOLDEN") == "1":
        goldens[key] = got
        with open(path, "w") as f:
            json.dump(goldens, f, indent=1, sort_keys=True)
            f.write("\n")
    if skip_unrecorded_layout and key not in goldens:
        same_engine = [k for k in goldens if k.split()[0] == key.split()[0]]
        assert same_engine, f"no golden for {key!r} (recorded: {sorted(goldens)}); check this engine, then record"
        for k in same_engine:  # what no CPU kernel family changes: the engine and the integration's format version
            fmt = goldens[k]["kv_format"]
            assert [got["kv_format"][0], got["kv_format"][2]] == [fmt[0], fmt[2]]
        pytest.skip(f"no golden recorded for this CPU's kernel family {key!r} (recorded: {sorted(goldens)})")
    assert key in goldens, f"no golden for {key!r} (recorded: {sorted(goldens)}); check this engine, then record"
    assert got == goldens[key]
