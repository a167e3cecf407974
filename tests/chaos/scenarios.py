"""Chaos scenarios R1-R6 against a real multi-node Ray cluster with KVNodes and a real redis-server (R6's fuzzers
are `fuzz.py`). Each drives a fault while workers use the public client API, checks every byte they get back
(`chaoskit`), and returns its figure as a dict with `ok` saying whether the goal was met. tests/integration/
test_chaos.py runs them CI-sized on the test session's cluster; bench/chaos.py runs them long on its own.

    r1_remove_node     a node removed (ray.cluster_utils remove_node) during >= 1,000 fetches
    r2_redis_restart   Redis hung (SIGSTOP), then killed and restarted empty, during traffic
    r3_corruption      bits flipped in stored chunks, read back through every path
    r4_namespaces      two models x two dtypes x two salts, the same tokens, one directory
    r5_mixed_load      64 workers storing, looking up and fetching under eviction pressure
    r6_fuzz            fuzzed wire messages (a plain KVNode, its data server, a KVNode actor) and public API calls
"""

from __future__ import annotations

import math
import os
import random
import signal
import threading
import time

import ray

from kvmesh.config import KVMeshConfig
from kvmesh.directory import Directory
from tests.chaos.chaoskit import C, hashes_of, make_spec, on, prompt, summarize


def _actors() -> dict:
    from kvmesh.mesh import node_actors

    return node_actors()


def _stats(node_id: str, actors: dict | None = None) -> dict:
    return ray.get((actors or _actors())[node_id].stats.remote(), timeout=30)


def _wait(predicate, timeout_s: float, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    return predicate()


def _found(d: Directory, spec, toks, salt=None) -> int:
    """Leading chunks of `toks` with a live holder, straight from the directory (-1 if it does not answer)."""
    from redis import RedisError

    hs = hashes_of(spec, toks, salt)
    try:
        return len(d.longest_prefix(d.lookup_raw(hs[0], hs), d.node_table()))
    except RedisError:
        return -1


# -- R1 ------------------------------------------------------------------------------------------------------------
def r1_remove_node(cluster, config: KVMeshConfig, fetches: int = 1000, threads: int = 2, prompts: int = 32,
                   graceful: bool = False, seed: int = 1, options_by_thread: list[dict] | None = None) -> dict:
    """Chunks on a node D (and prompt heads on A); a worker on B fetches them over and over; D's node is removed
    a third of the way in. Every fetch must return only the bytes stored (a failed one a shorter, intact
    prefix), none may raise or hang past its deadline, and D's incarnation must be purged from the directory
    within 2 lease periods of the removal. A crash (the default) leaves Ray to find out by its health checks, so
    the lease decides; a `graceful` removal tells Ray's GCS at once, and then the KVNodes' janitor must end D's
    lease on Ray's word, well within one lease period."""
    import kvmesh

    node = cluster.add_node(num_cpus=1)
    kvmesh.start(config=config)
    dead = node.node_id
    a, b = [n for n in cluster.node_ids() if n != dead][:2]
    spec = make_spec(f"chaos-r1-{seed}")
    ps = [prompt(seed * 1000 + i, 6) for i in range(prompts)]
    wa, wd, wb = on(a), on(dead), on(b)
    ray.get(wa.store.remote(spec, [p[:3 * C] for p in ps[::2]]), timeout=120)  # heads of half the prompts on A
    ray.get(wd.store.remote(spec, ps), timeout=120)  # the rest on D
    d_actor = _actors()[dead]
    d = Directory(config.redis_url, config.key_prefix)
    inc = {i.node_id: i.incarnation for i in d.node_table().live.values()}[dead]
    deadline_s = 2.0
    ref = wb.loop.remote(spec, ps, threads, fetches, 3600.0, deadline_s=deadline_s, seed=seed,
                         options_by_thread=options_by_thread)
    _wait(lambda: ray.get(wb.progress.remote()) >= fetches // 3, 120)
    actors = _actors()
    live = [n for n in cluster.node_ids() if n != dead]
    ray_word = sum(_stats(n, actors).get("ray_reported_dead", 0) for n in live)
    t_wall, t0 = time.time(), time.monotonic()
    cluster.remove_node(node, graceful=graceful)
    marks: dict[str, float] = {}
    lease = config.lease_s
    while time.monotonic() - t0 < 6 * lease and "purged" not in marks:
        table = d.node_table()
        now = time.monotonic() - t0
        if "not_live" not in marks and dead not in table.by_node():
            marks["not_live"] = now
        if "ray_dead" not in marks and any(n["NodeID"] == dead and not n["Alive"] for n in ray.nodes()):
            marks["ray_dead"] = now
        if (inc not in table.live and inc not in (table.dead_incarnations or {}).values()
                and not d.redis.exists(d.own_key(inc))):
            marks["purged"] = now
        time.sleep(0.05)
    _wait(lambda: ray.get(wb.progress.remote()) >= fetches, 300)
    time.sleep(0.5)  # fetches after the purge, too
    ray.get(wb.stop.remote())
    ops = ray.get(ref, timeout=120)
    left = sum(1 for p in ps for v in d.redis.hgetall(d.group_key(hashes_of(spec, p)[0])).values()
               for i, _t in d.decode_holders(v) if i == inc)
    d.close()
    try:
        ray.kill(d_actor, no_restart=True)  # its node is gone; do not leave a named actor behind
    except Exception:
        pass
    ray_word = sum(_stats(n, actors).get("ray_reported_dead", 0) for n in live) - ray_word
    after = [o for o in ops if o.t >= t_wall]
    s = summarize(ops)
    purged = marks.get("purged")
    limit = lease if graceful else 2 * lease
    return {
        "figure": "R1", "removal": "graceful" if graceful else "crash", **s, "fetches_after_removal": len(after),
        "truncated_after_removal": sum(o.got < o.want for o in after),
        "deadline_s": deadline_s, "lease_s": lease, "not_live_s": marks.get("not_live"),
        "ray_reported_dead_s": marks.get("ray_dead"), "purged_s": purged,
        "purged_in_lease_periods": purged / lease if purged is not None else None,
        "entries_left_of_removed_incarnation": left, "leases_ended_on_rays_word": ray_word,
        "goal": f"0 wrong bytes, every failed fetch truncated (none raises, none past its deadline), purged within "
                f"{limit / lease:g} lease period(s), >= {fetches} fetches",
        "ok": (s["fetches"] >= fetches and s["wrong_bytes"] == 0 and s["bad_prefixes"] == 0
               and s["errors_raised"] == 0 and s["max_fetch_s"] <= deadline_s + 1.0 and purged is not None
               and purged <= limit and left == 0 and (ray_word >= 1 or not graceful)),
    }


# -- R2 ------------------------------------------------------------------------------------------------------------
def r2_redis_restart(config: KVMeshConfig, redis_server, nodes: list[str], prompts: int = 16, cycles: int = 1,
                     hang_s: float = 2.0, down_s: float = 1.0, threads: int = 2, seed: int = 2,
                     options_by_thread: list[dict] | None = None) -> dict:
    """A worker on B looks up, fetches and stores chunks held on A while Redis first hangs (SIGSTOP) and is then
    killed and restarted empty. While it hangs or is down, lookups must come back as misses within the lookup
    deadline and stores must not block; after the restart the nodes must re-register everything within 10 s;
    and no lookup may ever name a holder that is not its node's current incarnation."""
    spec = make_spec(f"chaos-r2-{seed}")
    a, b = nodes[0], nodes[1]
    ps = [prompt(seed * 1000 + i, 4) for i in range(prompts)]
    fresh = [prompt(seed * 1000 + 500 + i, 3) for i in range(prompts)]  # stored during the run
    ray.get(on(a).store.remote(spec, ps), timeout=120)
    wb = on(b)
    ref = wb.loop.remote(spec, ps + fresh, threads, 0, 3600.0, store_share=0.2, check_stale=True, seed=seed,
                         options_by_thread=options_by_thread)
    d = Directory(config.redis_url, config.key_prefix)
    _wait(lambda: ray.get(wb.progress.remote()) >= 50, 120)  # the worker process is up and busy
    windows, rebuilt = [], []
    for _ in range(cycles):
        t = time.time()
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        time.sleep(hang_s)
        os.kill(redis_server.proc.pid, signal.SIGCONT)
        windows.append(("hung", t, time.time()))
        time.sleep(1.0)
        t = time.time()
        redis_server.kill()
        time.sleep(down_s)
        windows.append(("down", t, time.time()))
        t_up = time.monotonic()  # from the new process's launch: nodes may re-register before it is "ready"
        redis_server.start()
        done = _wait(lambda: all(_found(d, spec, p) == len(hashes_of(spec, p)) for p in ps), 30, 0.1)
        rebuilt.append(time.monotonic() - t_up if done else None)
        time.sleep(1.0)
    ray.get(wb.stop.remote())
    ops = ray.get(ref, timeout=120)
    d.close()
    s = summarize(ops)
    phases = {}
    for name, lo, hi in windows:
        inside = [o for o in ops if o.t <= hi and o.t + o.lookup_s >= lo]  # calls that overlap the window
        f = [o for o in inside if o.op == "fetch"]
        st = [o for o in inside if o.op == "store"]
        ph = phases.setdefault(name, {"lookups": 0, "hits": 0, "stores": 0, "max_lookup_s": 0.0,
                                      "max_store_s": 0.0})
        ph["lookups"] += len(f)
        ph["hits"] += sum(o.want > 0 for o in f)
        ph["stores"] += len(st)
        ph["max_lookup_s"] = max([ph["max_lookup_s"]] + [o.lookup_s for o in f])
        ph["max_store_s"] = max([ph["max_store_s"]] + [o.seconds for o in st])
    bound = config.lookup_timeout_s + 0.5  # the lookup deadline, plus scheduling slack on a loaded machine
    ok_windows = all(ph["max_lookup_s"] <= bound and ph["max_store_s"] <= bound for ph in phases.values())
    return {
        "figure": "R2", **s, "phases": phases, "rebuilt_s": rebuilt, "lookup_timeout_s": config.lookup_timeout_s,
        "goal": "directory rebuilt within 10 s of the restart, 0 stale holders, misses within the lookup deadline "
                "and stores that do not block while Redis hangs or is down",
        "ok": (all(r is not None and r <= 10 for r in rebuilt) and s["stale_holders"] == 0
               and s["wrong_bytes"] == 0 and s["errors_raised"] == 0 and ok_windows
               and all(ph["lookups"] > 0 for ph in phases.values())),
    }


# -- R3 ------------------------------------------------------------------------------------------------------------
def flip_bit(config: KVMeshConfig, node_id: str, key: bytes, offset: int, bit: int) -> bool:
    """Flip one bit of a chunk in its node's shared-memory slab, as a memory error would."""
    from kvmesh.wire import pack_keys, unpack_pin_reply

    actor = _actors()[node_id]
    pin_id, rows, path, _ = unpack_pin_reply(ray.get(actor.pin.remote(pack_keys([key]))))
    ray.get(actor.unpin.remote(pin_id))
    if not rows:
        return False
    with open(path, "r+b") as f:
        f.seek(rows[0].slot * config.slot_bytes + offset)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ bit]))
    return True


READ_PATHS = {"same-node": {}, "tcp": {}, "ray": {"peer_transport": "ray"}, "via-node": {"coalesce_pulls": True}}


def r3_corruption(config: KVMeshConfig, nodes: list[str], corruptions: int = 24, seed: int = 3) -> dict:
    """One random bit of one random chunk of each of `corruptions` prompts is flipped in its holder's slab;
    each prompt is then read once through one of the read paths (a worker on the holder's node through shared
    memory; a peer over TCP, through Ray, or through its own node). Every flipped chunk must be detected (the
    fetch stops right before it), never served, unregistered and counted by its holder."""
    spec = make_spec(f"chaos-r3-{seed}")
    rng = random.Random(seed)
    chunks = 4
    ps = [prompt(seed * 1000 + i, chunks) for i in range(corruptions)]
    holder = [nodes[i % len(nodes)] for i in range(corruptions)]
    workers = {n: on(n) for n in nodes}
    ray.get([workers[n].store.remote(spec, [p for p, h in zip(ps, holder) if h == n]) for n in nodes], timeout=120)
    actors = _actors()
    before = {n: _stats(n, actors).get("corrupt_dropped", 0) for n in nodes}
    flipped = []
    for i, p in enumerate(ps):
        j = rng.randrange(chunks)
        assert flip_bit(config, holder[i], hashes_of(spec, p)[j], rng.randrange(spec.chunk_bytes),
                        1 << rng.randrange(8)), "a stored chunk is gone: size the tiers for the corruptions asked"
        flipped.append(j)
    paths = list(READ_PATHS)
    jobs: dict[str, list] = {n: [] for n in nodes}
    index: dict[str, list] = {n: [] for n in nodes}
    for i, p in enumerate(ps):
        path = paths[i % len(paths)]
        reader = holder[i] if path == "same-node" else rng.choice([n for n in nodes if n != holder[i]])
        jobs[reader].append((p, READ_PATHS[path]))
        index[reader].append((i, path))
    reads: dict[int, tuple] = {}
    for n in nodes:
        for (i, path), op in zip(index[n], ray.get(workers[n].fetch_each.remote(spec, jobs[n]), timeout=300)):
            reads[i] = (path, op)
    d = Directory(config.redis_url, config.key_prefix)
    unregistered = _wait(lambda: all(_found(d, spec, p) == flipped[i] for i, p in enumerate(ps)), 10, 0.1)
    counted = _wait(lambda: sum(_stats(n, actors).get("corrupt_dropped", 0) - before[n] for n in nodes)
                    >= corruptions, 10, 0.2)
    dropped = sum(_stats(n, actors).get("corrupt_dropped", 0) - before[n] for n in nodes)
    d.close()
    detected = sum(1 for i, (_path, op) in reads.items() if op.got == flipped[i] and not op.error)
    served = sum(1 for i, (_path, op) in reads.items() if op.got > flipped[i] or op.wrong != 0)
    by_path = {p: sum(1 for path, _ in reads.values() if path == p) for p in paths}
    return {
        "figure": "R3", "corrupted_chunks": corruptions, "detected": detected,
        "detected_pct": 100.0 * detected / corruptions, "served_corrupt": served,
        "wrong_bytes": sum(max(op.wrong, 0) for _p, op in reads.values()),
        "errors_raised": sum(bool(op.error) for _p, op in reads.values()),
        "unregistered": bool(unregistered), "counted_by_holders": dropped, "reads_by_path": by_path,
        "goal": "100 % detected, never served, unregistered and counted",
        "ok": detected == corruptions and served == 0 and bool(unregistered) and bool(counted)
              and dropped == corruptions,
    }


# -- R4 ------------------------------------------------------------------------------------------------------------
def r4_namespaces(config: KVMeshConfig, nodes: list[str], seed: int = 4, chunks: int = 5) -> dict:
    """The same tokens stored under 2 models x 2 dtypes x 2 salts (8 namespaces, each with its own KV bytes),
    from different nodes at once; every node then reads every namespace, directly and through its own node.
    No chunk of one namespace may ever be served to another; namespaces never stored must miss."""
    specs = [make_spec(f"chaos-r4-{seed}-{m}", dt) for m in ("a", "b") for dt in ("bfloat16", "float32")]
    combos = [(s, salt) for s in specs for salt in ("tenant-1", "tenant-2")]
    toks = prompt(seed, chunks)
    workers = {n: on(n) for n in nodes}
    ray.get([workers[nodes[i % len(nodes)]].store.remote(s, [toks], salt) for i, (s, salt) in enumerate(combos)],
            timeout=120)
    refs = [(s, salt, workers[n].fetch_each.remote(s, [(toks, {}), (toks, {"coalesce_pulls": True})], salt))
            for n in nodes for s, salt in combos]
    reads = [(s, salt, op) for s, salt, r in refs for op in ray.get(r, timeout=120)]
    never = [(make_spec(f"chaos-r4-{seed}-c"), "tenant-1"), (specs[0], "tenant-3"), (specs[0], None),
             (make_spec(f"chaos-r4-{seed}-a", "float16"), "tenant-1")]
    misses = [op for s, salt in never for op in ray.get(workers[nodes[0]].fetch_each.remote(s, [(toks, {})], salt))]
    wrong_chunks = sum(1 for _s, _salt, op in reads if op.wrong != 0)
    return {
        "figure": "R4", "namespaces": len(combos), "reads": len(reads),
        "chunks_served": sum(op.got for *_x, op in reads), "cross_served_reads": wrong_chunks,
        "wrong_bytes": sum(max(op.wrong, 0) for *_x, op in reads),
        "full_hits": sum(op.got == chunks for *_x, op in reads),
        "lookups_of_unstored_namespaces": len(misses), "hits_on_unstored_namespaces": sum(o.want for o in misses),
        "errors_raised": sum(bool(op.error) for *_x, op in reads),
        "goal": "0 cross-served chunks",
        "ok": wrong_chunks == 0 and all(op.got == chunks for *_x, op in reads) and all(o.want == 0 for o in misses),
    }


# -- R5 ------------------------------------------------------------------------------------------------------------
def _rss(pids: list[int]) -> tuple[int, int]:
    """(resident, private) bytes of `pids`: private leaves out shared mappings (the slabs, Ray's object store)."""
    from kvmesh._extras import require

    psutil = require("psutil", "bench", "the chaos scenarios' memory readings")
    rss = private = 0
    for pid in pids:
        try:
            m = psutil.Process(pid).memory_info()
            rss += m.rss
            private += m.rss - m.shared
        except psutil.Error:
            pass
    return rss, private


def r5_mixed_load(config: KVMeshConfig, nodes: list[str], workers: int = 64, seconds: float = 20.0,
                  warmup_frac: float = 0.3, docs: int | None = None, suffixes: int = 4, seed: int = 5,
                  worker_growth_limit: float = 0.05) -> dict:
    """`workers` client threads (spread over one worker process per node, half of them pulling through their
    own node) store, look up and fetch prompts that share document prefixes, with a working set larger than the
    tiers: eviction runs all the time, and chunks are evicted between lookups and fetches. 0 wrong or torn
    bytes, no call raises, and afterwards every node's tiers and directory entries agree exactly (nothing held
    is unfindable, nothing findable is gone) with every chunk's checksum intact; resident memory of the KVNodes
    and workers stays within 5 % from the end of the warm-up to the end."""
    spec = make_spec(f"chaos-r5-{seed}")
    capacity = len(nodes) * config.num_slots
    if docs is None:  # a working set 1.5 times what the tiers hold: eviction all the time
        docs = math.ceil(1.5 * capacity / (4 + 2 * suffixes))
    pool = [prompt(seed * 100_000 + dd * 100 + s, 6, doc=seed * 1000 + dd, doc_chunks=4)
            for dd in range(docs) for s in range(suffixes)]
    working_set = len({h for p in pool for h in hashes_of(spec, p)})
    ws = [on(n) for n in nodes]
    pids = [ray.get(w.pid.remote()) for w in ws]
    actors = _actors()
    node_pids = [_stats(n, actors)["pid"] for n in nodes]
    ev0 = {n: _stats(n, actors).get("evictions", 0) for n in nodes}
    per = [workers // len(nodes) + (i < workers % len(nodes)) for i in range(len(nodes))]
    opts = [{}, {"coalesce_pulls": True}]
    refs = [w.loop.remote(spec, pool, k, 0, seconds, store_share=0.3, options_by_thread=opts, deadline_s=5.0,
                          seed=seed * 10 + i) for i, (w, k) in enumerate(zip(ws, per))]
    samples: list[tuple[float, int, int, int, int]] = []  # (s, KVNodes rss, private, workers rss, private)
    stop = threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        while not stop.wait(1.0):
            if time.monotonic() - t0 <= seconds:  # while the load runs (not as the workers wind down)
                samples.append((time.monotonic() - t0, *_rss(node_pids), *_rss(pids)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    ops = [o for r in refs for o in ray.get(r, timeout=seconds + 600)]
    stop.set()
    sampler.join()
    time.sleep(2 * config.heartbeat_s)  # quiet: pending directory updates drain
    integrity = {}
    for n in nodes:
        try:
            ray.get(actors[n].check_integrity.remote(True, True), timeout=60)
            integrity[n[:8]] = "ok"
        except Exception as e:  # noqa: BLE001 - report what broke
            integrity[n[:8]] = str(e).splitlines()[-1][:200]
    evictions = sum(_stats(n, actors).get("evictions", 0) - ev0[n] for n in nodes)

    def growth(col: int, frac: float = warmup_frac) -> float | None:
        """Change of a memory column from the end of the warm-up (`frac` of the run) to the end of the load."""
        warm = [x for x in samples if x[0] >= frac * seconds]
        if len(warm) < 2:
            return None
        return warm[-1][col] / warm[0][col] - 1.0

    s = summarize(ops)
    g_nodes, g_workers = growth(1), growth(3)
    warm = [x for x in samples if x[0] >= warmup_frac * seconds]
    return {
        "figure": "R5", "workers": workers, "seconds": seconds, **s,
        "truncated_by_eviction_races": s["truncated_fetches"],
        "coalesced_fetches": sum(o.coalesced for o in ops if o.op == "fetch"),
        "working_set_chunks": working_set, "capacity_chunks": capacity, "evictions": evictions,
        "integrity": integrity,
        "warmup_frac": warmup_frac,
        "rss_kvnodes_mib": [round(x[1] / 2**20, 1) for x in warm[:1] + warm[-1:]],
        "rss_workers_mib": [round(x[3] / 2**20, 1) for x in warm[:1] + warm[-1:]],
        "rss_growth_kvnodes": g_nodes, "rss_growth_workers": g_workers,
        "private_growth_kvnodes": growth(2), "private_growth_workers": growth(4),
        "rss_growth_from_30pct": [growth(1, 0.3), growth(3, 0.3)],
        "rss_series_s_kvnodes_workers_mib": [(round(x[0]), round(x[1] / 2**20), round(x[3] / 2**20))
                                            for x in samples[::max(1, len(samples) // 12)] + samples[-1:]],
        "goal": "0 lost or torn chunks; resident memory flat within 5 % (the workers' private memory: their RSS "
                "also counts the pages of the node slab each of their clients maps, which become resident as they "
                "are read, up to clients x slab size, shared and bounded)",
        "worker_growth_limit": worker_growth_limit,
        "shared_mib_workers": [round((x[3] - x[4]) / 2**20, 1) for x in warm[:1] + warm[-1:]],
        "ok": (s["wrong_bytes"] == 0 and s["bad_prefixes"] == 0 and s["errors_raised"] == 0 and evictions > 0
               and all(v == "ok" for v in integrity.values()) and g_nodes is not None
               and abs(g_nodes) <= 0.05 and abs(growth(4)) <= worker_growth_limit),
    }


# -- R6 ------------------------------------------------------------------------------------------------------------
def r6_fuzz(mesh, examples: int) -> dict:
    """Fuzzing: a KVNode as a plain class (and its data server), a KVNode actor, the public API."""
    import tempfile

    import kvmesh
    from kvmesh.actor import KVNodeActor
    from kvmesh.local import RedisServer
    from kvmesh.node import KVNode
    from tests.chaos import fuzz

    out = {"figure": "R6"}
    t0 = time.monotonic()
    with RedisServer() as rs, tempfile.TemporaryDirectory() as shm:
        node = KVNode(KVMeshConfig(redis_url=rs.url, key_prefix="fz", cpu_bytes=16 * 4096, slot_bytes=4096,
                                   lease_s=2.0, heartbeat_s=0.2, shm_dir=shm), "node-f" * 4, "kvnode-f")
        try:
            # wire messages go to the node's wire edge (what the actor runs), as in tests/integration/test_chaos.py;
            # the KVNode object's own methods take typed arguments
            out["node"] = fuzz.fuzz_node(KVNodeActor.around(node), examples, derandomize=False)
            out["data_server"] = fuzz.fuzz_data_server(node, examples // 10, derandomize=False)
            node.check_integrity(directory=True)
            out["node_integrity_after"] = "ok"
        finally:
            node.shutdown()
    out["actor"] = fuzz.fuzz_actor(_actors()[mesh.node_ids[-1]], examples // 10, derandomize=False)
    c = kvmesh.connect(make_spec("chaos-fuzz"))
    try:
        out["api"] = fuzz.fuzz_api(c, examples // 2, derandomize=False)
    finally:
        c.close()
    out["seconds"] = time.monotonic() - t0
    out["goal"] = "typed errors only; no actor crash"
    out["ok"] = True  # any other outcome raises out of the fuzzers (with hypothesis's smallest example)
    return out
