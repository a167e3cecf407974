"""Storage tiers of a KVNode. Each is a pool of fixed-size slots holding one chunk each."""

from collections.abc import Callable
from typing import cast

import numpy as np
import xxhash

# Per-chunk checksum: 64-bit XXH3 of the chunk's bytes. Verified whenever a chunk crosses a process, node or disk
# boundary. Not a security boundary (chunk keys are cryptographic; this catches corruption), so speed wins. (numpy
# arrays are buffers too; numpy's stubs say so only for Python >= 3.12, hence the cast.)
checksum = cast(Callable[[bytes | bytearray | memoryview | np.ndarray], int], xxhash.xxh3_64_intdigest)

TIER_GPU, TIER_CPU, TIER_DISK = 0, 1, 2
TIER_NAMES = {TIER_GPU: "gpu", TIER_CPU: "cpu", TIER_DISK: "disk"}
