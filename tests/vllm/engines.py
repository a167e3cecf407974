"""Test harness: a tiny random-weight Llama on disk, and real vLLM engines as Ray actors pinned to nodes.

Each engine is `Engine` in its own Ray actor process (VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's scheduler and
worker, and so both halves of the connector, run in that process, which is connected to the cluster and uses its
node's KVNode). Every cache vLLM, torch and the tokenizer stack write goes under the test's work directory.
"""

from __future__ import annotations

import os
import random

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 4096
MAX_LEN = 2048
CONNECTOR = {"kv_connector": "KVMeshConnector", "kv_connector_module_path": "kvmesh.integrations.vllm",
             "kv_role": "kv_both"}


def make_model(out: str, seed: int = 0, arch: str = "llama", window: int = 300) -> str:
    """A random-weight model (2 KV heads of 64), bf16, saved where vLLM and transformers load it: "llama" (2
    layers), "mistral" (2 layers, all with a sliding window of `window` tokens) or "gemma2" (4 layers, even ones
    sliding-window, odd ones full attention). initializer_range 0.1 keeps greedy outputs prompt-dependent, so
    "identical outputs" means something (Gemma 2 scales its tied embeddings by sqrt(hidden_size): at that size
    they drown the layers, and the model repeats the last prompt token whatever came before, so they are scaled
    back here)."""
    import torch
    import transformers as tf

    common = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  vocab_size=VOCAB, max_position_embeddings=MAX_LEN, initializer_range=0.1, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        common.pop("head_dim")
        cfg, cls = tf.LlamaConfig(num_hidden_layers=2, **common), tf.LlamaForCausalLM
    elif arch == "mistral":
        cfg, cls = tf.MistralConfig(num_hidden_layers=2, sliding_window=window, **common), tf.MistralForCausalLM
    elif arch == "gemma2":  # vLLM's Gemma 2 always ties its embeddings
        cfg = tf.Gemma2Config(num_hidden_layers=4, sliding_window=window, query_pre_attn_scalar=64, pad_token_id=0,
                              **{**common, "tie_word_embeddings": True})
        cls = tf.Gemma2ForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
    if arch == "gemma2":
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(cfg.hidden_size ** -0.5)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def engine_env(workdir: str) -> dict[str, str]:
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": os.path.join(workdir, "vllm-cache"), "XDG_CACHE_HOME": os.path.join(workdir, "xdg"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(workdir, "inductor"), "TMPDIR": workdir,
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": REPO}


class Engine:
    """One vLLM engine (in this process), driven by the test through Ray."""

    def __init__(self, model_dir: str, dtype: str = "bfloat16", kvmesh: dict | None = None,
                 block_size: int | None = None, format_version: int | None = None,
                 connector: dict | None = None, llm_kw: dict | None = None) -> None:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        from vllm import LLM

        if format_version is not None:  # this engine's connector writes chunks as a later kvmesh version would
            import kvmesh.integrations.vllm as kvmesh_vllm

            kvmesh_vllm.VLLM_FORMAT_VERSION = format_version
        kw = {"block_size": block_size} if block_size else {}
        kw.update(llm_kw or {})
        if kvmesh is not None:
            kw["kv_transfer_config"] = {**CONNECTOR, "kv_connector_extra_config": kvmesh}
        if connector is not None:  # another KV transfer config altogether
            kw["kv_transfer_config"] = connector
        self.llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=dtype, max_model_len=MAX_LEN,
                       enforce_eager=True, disable_log_stats=False, kv_cache_memory_bytes=64 << 20, seed=0, **kw)

    def generate(self, prompts: list[list[int]], max_tokens: int = 8, recompute: bool = False,
                 cache_salt: str | None = None, logprobs: int | None = None) -> list[dict]:
        """Greedy outputs; `recompute` bypasses every prefix cache (vLLM's own and kvmesh). `logprobs`: each step's
        best `logprobs` tokens too (`"logprobs"`: per step, [(token, logprob)] best first)."""
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                            skip_reading_prefix_cache=True if recompute else None, logprobs=logprobs)
        salt = {"cache_salt": cache_salt} if cache_salt else {}
        outs = self.llm.generate([{"prompt_token_ids": p, **salt} for p in prompts], sp, use_tqdm=False)
        return [{"ids": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
                 **({"logprobs": [sorted(((t, x.logprob) for t, x in e.items()), key=lambda tx: -tx[1])
                                  for e in o.outputs[0].logprobs]} if logprobs else {})} for o in outs]

    def run(self, prompts: list[list[int]], sampling: dict, abort_after: dict[int, int] | None = None,
            cache_salt: str | None = None) -> list[dict | None]:
        """Outputs of `prompts` under `SamplingParams(**sampling)`, stepping the engine here: every completion's
        token ids (and its logprobs, if asked for), the prompt logprobs (if asked for), the cached tokens. Prompt
        i is aborted after `abort_after[i]` engine steps (its output None)."""
        from vllm import SamplingParams

        def lp(entries):  # [{token: Logprob}] -> [[(token, logprob)]], None for a position without any
            return [None if e is None else sorted((t, round(x.logprob, 4)) for t, x in e.items())
                    for e in entries] if entries is not None else None

        engine, abort_after = self.llm.llm_engine, abort_after or {}
        salt = {"cache_salt": cache_salt} if cache_salt else {}
        base = f"run{id(prompts)}-{len(prompts)}-"
        for i, p in enumerate(prompts):
            engine.add_request(f"{base}{i}", {"prompt_token_ids": p, **salt}, SamplingParams(detokenize=False,
                                                                                          **sampling))
        done: dict[int, dict] = {}
        steps = 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[int(o.request_id[len(base):])] = {
                        "outs": [{"ids": list(c.token_ids), "logprobs": lp(c.logprobs)} for c in o.outputs],
                        "prompt_logprobs": lp(o.prompt_logprobs), "cached": o.num_cached_tokens}
            steps += 1
            gone = [f"{base}{i}" for i, k in abort_after.items() if k == steps and i not in done]
            if gone:
                engine.abort_request(gone)
        return [done.get(i) for i in range(len(prompts))]

    def prompt_tokens_by_source(self) -> dict[str, int]:
        return {m.labels["source"]: int(m.value) for m in self.llm.get_metrics()
                if m.name == "vllm:prompt_tokens_by_source"}

    def metric(self, name: str) -> float:
        return sum(getattr(m, "value", 0) for m in self.llm.get_metrics() if m.name == name)

    def counts(self) -> dict[str, dict[str, int]]:
        """The connector's counters: its scheduler side and its worker side."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        sched = self.llm.llm_engine.engine_core.engine_core.scheduler.connector
        return {"scheduler": dict(sched.counts) if sched is not None else {},
                "worker": dict(get_kv_transfer_group().counts) if has_kv_transfer_group() else {}}

    def _tier(self):
        connector = self.llm.llm_engine.engine_core.engine_core.scheduler.connector
        return connector.connector_scheduler.manager.secondary_tiers[0]

    def tier_counts(self) -> dict[str, int]:
        """The counters of KVMeshTier, when this engine runs vLLM's OffloadingConnector with it."""
        return dict(self._tier().counts)

    def tier_settle(self) -> int:
        """Wait until the tier's jobs are done and the node registered what they stored."""
        tier = self._tier()
        tier.drain_jobs()
        return tier.client.flush()

    def kvmesh_spec(self) -> bytes:
        """The connector's KVSpec (canonical bytes), for the test to look chunks up under it."""
        return self.llm.llm_engine.engine_core.engine_core.scheduler.connector.spec.canonical_bytes()

    def kvmesh_specs(self) -> list[bytes]:
        """The connector's spec of each KV cache group (canonical bytes)."""
        return [s.canonical_bytes() for s in self.llm.llm_engine.engine_core.engine_core.scheduler.connector.specs]

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


def start_engine(node_id: str, workdir: str, model_dir: str, **kw):
    """An `Engine` actor on Ray node `node_id` (hard affinity); construction runs in the background."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(Engine).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        runtime_env={"env_vars": engine_env(workdir)}).remote(model_dir, **kw)


def delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def corrupt_in_slab(node_id: str, key: bytes, slot_bytes: int) -> None:
    """Flip a byte of chunk `key` in the node's shared-memory slab, as a memory error would."""
    import ray

    from kvmesh.mesh import node_actors
    from kvmesh.wire import pack_keys, unpack_pin_reply

    actor = node_actors()[node_id]
    pin_id, rows, path, _ = unpack_pin_reply(ray.get(actor.pin.remote(pack_keys([key]))))
    ray.get(actor.unpin.remote(pin_id))
    assert len(rows) == 1, "the chunk is not in the node's slab"
    with open(path, "r+b") as f:
        f.seek(rows[0].slot * slot_bytes + 1000)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))


# Two computations of the same KV in bfloat16 agree to a few ulps, not to the bit: the kernels of one CPU may round
# a prompt's KV differently with its length or batch (those of this machine on 2026-12-07 did; earlier ones did
# not). A greedy step whose two best tokens lie closer than that can go either way.
LOGPROB_TOL = 0.05


def close_logprobs(a, b, tol: float = LOGPROB_TOL) -> bool:
    """Two lists of [(token, logprob)] per position (None where a position has none), as `Engine.run` gives them:
    the same tokens at every position, their logprobs within `tol`."""
    if a is None or b is None:
        return a is b
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is None or y is None:
            if x is not y:
                return False
        elif [t for t, _ in x] != [t for t, _ in y] or any(abs(p - q) > tol for (_, p), (_, q) in zip(x, y)):
            return False
    return True


def greedy_agrees(ids: list[int], ref: dict, tol: float = LOGPROB_TOL) -> bool:
    """`ids` are the reference's greedy tokens (`ref` from `generate(..., logprobs=2)`), or the same up to a step
    where the reference's two best tokens were within `tol` of each other and `ids` took the other one: a near-tie
    that a few ulps decide, not another prefix's KV (which changes the first tokens, and by far more)."""
    for k, (t, want) in enumerate(zip(ids, ref["ids"])):
        if t != want:
            best = ref["logprobs"][k]
            return len(best) >= 2 and best[0][1] - best[1][1] <= tol and t == best[1][0]
    return len(ids) == len(ref["ids"])
