"""The chaos suite (issue 5), CI-sized, on the session's 3-node Ray cluster and KVNodes: faults injected into real
parts while workers use the public API, every byte they get back checked. The scenarios live in bench/scenarios.py
and bench/fuzz.py; bench/chaos.py runs the same ones long. Each test prints its figure (`pytest -s` shows it)."""

import json

import pytest

from bench import scenarios

pytestmark = pytest.mark.chaos


def report(result: dict) -> dict:
    print(json.dumps(result, sort_keys=True, default=str))
    return result


def test_r1_a_node_crashes_during_1000_fetches(mesh, ray_cluster):
    r = report(scenarios.r1_remove_node(ray_cluster, mesh.config, fetches=1000))
    assert r["fetches"] >= 1000 and r["fetches_after_removal"] > 0 and r["truncated_after_removal"] > 0, r
    assert r["wrong_bytes"] == 0 and r["bad_prefixes"] == 0 and r["errors_raised"] == 0, r
    assert r["max_fetch_s"] <= r["deadline_s"] + 1.0, r
    assert r["purged_s"] is not None and r["purged_s"] <= 2 * r["lease_s"], r
    assert r["entries_left_of_removed_incarnation"] == 0 and r["ok"], r


def test_r1_a_node_ray_knows_is_gone_is_purged_without_waiting_for_its_lease(mesh, ray_cluster):
    r = report(scenarios.r1_remove_node(ray_cluster, mesh.config, fetches=200, graceful=True, seed=11))
    assert r["leases_ended_on_rays_word"] >= 1, r
    assert r["purged_s"] is not None and r["purged_s"] < r["lease_s"], r
    assert r["wrong_bytes"] == 0 and r["errors_raised"] == 0 and r["ok"], r


# -- eviction races and coalescing (issue 5, item 3) -------------------------------------------------------------------
def test_a_chunk_evicted_between_lookup_and_fetch_makes_the_fetch_shorter_never_wrong(mesh):
    import ray

    from bench.chaoskit import hashes_of, make_spec, on, prompt

    a, b, _ = mesh.node_ids
    spec = make_spec("chaos-evict-race")
    toks = prompt(31, 6)
    wa, wb = on(a), on(b)
    ray.get(wa.store.remote(spec, [toks]))
    match = ray.get(wb.lookup.remote(spec, toks))
    assert match.num_chunks == 6
    # A's tier fills with other chunks: the least recently used go, this prompt's included
    flood = [prompt(3100 + i, 8) for i in range(2 * mesh.config.num_slots // 8)]
    ray.get(wa.store.remote(spec, flood))
    for options in ({}, {"peer_transport": "ray"}, {"coalesce_pulls": True}):
        op = ray.get(wb.fetch_match.remote(spec, toks, match, options))
        assert op.error == "" and op.wrong == 0 and op.got < 6, (options, op)
    assert len(hashes_of(spec, toks)) == 6


def test_concurrent_fetches_of_the_same_chunks_on_one_node_are_one_transfer(mesh):
    """Four worker processes on node B fetch the same 16 chunks from A at the same moment, pulling through
    their own node: A sends each chunk once. Without coalescing (the control, on node C) A sends it four times."""
    import time

    import ray

    from bench.chaoskit import KVSpec, on

    a, b, c = mesh.node_ids
    spec = KVSpec("chaos-coalesce", num_layers=4, num_kv_heads=4, head_dim=32, dtype="bfloat16", chunk_tokens=128)
    assert spec.chunk_bytes == mesh.config.slot_bytes  # 256 KiB chunks: a 4 MiB prompt
    toks = list(range(7, 7 + 16 * 128 + 5))
    ray.get(on(a).store.remote(spec, [toks]))
    holder = scenarios._actors()[a]
    served0 = ray.get(holder.stats.remote())["served_bytes"]
    nbytes = 16 * spec.chunk_bytes
    for reader, options, transfers in ((c, {}, 4), (b, {"coalesce_pulls": True}, 1)):  # the control first: A
        # is then the only holder either time
        ws = [on(reader) for _ in range(4)]
        ray.get([w.node_id.remote() for w in ws])  # started
        at = time.time() + 1.0
        ops = [op for r in [w.fetch_each.remote(spec, [(toks, options)], None, at) for w in ws] for op in ray.get(r)]
        assert all(op.got == 16 and op.wrong == 0 and not op.error for op in ops), ops
        served = ray.get(holder.stats.remote())["served_bytes"]
        sent = served.get(reader, 0) - served0.get(reader, 0)
        print(json.dumps({"reader": reader[:8], "options": options, "holder_sent_bytes": sent,
                          "prompt_bytes": nbytes}))
        assert sent == transfers * nbytes, (options, sent / nbytes)
    st = ray.get(scenarios._actors()[b].stats.remote())
    print(json.dumps({k: st.get(k, 0) for k in ("pull_through_calls", "pull_through_pulled_chunks",
                                                 "pull_through_waited_chunks")}))
    assert st["pull_through_pulled_chunks"] >= 16
