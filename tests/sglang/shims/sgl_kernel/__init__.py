"""Test shim, never shipped in kvmesh/: a stand-in for SGLang's `sgl_kernel` on a CPU without its CPU build.

SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1) imports sgl_kernel; the CPU build (AMX/AVX-512 ops) is not on PyPI,
and PyPI's sglang-kernel is CUDA-only. Without AMX, SGLang falls back to forward_native for norms, activations and
embeddings, and attention_backend="torch_native" needs no kernel: the one op it still calls is below, in torch.
Any other op fails loudly (never silently wrong).
"""

import sys

import torch

__version__ = "0.0.0-kvmesh-test-stub"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 max_len):
    pt = 0
    for i in range(req_pool_indices.numel()):
        r, s, e = int(req_pool_indices[i]), int(start_offset[i]), int(end_offset[i])
        req_to_token[r, s:e] = out_cache_loc[pt:pt + e - s].to(req_to_token.dtype)
        pt += e - s


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*a, **k):
        print(f"[sgl_kernel stub] CALLED MISSING OP {name}", file=sys.stderr, flush=True)
        raise NotImplementedError(f"sgl_kernel stub has no {name}")

    return _missing
