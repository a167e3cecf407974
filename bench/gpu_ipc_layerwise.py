"""GPU-tier slots read layer group by layer group (`kvmesh.movers.to_device` over slot views of a mapped pool),
with the device checksums checked: what bench/gpu_tier.py measures. No product path uses it (a client's GPU-tier
hit lands through kvmesh.dataplane's DeviceSink, which verifies the same sums when it finishes), so it lives here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.tiers.devsum import Coefficients, verify_on_side_stream


def read_to_device(
    srcs: Sequence[torch.Tensor],
    spec,
    device,
    expected: Sequence[int],
    *,
    min_copy_bytes: int = 8 << 20,
    out: torch.Tensor | None = None,
    coefficients: Coefficients | None = None,
    verify: bool = True,
):
    """GPU-tier chunks -> a `LayerwiseLoad` on `device` (layer group by layer group, as `movers.to_device`; on the
    same GPU or a peer). `load.verified()` also checks the device checksums, computed on a side stream once the
    last group has landed. Without peer access use `read_chunks(..., peer=False)` into a staging buffer."""
    from kvmesh.movers import to_device

    load = to_device(list(srcs), spec, device, min_copy_bytes=min_copy_bytes, out=out)
    if not verify:  # the caller checks the bytes another way (benchmarks of the copies alone)
        return load
    n = len(srcs)
    flat = load.staging.view(n, -1).view(torch.uint8)
    last = next((e for e in reversed(load.events) if e is not None), None)
    load.checks = [*load.checks, verify_on_side_stream([flat[i] for i in range(n)], expected, last, coefficients)]
    return load
