"""One real SGLang engine (CPU, HiCache with kvmesh as its L3 backend), driven line by line by a test.

    python engine_driver.py MODEL_DIR EXTRA_CONFIG_JSON [ENGINE_ARGS_JSON]

(ENGINE_ARGS_JSON: sgl.Engine keyword arguments that replace the defaults below, e.g. a smaller pool)

reads JSON commands on stdin, one per line, and answers each with one line `REPLY <json>` on stdout:

    {"op": "generate", "input_ids": [...], "max_new_tokens": 8}
        -> {"ids": [...], "cached": {"device": d, "host": h, "storage": s, ...}, "prompt_tokens": n}
    {"op": "generate", "batch": [[...], ...], "sampling_params": {...}, "return_logprob": true, ...}
        -> {"outs": [<reply as above, with "logprobs": [...] where asked>, ...]}: one engine call (one batch)
    {"op": "update_weights", "model_path": DIR} -> {"ok": true, ...}   SGLang's update_weights_from_disk (which
                                          flushes its tiers after)
    {"op": "flush"}   -> {"ok": true}     SGLang's flush_cache(): empties its GPU (here: device) and host tiers
                                          (once SGLang is idle, as "settle" waits for: up to 150 s)
    {"op": "settle"}  -> {"ok": true}     waits (up to 150 s) until SGLang is idle: no request and no HiCache
                                          transfer in flight, its backups to storage included (flushes nothing)
    {"op": "quit"}    -> {"ok": true}     shuts the engine down and exits

The engine's scheduler process builds the backend: it joins the Ray cluster at $RAY_ADDRESS and uses the KVNode of
$KVMESH_RAY_NODE_ID as its local node. The CPU shims come from PYTHONPATH (tests/sglang/shims), set by the test.
"""

import json
import os
import sys
import time
import traceback


def main() -> None:
    model_dir, extra = sys.argv[1], sys.argv[2]
    overrides = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    import sglang as sgl

    args = dict(
        model_path=model_dir, device="cpu", attention_backend="torch_native", dtype="bfloat16", page_size=16,
        max_total_tokens=4096, disable_cuda_graph=True, skip_server_warmup=True, random_seed=0,
        enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_io_backend="direct",
        hicache_mem_layout="layer_first", hicache_write_policy="write_through",
        hicache_storage_prefetch_policy="wait_complete", hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=extra, log_level="warning")
    engine = sgl.Engine(**{**args, **overrides})
    print("REPLY " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            engine.shutdown()
            print("REPLY " + json.dumps({"ok": True}), flush=True)
            return
        try:
            reply = serve(engine, cmd)
        except Exception as e:  # (e.g. SGLang aborting a request it has no room for: the test sees why, the
            # engine stays up for the next command and for a clean shutdown)
            traceback.print_exc()
            reply = {"error": f"{type(e).__name__}: {e}"}
        print("REPLY " + json.dumps(reply), flush=True)


def serve(engine, cmd: dict) -> dict:
    op = cmd["op"]
    if op == "generate" and "batch" in cmd:
        params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True, **cmd.get("sampling_params", {})}
        kw = {k: cmd[k] for k in ("return_logprob", "logprob_start_len", "top_logprobs_num") if k in cmd}
        outs = engine.generate(input_ids=cmd["batch"], sampling_params=params, **kw)
        reply = {"outs": [summary(o) for o in (outs if isinstance(outs, list) else [outs])]}
    elif op == "generate":
        out = engine.generate(input_ids=cmd["input_ids"],
                              sampling_params={"temperature": 0, "max_new_tokens": cmd.get("max_new_tokens", 8),
                                               "ignore_eos": True})
        meta = out["meta_info"]
        cached = meta.get("cached_tokens_details") or {}
        reply = {"ids": out["output_ids"], "cached": {k: v for k, v in dict(cached).items()
                                                      if isinstance(v, (int, float))},
                 "cached_tokens": meta.get("cached_tokens"), "prompt_tokens": meta.get("prompt_tokens")}
    elif op == "flush":
        reply = {"ok": flush(engine)}
    elif op == "settle":
        reply = {"ok": settle(engine)}
    elif op == "update_weights":  # SGLang's update_weights_from_disk (it flushes its own tiers after)
        out = engine.update_weights_from_disk(cmd["model_path"])
        ok, message = (out[0], out[1]) if isinstance(out, tuple) else (out.get("success"), out.get("message"))
        if not ok and "not flushed" in str(message):  # (updated; the flush after it met a scheduler not idle
            ok = flush(engine)  # yet, as a flush right after a generate can: flushed as "flush" does)
        reply = {"ok": bool(ok), "message": str(message)}
    else:
        reply = {"error": f"unknown op {op!r}"}
    return reply


def flush(engine, timeout_s: float = 150) -> bool:
    # SGLang refuses a flush until its scheduler has gone idle, which can be a moment after a generate returned
    # (its last batch is cleared on the next loop; with write-back, after its backups to storage are done too,
    # which a slow store can keep going for long): wait for that, and ask again for a while, as a user would
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if settle(engine, deadline - time.monotonic()) and engine.flush_cache().success:
            return True
        time.sleep(0.2)
    return False


def settle(engine, timeout_s: float = 150) -> bool:
    # (the shim's scheduler method raises while SGLang is busy; collective_rpc asserts that it did not)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            engine.collective_rpc("kvmesh_test_raise_unless_idle")
            return True
        except AssertionError:  # (SGLang logs each refusal: "Failed to call rpc")
            time.sleep(0.5)
    return False


def summary(out: dict) -> dict:
    meta = out["meta_info"]
    cached = meta.get("cached_tokens_details") or {}
    reply = {"ids": out["output_ids"], "cached": {k: v for k, v in dict(cached).items() if isinstance(v, (int, float))},
             "cached_tokens": meta.get("cached_tokens"), "prompt_tokens": meta.get("prompt_tokens")}
    for k in ("input_token_logprobs", "output_token_logprobs"):
        if meta.get(k) is not None:
            reply[k] = [[x[0], x[1]] for x in meta[k]]  # (logprob, token id)
    return reply


if __name__ == "__main__":
    main()
