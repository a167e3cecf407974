"""StoreQueue.flush: one deadline for every store in flight, however many there are."""

import time
from collections import Counter

import torch

from kvmesh.handle import Pending
from kvmesh.spec import KVSpec
from kvmesh.storequeue import StoreQueue

SPEC = KVSpec("storequeue-unit", 1, 1, 8, "float16", chunk_tokens=4)


class NeverAnswers(Pending[int]):
    """A store the node never answers (the node hangs)."""

    def result(self, timeout):
        time.sleep(timeout)
        raise TimeoutError("the KVNode did not answer in time")

    def abandon(self, cleanup) -> None:
        pass

    def done(self) -> bool:
        return False


class HungNode:
    def store(self, items, data):
        return NeverAnswers()


def test_flush_waits_its_timeout_once_not_once_per_store_in_flight():
    counts: Counter = Counter()
    q = StoreQueue(SPEC, HungNode(), counts)
    for i in range(4):
        chunk = torch.zeros(SPEC.chunk_shape, dtype=torch.float16)
        assert q.submit(bytes([i]) * 16, [bytes([i]) * 16], [chunk]) == 1
    t0 = time.monotonic()
    assert q.flush(timeout_s=0.5) == 0
    took = time.monotonic() - t0
    assert took < 1.0, f"flush(0.5) took {took:.2f} s with 4 stores in flight"
    assert counts["store_failures"] == 4
