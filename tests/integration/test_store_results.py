"""What a store says is what happened: `store_keys` returns a `StoreResult` (handed, cached, dropped and why), and
`store_keys_waited` also says how many of the handed chunks the node stored; a store the node refused after
receiving it (no slot it may evict: every slot pinned by a reader) is not `ok`. The SGLang backend and the vLLM tier
report exactly that to their engines. A plain KVNode against a real redis-server."""

import torch

from kvmesh import KVSpec
from kvmesh.connecting import connect_local
from kvmesh.hashing import as_tokens, chunk_hashes

SPEC = KVSpec("store-results", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)


def _chunks(seed: int, n: int) -> tuple[list[bytes], list[torch.Tensor]]:
    toks = list(range(seed * 1000, seed * 1000 + n * SPEC.chunk_tokens))
    keys = chunk_hashes(SPEC.namespace, as_tokens(toks), SPEC.chunk_tokens)
    g = torch.Generator().manual_seed(seed)
    return keys, [torch.randn(SPEC.chunk_shape, generator=g).to(SPEC.torch_dtype) for _ in range(n)]


def test_a_store_the_node_refused_after_receiving_it_is_not_ok(make_node):
    node = make_node(cpu_bytes=4 * SPEC.chunk_bytes, slot_bytes=SPEC.chunk_bytes, key_prefix="sr")
    c = connect_local(SPEC, node)
    try:
        keys, chunks = _chunks(1, 4)
        first = c.store_keys_waited(keys[0], keys, chunks, 10.0)
        assert (first.handed, first.cached, first.dropped, first.stored, first.ok) == (4, 0, 0, 4, True)
        again = c.store_keys(keys[0], keys, chunks)  # all listed now: nothing handed, nothing lost
        assert (again.handed, again.cached, again.ok) == (0, 4, True) and again.stored is None
        pinned = node.pin(keys)  # a reader holds every slot: the node has nothing to evict for a new chunk
        assert len(pinned.chunks) == 4
        more, more_chunks = _chunks(2, 2)
        refused = c.store_keys_waited(more[0], more, more_chunks, 10.0)
        assert refused.handed == 2 and refused.stored == 0 and not refused.ok
        node.unpin(pinned.pin_id)
        stored = c.store_keys_waited(more[0], more, more_chunks, 10.0)
        assert stored.ok and stored.stored == 2
    finally:
        c.close()

