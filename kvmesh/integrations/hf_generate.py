"""Greedy generation through a transformers model with kvmesh reuse (see kvmesh.integrations.hf).

generate(model, prompt, client=...) -> GenerationResult   look up, follow the cost model's plan (load all /
                                    compute the front while the rest loads / recompute), prefill the rest,
                                    decode greedily, store the new full chunks
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from kvmesh.hashing import as_tokens
from kvmesh.integrations.hf_cache import _check_cache, _forward, _new_cache, kv_from_cache, prefill_on_load
from kvmesh.integrations.hf_spec import _check_spec, _decoder, check_supported
from kvmesh.movers import LayerwiseLoad
from kvmesh.spec import KVSpec


@dataclass
class GenerationResult:
    tokens: list[int]  # generated token ids
    prompt_tokens: int
    reused_tokens: int = 0  # prefix tokens whose KV came from kvmesh
    reused_local_tokens: int = 0  # ... from this node's tier
    reused_peer_tokens: int = 0  # ... pulled from another node
    computed_tokens: int = 0  # prompt tokens prefilled here
    stored_chunks: int = 0
    plan: str = ""  # the cost model's decision: load / split / recompute / no estimate / no match
    lookup_s: float = 0.0
    fetch_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0  # lookup + fetch + prefill: time to the first generated token
    total_s: float = 0.0
    first_logits: torch.Tensor | None = field(default=None, repr=False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate(
    model, prompt, max_new_tokens: int = 16, client=None, cache_salt=None, store: bool = True, keep_logits: bool = False
) -> GenerationResult:
    """Greedy generation with kvmesh reuse when `client` is given, plain recompute otherwise."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    toks = as_tokens(prompt, "prompt")
    n = len(toks)
    if n == 0:
        raise ValueError("prompt must hold at least one token")
    check_supported(model)
    if client is not None:
        if not isinstance(getattr(client, "spec", None), KVSpec):  # (a KVMeshClient, or one that acts as it)
            raise TypeError(f"client must be a KVMeshClient (kvmesh.connect) or None, got {type(client).__name__}")
        _check_spec(model, client.spec)
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    ids = torch.from_numpy(toks.astype("int64")).to(device).unsqueeze(0)
    res = GenerationResult([], n)
    logits = cache = None
    if client is not None:
        logits, cache = _reuse(model, ids, toks, client, cache_salt, res)
    if logits is None:  # recompute everything
        t2 = time.perf_counter()
        cache = _new_cache()
        logits = _forward(model, ids, cache, logits_to_keep=1).logits[:, -1]
        _sync(device)
        res.prefill_s = time.perf_counter() - t2
        res.reused_tokens = res.reused_local_tokens = res.reused_peer_tokens = 0
        if client is not None:
            client.cost.prefill.observe(n, 0, res.prefill_s)
    res.computed_tokens = n - res.reused_tokens
    if client is not None:
        client.record_request(res.reused_local_tokens, res.reused_peer_tokens, res.computed_tokens)
    nxt = logits.argmax(-1)
    res.tokens.append(int(nxt))
    res.ttft_s = time.perf_counter() - t0
    if keep_logits:
        res.first_logits = logits[0].float().cpu()
    if client is not None and store:
        _check_cache(cache, client.spec, n)
        kv = kv_from_cache(cache, n, _decoder(model.config)[0])  # (a copy of its own: handed over, no other copy)
        res.stored_chunks = client.store(toks, kv, cache_salt, handover=True)
    for _ in range(max_new_tokens - 1):
        nxt = _forward(model, nxt.view(1, 1), cache).logits[:, -1].argmax(-1)
        res.tokens.append(int(nxt))
    res.total_s = time.perf_counter() - t0
    return res


def _reuse(model, ids, toks, client, cache_salt, res: GenerationResult):
    """Follow the cost model's plan. Returns (logits, cache), or (None, None) to recompute everything."""
    n = len(toks)
    t0 = time.perf_counter()
    c = client.spec.chunk_tokens
    # at least one prompt token must be computed to get the next-token logits: the lookup (and what it counts, a
    # hit or a miss) is of the chunks before it, and its plan (priced for the whole prompt) is the one followed
    match = client.lookup(toks, cache_salt, max_chunks=(n - 1) // c)
    plan = match.plan
    assert plan is not None  # (a lookup with the cost model plans)
    res.plan = plan.reason
    res.lookup_s = time.perf_counter() - t0
    if plan.end == 0:
        return None, None
    device = ids.device
    front = plan.front * c
    part = match.select(plan.front, plan.end)
    t1 = time.perf_counter()
    load, front_cache, fetched = _start_load(client, part, device, model)
    if front:  # compute the front while the rest loads
        front_cache = _new_cache()
        tf = time.perf_counter()
        _forward(model, ids[:, :front], front_cache, logits_to_keep=1)
        _sync(device)
        client.cost.prefill.observe(front, 0, time.perf_counter() - tf)
    load = fetched() if callable(fetched) else load
    loaded = 0 if load is None else load.staging.shape[0] * c
    res.fetch_s = time.perf_counter() - t1
    if loaded == 0 and not front:
        return None, None
    stats = client.last_fetch
    res.reused_tokens = loaded
    res.reused_local_tokens = min(loaded, stats.local_chunks * c)
    res.reused_peer_tokens = loaded - res.reused_local_tokens
    t2 = time.perf_counter()
    logits, cache = prefill_on_load(model, ids[:, front + loaded :], load, loaded, front_cache, front)
    _sync(device)
    res.prefill_s = time.perf_counter() - t2
    if load is not None:
        ok = load.verified()
        load.release()
        if not ok:  # a source chunk failed its checksum: what we computed from it is discarded
            client.counts["reuse_discarded_checksum"] += 1
            return None, None
    return logits, cache


def _start_load(client, part, device: torch.device, model):
    """Start moving `part` toward the model. On a GPU: DMA, asynchronous. On the CPU: a fetch in a thread (it
    releases the GIL while it copies or waits on sockets), joined by the returned callable."""
    spec = client.spec
    if device.type == "cuda":
        load, _ = client.fetch_to_device(part, device)
        return load, None, None
    box = {}

    def run():
        box["kv"] = client.fetch(part, out=client.scratch(part.num_tokens))

    th = threading.Thread(target=run, name="kvmesh-hf-fetch")
    th.start()

    def joined():
        th.join()
        kv = box.get("kv")
        if kv is None or kv.shape[2] == 0:
            return None
        n = kv.shape[2] // spec.chunk_tokens
        # [L, 2, n*C, H, D] -> chunk layout [n, L, 2, C, H, D] for the layer-wise consumer
        staging = kv.unflatten(2, (n, spec.chunk_tokens))  # a view, whatever the scratch buffer's length
        return LayerwiseLoad(staging.permute(2, 0, 1, 3, 4, 5), [None] * spec.num_layers)

    return None, None, joined
