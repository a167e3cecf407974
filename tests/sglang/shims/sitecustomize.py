# Test shims for SGLang on CPU (see kvmesh_sglang_shims.py); on PYTHONPATH only in tests/sglang.
import kvmesh_sglang_shims  # noqa: F401
