"""Test shims, never shipped in kvmesh/: what SGLang 0.5.23's HiCache needs to run on a CPU-only torch.

Import hooks that patch SGLang modules right after they load (nothing in site-packages is edited):
- torchvision: PyPI's build is CUDA's; with torch+cpu its `_meta_registrations` raises "operator torchvision::nms
  does not exist". An empty module stands in for it when torchvision's ops are absent (sglang needs only
  torchvision.transforms).
- pool_host/base.py: HostKVCache(pin_memory=False) (page-locking needs an accelerator).
- pool_host/common.py: cudaHostRegister/unregister become no-ops.
- pool_host/mha.py: a pure-torch `transfer_kv_direct` (imported there only for CUDA/HIP/XPU); it needs
  hicache_io_backend="direct" with hicache_mem_layout="layer_first".
- managers/scheduler.py: `Scheduler.kvmesh_test_raise_unless_idle`, which the test driver calls through
  `Engine.collective_rpc` to wait, without flushing, until SGLang has no request and no HiCache transfer (its
  backups to storage included) in flight (`is_fully_idle`, what `flush_cache` waits for).
Loaded by `sitecustomize.py` beside it (PYTHONPATH=tests/sglang/shims), so SGLang's spawned processes get them too.
"""

import importlib.abc
import importlib.machinery
import sys


def _patch_common(mod):
    import torch

    if torch.cuda.is_available():
        return
    mod._cuda_host_register = lambda *a, **k: None
    mod._cuda_host_unregister = lambda *a, **k: None
    if hasattr(mod, "_cuda_host_unregister_ranges"):
        mod._cuda_host_unregister_ranges = lambda *a, **k: None


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    import torch

    si = src_indices.to(device=src_layers[0].device, dtype=torch.int64)
    di = dst_indices.to(device=dst_layers[0].device, dtype=torch.int64)
    for s, d in zip(src_layers, dst_layers):
        d[di] = s[si].to(d.device)


def _patch_mha(mod):
    if not hasattr(mod, "transfer_kv_direct"):
        mod.transfer_kv_direct = transfer_kv_direct


def _patch_base(mod):
    import inspect

    import torch

    if torch.cuda.is_available():
        return
    cls = mod.HostKVCache
    orig = cls.__init__
    sig = inspect.signature(orig)

    def __init__(self, *args, **kwargs):
        ba = sig.bind(self, *args, **kwargs)
        ba.arguments["pin_memory"] = False
        orig(*ba.args, **ba.kwargs)

    cls.__init__ = __init__


def _patch_scheduler(mod):
    def kvmesh_test_raise_unless_idle(self):
        if not self.is_fully_idle():
            raise RuntimeError("busy")

    mod.Scheduler.kvmesh_test_raise_unless_idle = kvmesh_test_raise_unless_idle


_PATCHES = {"sglang.srt.mem_cache.pool_host.base": _patch_base,
            "sglang.srt.managers.scheduler": _patch_scheduler,
            "sglang.srt.mem_cache.pool_host.common": _patch_common,
            "sglang.srt.mem_cache.pool_host.mha": _patch_mha}


class _EmptyLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torchvision._meta_registrations":
            ext = sys.modules.get("torchvision.extension")
            if ext is not None and not ext._has_ops():
                return importlib.machinery.ModuleSpec(name, _EmptyLoader())
            return None
        fn = _PATCHES.get(name)
        if fn is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        orig = spec.loader.exec_module

        def exec_module(module, _orig=orig, _fn=fn):
            _orig(module)
            _fn(module)

        spec.loader.exec_module = exec_module
        return spec


if not any(isinstance(f, _Finder) or type(f).__name__ == "_Finder" and f.__module__ == __name__
           for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
