"""kvmesh._extras: a missing optional package is one ImportError that names the pip extra; anything else is not
relabelled. (tests/install checks the real thing: a core-only install without the extras.)"""

import sys

import pytest

from kvmesh import _extras
from kvmesh._extras import MissingExtra, require


def test_an_installed_module_is_returned():
    import psutil

    assert require("psutil", "bench", "x") is psutil


def test_a_missing_module_names_its_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ModuleNotFoundError(name="tqdm")
    with pytest.raises(MissingExtra) as e:
        require("tqdm", "bench", "bench/reuse.py")
    assert str(e.value) == "bench/reuse.py needs tqdm: pip install 'kvmesh[bench]'"
    assert isinstance(e.value, ImportError) and e.value.name == "tqdm"


def test_a_broken_package_keeps_its_own_error(monkeypatch, tmp_path):
    """Installed, but something it imports is missing: that is the package's problem, not a missing extra."""
    (tmp_path / "kvmesh_fake_optional.py").write_text("import kvmesh_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(_extras.EXTRAS, "fake", ("kvmesh_fake_optional",))
    with pytest.raises(ModuleNotFoundError) as e:
        require("kvmesh_fake_optional", "fake", "x")
    assert not isinstance(e.value, MissingExtra) and e.value.name == "kvmesh_no_such_dependency"


def test_a_module_must_belong_to_the_extra_it_names():
    with pytest.raises(ValueError, match="not in kvmesh\\[local\\]"):
        require("transformers", "local", "x")
    with pytest.raises(ValueError, match="unknown kvmesh extra"):
        _extras.hint("nope")
