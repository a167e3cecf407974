"""EngineClients: the vLLM connector's clients, one per (LoRA adapter, KV cache group), made once each."""

import threading
import time
from collections import Counter

from kvmesh.integrations.vllm_clients import EngineClients
from kvmesh.spec import KVSpec

SPEC = KVSpec("engine-clients", 2, 2, 16, "bfloat16", chunk_tokens=16)


class StandIn:
    def __init__(self, spec) -> None:
        self.spec, self.counts, self.cost = spec, Counter(), object()

    def share(self, other, cost: bool = False) -> None:  # (KVMeshClient.share)
        self.counts = other.counts
        if cost:
            self.cost = other.cost


def test_threads_asking_for_one_adapter_at_once_get_one_client_counting_into_the_base_one():
    """The engine's thread, the loader and the saver asked at once: two clients were made for one adapter, and
    the one dropped was never closed (found by the thread-safety hunt)."""
    made = []

    def connect(spec):
        time.sleep(0.05)  # (a real connect takes a Redis round trip or more)
        made.append(StandIn(spec))
        return made[-1]

    clients = EngineClients([SPEC], connect, share_cost=True)
    got = []
    threads = [threading.Thread(target=lambda: got.append(clients.get("adapter-a"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 2 and len({id(c) for c in got}) == 1  # the base client and one for the adapter
    adapter = got[0]
    assert adapter.spec.lora_id == "adapter-a" and adapter.counts is clients.base.counts
    assert adapter.cost is clients.base.cost and clients.all() == [clients.base, adapter]
