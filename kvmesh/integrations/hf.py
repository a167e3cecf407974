"""Reuse through a transformers causal LM (`DynamicCache`).

    spec_for_model(model, ...) -> KVSpec      identity from the model's config, dtype and weights
    cache_from_kv(kv) -> DynamicCache         [num_layers, 2, T, kv_heads, head_dim] -> per-layer [1, H, T, D]
    kv_from_cache(cache, num_tokens) -> Tensor the reverse
    generate(model, prompt, client=...)       look up, fetch the cached prefix, prefill only the suffix, decode
                                              greedily, store the new full chunks

Without a client, `generate` is the plain recompute path through the very same code, so the two can be compared
token for token.
"""

from __future__ import annotations

import hashlib
import inspect
import time
from dataclasses import dataclass, field

import torch

from kvmesh.hashing import as_tokens
from kvmesh.spec import KVSpec


def weights_fingerprint(model: torch.nn.Module) -> str:
    """BLAKE2b-64 over every parameter and buffer (name, dtype, shape, bytes): a revision id for weights that
    have none. Reads all weights once; pass `model_id` with a real revision to skip it for big models."""
    h = hashlib.blake2b(digest_size=8, person=b"kvmesh.weights")
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def spec_for_model(model, *, model_id: str | None = None, chunk_tokens: int = 256, lora_id: str | None = None,
                   tp_rank: int = 0, tp_size: int = 1) -> KVSpec:
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if model_id is None:
        name = getattr(cfg, "name_or_path", "") or cfg.model_type
        model_id = f"{name}@{weights_fingerprint(model)}"
    return KVSpec(model_id=model_id, num_layers=cfg.num_hidden_layers, num_kv_heads=kv_heads // tp_size,
                  head_dim=head_dim, dtype=dtype, chunk_tokens=chunk_tokens, tp_rank=tp_rank, tp_size=tp_size,
                  lora_id=lora_id)


def _new_cache():
    from transformers import DynamicCache

    return DynamicCache()


def cache_from_kv(kv: torch.Tensor):
    """A `DynamicCache` holding `kv` ([num_layers, 2, T, H, D])."""
    cache = _new_cache()
    for layer in range(kv.shape[0]):
        k = kv[layer, 0].transpose(0, 1).unsqueeze(0).contiguous()
        v = kv[layer, 1].transpose(0, 1).unsqueeze(0).contiguous()
        cache.update(k, v, layer)
    return cache


def _layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def kv_from_cache(cache, num_tokens: int, num_layers: int) -> torch.Tensor:
    """[num_layers, 2, num_tokens, H, D] copied out of a batch-1 cache."""
    first_k, _ = _layer_kv(cache, 0)
    _, h, _, d = first_k.shape
    out = torch.empty((num_layers, 2, num_tokens, h, d), dtype=first_k.dtype, device=first_k.device)
    for layer in range(num_layers):
        k, v = _layer_kv(cache, layer)
        out[layer, 0].copy_(k[0, :, :num_tokens].transpose(0, 1))
        out[layer, 1].copy_(v[0, :, :num_tokens].transpose(0, 1))
    return out


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass
class GenerationResult:
    tokens: list[int]  # generated token ids
    prompt_tokens: int
    reused_tokens: int = 0  # prefix tokens whose KV came from kvmesh
    reused_local_tokens: int = 0  # ... from this node's tier
    reused_peer_tokens: int = 0  # ... pulled from another node
    computed_tokens: int = 0  # prompt tokens prefilled here
    stored_chunks: int = 0
    lookup_s: float = 0.0
    fetch_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0  # lookup + fetch + prefill: time to the first generated token
    total_s: float = 0.0
    first_logits: torch.Tensor | None = field(default=None, repr=False)


@torch.inference_mode()
def generate(model, prompt, max_new_tokens: int = 16, client=None, cache_salt=None, store: bool = True,
             keep_logits: bool = False) -> GenerationResult:
    """Greedy generation with kvmesh reuse when `client` is given, plain recompute otherwise."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    toks = as_tokens(prompt, "prompt")
    n = len(toks)
    if n == 0:
        raise ValueError("prompt must hold at least one token")
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    ids = torch.from_numpy(toks.astype("int64")).to(device).unsqueeze(0)
    res = GenerationResult([], n)
    cache, reused = None, 0
    if client is not None:
        match = client.lookup(toks, cache_salt)
        t1 = time.perf_counter()
        res.lookup_s = t1 - t0
        # at least one prompt token must be computed to get the next-token logits
        match = match.truncate(min(match.num_chunks, (n - 1) // match.chunk_tokens))
        if match.num_chunks:
            # cache_from_kv copies out at once, so the client's reusable buffer can take the pull
            kv = client.fetch(match, device=device, out=client.scratch(match.num_tokens))
            reused = kv.shape[2]
            if reused:
                cache = cache_from_kv(kv)
                res.reused_local_tokens = client.last_fetch.local_chunks * match.chunk_tokens
                res.reused_peer_tokens = client.last_fetch.peer_chunks * match.chunk_tokens
        res.fetch_s = time.perf_counter() - t1
    if cache is None:
        cache = _new_cache()
    res.reused_tokens, res.computed_tokens = reused, n - reused
    kw = _cache_kwarg(model)
    t2 = time.perf_counter()
    out = model(input_ids=ids[:, reused:], use_cache=True, logits_to_keep=1, **{kw: cache})
    logits = out.logits[:, -1]
    nxt = logits.argmax(-1)
    res.prefill_s = time.perf_counter() - t2
    res.ttft_s = time.perf_counter() - t0
    if keep_logits:
        res.first_logits = logits[0].float().cpu()
    res.tokens.append(int(nxt))
    if client is not None and store:
        res.stored_chunks = client.store(toks, kv_from_cache(cache, n, model.config.num_hidden_layers), cache_salt)
    for _ in range(max_new_tokens - 1):
        out = model(input_ids=nxt.view(1, 1), use_cache=True, **{kw: cache})
        nxt = out.logits[:, -1].argmax(-1)
        res.tokens.append(int(nxt))
    res.total_s = time.perf_counter() - t0
    return res


def tiny_llama(seed: int = 0, *, vocab_size: int = 4096, hidden_size: int = 256, num_layers: int = 4,
               num_heads: int = 8, num_kv_heads: int = 4, intermediate_size: int = 688,
               max_position_embeddings: int = 8192, initializer_range: float = 0.2, dtype=torch.float32):
    """A random-weight `LlamaForCausalLM`, identical for equal arguments in every process. The large
    `initializer_range` keeps greedy outputs prompt-dependent, so output comparisons mean something."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                      num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                      intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
                      initializer_range=initializer_range, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()
