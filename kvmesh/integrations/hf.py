"""Reuse through a transformers causal LM (`DynamicCache`).

    spec_for_model(model, ...) -> KVSpec        identity from the model's config, dtype and weights, and the KV
                                                format (`HF_FORMAT`, or None: kvmesh's neutral chunks, shared
                                                with a vLLM engine whose connector has kv_format="neutral")
    cache_from_kv(kv) -> DynamicCache           [num_layers, 2, T, kv_heads, head_dim] -> per-layer [1, H, T, D]
    kv_from_cache(cache, num_tokens, layers)    the reverse
    prefill_on_load(model, ids, load, ...)      prefill a suffix while its prefix arrives layer by layer: decoder
                                                layer i waits (forward pre-hook) only for layer i's KV
    generate(model, prompt, client=...)         look up, follow the cost model's plan (load all / compute the
                                                front while the rest loads / recompute), prefill the rest,
                                                decode greedily, store the new full chunks

Without a client, `generate` is the plain recompute path through the same code, so the two can be compared token
for token.

Sliding-window models (Mistral-, Gemma-2-style configs). The cache here is a plain `DynamicCache`, which keeps every
token of every layer (the model applies its window as an attention mask), so the KV stored and loaded is the whole
prefix of every layer: one uniform stack, whatever the layers' windows.

What this integration moves is one K and one V per layer, per token, of one shape: [kv_heads, head_dim]. Models whose
state is anything else raise `UnsupportedModel` (a `ValueError`) from `spec_for_model` and `generate`, before
anything is looked up, stored or computed: hybrids with recurrent, convolutional or linear-attention layers (a
`layer_types` or `layers_block_type` entry other than full, sliding or chunked attention: Qwen3-Next, Jamba, LFM2,
Falcon-H1, Bamba, MiniMax...) and multi-head latent attention (DeepSeek-V2/V3: K and V head dims differ). A spec
whose geometry (layers, kv heads, head dim, dtype) is not the model's raises `ValueError` from `generate`, and a
cache whose K/V do not have the spec's shape is never stored.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import threading
import time
from dataclasses import dataclass, field

import torch

from kvmesh._extras import require
from kvmesh.hashing import as_tokens
from kvmesh.movers import LayerwiseLoad, scatter_contiguous
from kvmesh.spec import KVFormat, KVSpec

# The chunks this integration writes: every layer's K/V out of a DynamicCache, in kvmesh's neutral order. Bump the
# version whenever that changes.
HF_FORMAT = KVFormat("transformers", "dynamic-cache", 1)

transformers = require("transformers", "hf", __name__)


def weights_fingerprint(model: torch.nn.Module) -> str:
    """BLAKE2b-64 over every parameter and buffer (name, dtype, shape, bytes; non-persistent buffers such as RoPE's
    `inv_freq` too) and over the model's config: a revision id for a model that has none. The config counts because
    the same weights give other K/V under another RoPE theta or scaling, norm epsilon, window, or multiplier. Reads
    all weights once; pass `model_id` with a real revision to skip it for big models."""
    h = hashlib.blake2b(digest_size=8, person=b"kvmesh.weights")
    tensors = dict(model.state_dict())
    tensors.update((f"buffer:{name}", b) for name, b in model.named_buffers() if name not in tensors)
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")  # (0-d buffers too)
    h.update(b"config|" + config_fingerprint(model.config).encode())
    return h.hexdigest()


# Config fields that name, label or steer a run without changing any layer's K/V: left out of the fingerprint, so
# that the same model loaded from another path, by another transformers, or with another attention backend (equal
# within dtype tolerance) still shares its KV. Everything else counts: an unknown field makes a miss, never a
# wrong hit.
_CONFIG_NOT_KV = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "transformers_version",
        "_commit_hash",
        "architectures",
        "torch_dtype",
        "dtype",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "_attn_implementation",
        "_attn_implementation_internal",
        "_attn_implementation_autoset",
        "_experts_implementation",
        "max_length",
        "min_length",
        "problem_type",
        "task_specific_params",
    }
)


def config_fingerprint(config) -> str:
    """BLAKE2b-64 of the model config's fields that can change K/V (all but `_CONFIG_NOT_KV`), in canonical JSON."""

    def strip(d):
        if isinstance(d, dict):
            return {k: strip(v) for k, v in d.items() if k not in _CONFIG_NOT_KV}
        if isinstance(d, (list, tuple)):
            return [strip(v) for v in d]
        return d

    d = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    text = json.dumps(strip(d), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=8, person=b"kvmesh.config").hexdigest()


class UnsupportedModel(ValueError):
    """A model whose per-layer state is not one K and one V per token of one shape (see the module docstring)."""


_ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention", "attention")


_GEOMETRY = (
    "head_dim",
    "qk_head_dim",
    "v_head_dim",
    "kv_lora_rank",
    "num_key_value_heads",
    "num_attention_heads",
    "hidden_size",
    "num_hidden_layers",
)


def _read(cfg, name: str, kind: str):
    """`config.<name>`, None if it has none. A heterogeneous config (transformers' per-layer configs, e.g.
    Gemma 4's: sliding layers of head dim 256, full ones of 512) raises on a global read of an attribute its layers
    do not share: that is a model of more than one KV shape."""
    try:
        return getattr(cfg, name, None)
    except Exception as e:
        raise UnsupportedModel(
            f"{kind}: config.{name} differs between its layers ({type(e).__name__}); kvmesh.integrations.hf moves "
            "K and V of one shape in every layer"
        ) from None


# how transformers names cross-attention (K/V of an encoder's output, not the prompt's): BART's, Whisper's, ...
# `encoder_attn`, BERT's `crossattention`, T5's `EncDecAttention`
_CROSS = ("cross", "encoder_attn", "encdec", "enc_dec")


def _bidirectional(model) -> str:
    """The name of a self-attention module of the model that attends both ways, or "". Transformers' attention
    modules say so themselves (`is_causal`: a BERT-family layer follows `config.is_decoder`, a decoder-only model's
    is always True); cross-attention (never the prompt's own K/V) is not one."""
    for name, m in model.named_modules():
        if getattr(m, "is_causal", None) is False and not getattr(m, "is_cross_attention", False):
            what = f"{name}.{type(m).__name__}".lower()
            if not any(c in what for c in _CROSS):
                return name or type(m).__name__
    return ""


def check_supported(model) -> None:
    """Raises `UnsupportedModel`, naming the model type and what it has, unless every decoder layer keeps plain
    per-token K/V of one shape."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "parameters"):
        raise TypeError(f"model must be a transformers model (with .config), got {type(model).__name__}")
    kind = getattr(cfg, "model_type", type(model).__name__)
    for name in _GEOMETRY:
        _read(cfg, name, kind)
    loops = getattr(cfg, "n_recurrent_loops", None)
    if isinstance(loops, int) and loops > 1:
        raise UnsupportedModel(
            f"{kind}: its recurrent layers run {loops} times per token (config.n_recurrent_loops): the cache "
            "holds more K/V than one per layer"
        )
    for attr in ("layer_types", "layers_block_type"):
        types = getattr(cfg, attr, None)
        other = sorted({str(t) for t in types or () if t not in _ATTENTION_LAYERS})
        if other:
            raise UnsupportedModel(
                f"{kind}: layers of type {', '.join(other)} (config.{attr}) keep state that is not per-token K/V "
                "(recurrent, convolutional or linear attention); kvmesh.integrations.hf moves only attention KV"
            )
    v_dim = getattr(cfg, "v_head_dim", None)
    qk_dim = getattr(cfg, "qk_head_dim", None) or getattr(cfg, "head_dim", None)
    if getattr(cfg, "kv_lora_rank", None) or (v_dim is not None and qk_dim is not None and v_dim != qk_dim):
        raise UnsupportedModel(
            f"{kind}: multi-head latent attention (K head dim {qk_dim}, V head dim {v_dim}); kvmesh.integrations.hf "
            "moves K and V of one shape"
        )
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModel(
            f"{kind}: an encoder-decoder model (its decoder's KV depends on the encoder's input, and its cross-"
            "attention KV is not per prompt token); kvmesh.integrations.hf moves a decoder-only model's KV"
        )
    both_ways = _bidirectional(model)
    if both_ways:
        raise UnsupportedModel(
            f"{kind}: its attention {both_ways} is not causal (is_causal False): a prefix's K/V depends on the "
            "tokens after it (a BERT-family LM head runs as a causal LM with config.is_decoder=True)"
        )
    if not isinstance(getattr(cfg, "num_hidden_layers", None), int):
        raise UnsupportedModel(f"{kind}: its config has no num_hidden_layers: not a decoder this integration knows")
    if not isinstance(getattr(cfg, "num_attention_heads", None), int):
        raise UnsupportedModel(f"{kind}: its config has no num_attention_heads: a model without attention KV")
    if getattr(cfg, "num_kv_shared_layers", 0):
        raise UnsupportedModel(
            f"{kind}: its last {cfg.num_kv_shared_layers} layers reuse earlier layers' K/V "
            "(config.num_kv_shared_layers): the cache holds fewer layers than the model has"
        )


def _decoder(cfg) -> tuple[int, int]:
    """(layers, attention heads) of the model's decoder. The decoder-only form of an encoder-decoder config (such
    as BartForCausalLM) has them as `decoder_layers` and `decoder_attention_heads`; its `num_hidden_layers` and
    `num_attention_heads` are the encoder's."""
    layers, heads = getattr(cfg, "decoder_layers", None), getattr(cfg, "decoder_attention_heads", None)
    return (
        layers if isinstance(layers, int) else cfg.num_hidden_layers,
        heads if isinstance(heads, int) else cfg.num_attention_heads,
    )


def _geometry(model, tp_size: int = 1) -> tuple[int, int, int, str]:
    """(layers, kv heads per rank, head dim, dtype) of the model's KV, from its config. `tp_size` must split the KV
    heads evenly (ValueError naming it otherwise: a rank's shard would be a guess)."""
    cfg = model.config
    layers, heads = _decoder(cfg)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    if kv_heads % tp_size:
        raise ValueError(f"tp_size {tp_size} does not divide the model's {kv_heads} KV heads evenly")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return layers, kv_heads // tp_size, head_dim, dtype


def _check_spec(model, spec: KVSpec) -> None:
    """`generate` runs the whole model in this process: the spec must describe all of its KV (tp_size 1)."""
    layers, kv_heads, head_dim, dtype = _geometry(model)
    want = (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype)
    if spec.tp_size != 1 or want != (layers, kv_heads, head_dim, dtype):
        raise ValueError(
            f"the client's spec (layers, kv heads, head dim, dtype) = {want} with tp_size {spec.tp_size} is not the "
            f"model's {(layers, kv_heads, head_dim, dtype)} in one process: make it with spec_for_model(model)"
        )


def _check_cache(cache, spec: KVSpec, num_tokens: int) -> None:
    """The computed cache holds, in every layer, K and V of the spec's shape; else nothing may be stored."""
    want = (1, spec.num_kv_heads, num_tokens, spec.head_dim)
    held = len(cache.layers) if hasattr(cache, "layers") else len(cache.key_cache)
    if held != spec.num_layers:
        raise UnsupportedModel(f"the cache holds {held} layers, the spec {spec.num_layers}: its KV cannot be stored")
    for layer in range(spec.num_layers):
        k, v = _layer_kv(cache, layer)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise UnsupportedModel(
                f"layer {layer}'s cache holds K {tuple(k.shape)} and V {tuple(v.shape)}, not {want} "
                "[batch, kv heads, tokens, head dim] as the spec says: this model's KV cannot be stored"
            )


def spec_for_model(
    model,
    *,
    model_id: str | None = None,
    chunk_tokens: int = 256,
    lora_id: str | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    kv_format: KVFormat | None = HF_FORMAT,
) -> KVSpec:
    check_supported(model)
    cfg = model.config
    num_layers, kv_heads, head_dim, dtype = _geometry(model, tp_size)
    if model_id is None:
        name = getattr(cfg, "name_or_path", "") or cfg.model_type
        model_id = f"{name}@{weights_fingerprint(model)}"
    return KVSpec(
        model_id=model_id,
        num_layers=num_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        chunk_tokens=chunk_tokens,
        tp_rank=tp_rank,
        tp_size=tp_size,
        lora_id=lora_id,
        kv_format=kv_format,
    )


def _new_cache():
    return transformers.DynamicCache()


def _install(cache, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Put K/V [1, H, T, D] into a DynamicCache layer without copying them (so they may still be filling)."""
    cache.update(k[:, :, :0], v[:, :, :0], layer)  # creates the layer
    if hasattr(cache, "layers"):  # transformers >= 4.56
        cache.layers[layer].keys, cache.layers[layer].values = k, v
    else:
        cache.key_cache[layer], cache.value_cache[layer] = k, v


def cache_from_kv(kv: torch.Tensor):
    """A `DynamicCache` holding (a copy of) `kv` ([num_layers, 2, T, H, D])."""
    cache = _new_cache()
    for layer in range(kv.shape[0]):
        _install(
            cache,
            layer,
            kv[layer, 0].transpose(0, 1).unsqueeze(0).contiguous(),
            kv[layer, 1].transpose(0, 1).unsqueeze(0).contiguous(),
        )
    return cache


def _layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):
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


def _decoder_layers(model):
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else None


def _forward(model, ids: torch.Tensor, cache, **kw):
    return model(input_ids=ids, use_cache=True, **{_cache_kwarg(model): cache}, **kw)


def prefill_on_load(
    model,
    suffix_ids: torch.Tensor,
    load: LayerwiseLoad | None,
    loaded_tokens: int,
    front_cache=None,
    front_tokens: int = 0,
):
    """Prefill `suffix_ids` ([1, S]) on top of a prefix made of `front_tokens` computed tokens (in
    `front_cache`) followed by `loaded_tokens` tokens arriving through `load` (chunk layout). Decoder layer i
    waits only for layer i of the load. Returns (last-position logits, cache)."""
    num_layers, _ = _decoder(model.config)
    total = front_tokens + loaded_tokens
    device = suffix_ids.device
    if load is not None:
        _, _, _, _, h, d = load.staging.shape
    else:
        _, h, _, d = _layer_kv(front_cache, 0)[0].shape
    dtype = next(model.parameters()).dtype
    keys = [torch.empty((1, h, total, d), dtype=dtype, device=device) for _ in range(num_layers)]
    values = [torch.empty((1, h, total, d), dtype=dtype, device=device) for _ in range(num_layers)]
    if front_tokens:
        for layer in range(num_layers):
            fk, fv = _layer_kv(front_cache, layer)
            keys[layer][:, :, :front_tokens].copy_(fk[:, :, :front_tokens])
            values[layer][:, :, :front_tokens].copy_(fv[:, :, :front_tokens])
    if load is not None:
        # K/V are written on the load's consumer stream; this stream waits for each layer before using it, so
        # by the time they are freed here the writes are long done
        load.then(
            lambda layer, piece: scatter_contiguous(
                piece.unsqueeze(1), keys, values, front_tokens, range(layer, layer + 1)
            )
        )
    cache = _new_cache()
    for layer in range(num_layers):
        _install(cache, layer, keys[layer], values[layer])
    hooks = []
    decoder = _decoder_layers(model)
    if load is not None and load.stream is not None:
        if decoder is not None and len(decoder) == num_layers:
            hooks = [m.register_forward_pre_hook(lambda _m, _a, i=i: load.wait(i)) for i, m in enumerate(decoder)]
        else:  # unknown architecture: wait for everything up front
            for layer in range(num_layers):
                load.wait(layer)
    try:
        out = _forward(model, suffix_ids, cache, logits_to_keep=1)
    finally:
        for hk in hooks:
            hk.remove()
    return out.logits[:, -1], cache


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


def tiny_llama(
    seed: int = 0,
    *,
    vocab_size: int = 4096,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    intermediate_size: int = 688,
    max_position_embeddings: int = 8192,
    initializer_range: float = 0.2,
    dtype=torch.float32,
):
    """A random-weight `LlamaForCausalLM`, identical for equal arguments in every process. The large
    `initializer_range` keeps greedy outputs prompt-dependent, so output comparisons mean something."""
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype).eval()
