"""Sizing of a kvmesh directory (default: 1,000 nodes, 10^9 cached chunks), from the per-shard figures that
bench/directory.py measured on a real redis-server, and a simulation of how prompt groups and lookups spread over
the 16,384 Redis Cluster slots and the shards that own them. docs/scale.md shows and explains its output.

The simulation: groups (one per distinct first chunk) get their slot from CRC16 of their real key, like Redis
Cluster does; lookups pick groups by a Zipf popularity law (a few shared system prompts are very hot); slots are
split evenly over shards. The busiest shard, not the mean, decides how many shards lookups need, and the hottest
single group (one slot, one shard, whatever the cluster size) is reported against one shard's capacity.

Run: .venv/bin/python bench/scale.py [--directory-results bench/results/directory-<...>.json] [--nodes 1000] ...
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench.common import RESULTS, save  # noqa: E402

SLOTS = 16384
HEARTBEAT_BYTES = 230  # an EVALSHA heartbeat: sha, 3 keys, node id, incarnation, epoch, lease; and its reply


def crc16_slots(hex_groups: np.ndarray) -> np.ndarray:
    """Redis Cluster slots of keys `P:g:{<hex>}` (CRC16/XMODEM of the hash tag, mod 16384), vectorised.
    `hex_groups` is an (n, 32) uint8 array of ASCII hex digits."""
    table = np.zeros(256, dtype=np.uint16)
    for i in range(256):
        crc = i << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
        table[i] = crc & 0xFFFF
    crc = np.zeros(len(hex_groups), dtype=np.uint16)
    for j in range(hex_groups.shape[1]):
        crc = (crc << 8) ^ table[((crc >> 8) ^ hex_groups[:, j]) & 0xFF]
    return crc % SLOTS


def random_groups(n: int, seed: int) -> np.ndarray:
    raw = np.random.default_rng(seed).integers(0, 256, (n, 16), dtype=np.uint8)
    digits = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    return np.stack([digits[raw >> 4], digits[raw & 15]], axis=2).reshape(n, 32)


def busiest_shard_share(groups: int, shards: int, zipf_s: float, exact: int, seed: int) -> tuple[float, float]:
    """(share of all lookups on the busiest shard, share of the single hottest group) when `groups` groups are
    looked up with Zipf(zipf_s) popularity: the `exact` most popular groups are placed by their real CRC16 slot,
    the rest (a thin tail) spread as their mean."""
    ranks = np.arange(1, exact + 1, dtype=np.float64)
    head = ranks ** -zipf_s
    if groups > exact:  # the tail's mass: sum of k^-s for k in (exact, groups], by the integral
        tail = ((groups ** (1 - zipf_s) - exact ** (1 - zipf_s)) / (1 - zipf_s) if zipf_s != 1
                else math.log(groups / exact))
    else:
        tail = 0.0
    total = head.sum() + tail
    slots = crc16_slots(random_groups(exact, seed))
    per_slot = np.bincount(slots, weights=head / total, minlength=SLOTS) + tail / total / SLOTS
    bounds = np.linspace(0, SLOTS, shards + 1).astype(int)
    per_shard = np.add.reduceat(per_slot, bounds[:-1])
    return float(per_shard.max()), float(head[0] / total)


def interpolate(by_chunks: dict, n: float) -> float:
    """A measured rate at a prompt length, log-log between the lengths measured."""
    xs = sorted(int(k) for k in by_chunks)  # (JSON keys: strings)
    ys = [by_chunks[str(x)]["lookups_per_s"] for x in xs]
    return float(np.exp(np.interp(np.log(n), np.log(xs), np.log(ys))))


def latest_directory_results() -> str:
    files = sorted(glob.glob(str(RESULTS / "directory-2*.json")))  # (not directory-listpack-*)
    if not files:
        raise SystemExit("no bench/results/directory-*.json: run bench/directory.py first")
    return files[-1]


def size(a, d: dict) -> dict:
    server = d["by_server"][a.server] if a.server else next(
        (s for s in d["by_server"].values() if s["P6_large_groups"]["mem_allocator"].startswith("jemalloc")),
        next(iter(d["by_server"].values())))
    large, small, node = server["P6_large_groups"], server["P6_small_groups"], server["N"]
    frag = max(large["mem_fragmentation_ratio"] or 1.0, 1.0)
    out: dict = {"server": large["redis_version"], "mem_allocator": large["mem_allocator"]}

    # -- memory ---------------------------------------------------------------------------------------------------
    def used(p6):
        first = a.chunks * (p6["bytes_per_entry"] + p6["own_index_bytes_per_entry"])
        return first + a.chunks * (a.holders - 1) * max(p6["bytes_per_extra_holder_entry"], 0)

    used_hi, used_lo = used(large), used(small)
    per_shard = a.shard_ram_gib * 2**30 * a.max_fill
    out["memory"] = {
        "entries": a.chunks * a.holders, "used_bytes_large_groups": used_hi, "used_bytes_small_groups": used_lo,
        "rss_bytes_large_groups": used_hi * frag, "fragmentation": frag,
        "shards": math.ceil(used_hi * frag / per_shard), "usable_bytes_per_shard": per_shard}

    # -- lookups ----------------------------------------------------------------------------------------------------
    rate = a.nodes * a.gpus_per_node * a.requests_per_gpu_s
    cap = interpolate(server["L"]["by_prompt_chunks"], a.prompt_chunks) * a.core_speedup
    groups = int(a.chunks / a.prompt_chunks)
    need = None
    rows = []
    for shards in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128):
        share, hottest = busiest_shard_share(groups, shards, a.zipf_s, a.exact_groups, a.seed)
        rows.append({"shards": shards, "busiest_shard_lookups_per_s": share * rate,
                     "busiest_vs_mean": share * shards, "utilization": share * rate / cap})
        if need is None and share * rate <= a.target_util * cap:
            need = shards
    out["lookups"] = {"lookups_per_s": rate, "groups": groups, "capacity_per_shard": cap,
                      "shards": need, "hottest_group_lookups_per_s": hottest * rate,
                      "hottest_group_vs_shard": hottest * rate / cap, "by_shards": rows}

    # -- writes: each request's new chunks are registered in one script call, and unregistered in one when evicted
    # calls/s, 4 chunks each, measured: registers that change the group (each clears its summaries), where measured
    reg_cap = server["L"].get("register_4_chunks_changing_per_s", server["L"]["register_4_chunks_per_s"]) * a.core_speedup
    calls = rate * 2 * max(1.0, a.new_chunks_per_request / 4)
    out["writes"] = {"script_calls_per_s": calls, "entries_per_s": rate * a.new_chunks_per_request * 2,
                     "measured_calls_per_s_per_shard": reg_cap,
                     "shards": math.ceil(calls / (a.target_util * reg_cap))}

    # -- the node keys: one slot ({n}), so one shard, whatever the cluster's size ----------------------------------
    hb = a.nodes / a.heartbeat_s
    readers = a.nodes * (a.gpus_per_node + 1)  # every worker's client, and the KVNode itself
    reads = readers / a.node_refresh_s
    scale_nodes = 1000 / a.nodes  # the measured table had 1,000 nodes; a read's cost grows with the node count
    table_reads_cap = node["node_table_reads_per_s"] * scale_nodes * a.core_speedup
    hb_util = hb / (node["heartbeats_per_s"] * a.core_speedup) + 2 * hb / (node["get_per_s"] * a.core_speedup)
    # (a gated read: the leases that lapse soon, the rows only on a membership change; named so since 2026-12-05)
    lapsed_cap = node.get("node_table_gated_reads_per_s", node.get("proposed_lapsed_reads_per_s")) * a.core_speedup

    def proposed(n_readers: float) -> float:  # "which leases lapsed?" each refresh; the table on changes only
        return (n_readers / a.node_refresh_s / lapsed_cap
                + n_readers * a.membership_changes_per_s / table_reads_cap)

    out["node_keys"] = {
        "heartbeats_per_s": hb, "heartbeat_bytes_per_s": hb * HEARTBEAT_BYTES,
        "heartbeat_and_janitor_utilization": hb_util,
        "node_table_reads_per_s": reads, "node_table_payload_bytes": node["node_table_payload_bytes"] / scale_nodes,
        "node_table_bytes_per_s": reads * node["node_table_payload_bytes"] / scale_nodes,
        "node_table_utilization_today": reads / table_reads_cap,
        "node_table_utilization_proposed_per_client": proposed(readers),
        "node_table_utilization_proposed_per_node": proposed(a.nodes),
        "node_refresh_s_for_half_a_shard_today": readers / (0.5 * table_reads_cap),
    }
    out["shards"] = max(out["memory"]["shards"], out["lookups"]["shards"] or 10**9, out["writes"]["shards"])
    return out


def table(a, s: dict) -> str:
    m, lk, w, n = s["memory"], s["lookups"], s["writes"], s["node_keys"]
    gib = 2**30
    rows = [
        ("Redis server measured", f"{s['server']} ({s['mem_allocator']}), this 2-core box x{a.core_speedup:g}"),
        ("(chunk, holder) entries", f"{m['entries']:.3g} ({a.chunks:.3g} chunks x {a.holders:g} holders)"),
        ("directory memory (used)", f"{m['used_bytes_large_groups'] / gib:,.0f} GiB with large groups, "
                                    f"{m['used_bytes_small_groups'] / gib:,.0f} GiB with small ones"),
        ("directory memory (RSS)", f"{m['rss_bytes_large_groups'] / gib:,.0f} GiB (fragmentation {m['fragmentation']:.2f})"),
        ("shards for memory", f"{m['shards']} of {a.shard_ram_gib:g} GiB at {a.max_fill:.0%} fill"),
        ("lookups/s", f"{lk['lookups_per_s']:,.0f} ({a.nodes} nodes x {a.gpus_per_node} GPUs x "
                      f"{a.requests_per_gpu_s:g} requests/s), {a.prompt_chunks}-chunk prompts"),
        ("lookup capacity per shard", f"{lk['capacity_per_shard']:,.0f}/s"),
        ("shards for lookups", f"{lk['shards']} (busiest shard <= {a.target_util:.0%}, Zipf s={a.zipf_s:g} over "
                               f"{lk['groups']:.3g} groups)"),
        ("hottest single group", f"{lk['hottest_group_lookups_per_s']:,.0f} lookups/s = "
                                 f"{lk['hottest_group_vs_shard']:.0%} of one shard"),
        ("directory writes", f"{w['script_calls_per_s']:,.0f} register/unregister calls/s "
                             f"({w['entries_per_s']:,.0f} entries/s) -> {w['shards']} shard(s)"),
        ("heartbeats", f"{n['heartbeats_per_s']:,.0f}/s, {n['heartbeat_bytes_per_s'] / 1e3:,.0f} kB/s, "
                       f"{n['heartbeat_and_janitor_utilization']:.1%} of the node-keys shard"),
        ("node-table reads (today)", f"{n['node_table_reads_per_s']:,.0f}/s of {n['node_table_payload_bytes'] / 1e3:,.0f}"
                                     f" kB = {n['node_table_bytes_per_s'] / 1e9:,.1f} GB/s, "
                                     f"{n['node_table_utilization_today']:.0f}x one shard"),
        ("node-table reads, proposed: lapsed set", f"{n['node_table_utilization_proposed_per_client']:.0%} of one "
                                                   f"shard (every client still reads)"),
        ("... and one reader per node", f"{n['node_table_utilization_proposed_per_node']:.0%} of one shard (the KVNode "
                                        f"relays the table to its clients)"),
        ("shards (total)", f"{s['shards']}, plus a replica each for failover"),
    ]
    w0 = max(len(r[0]) for r in rows)
    return "\n".join([f"| {'quantity':<{w0}} | value |", f"|{'-' * (w0 + 2)}|-------|"]
                     + [f"| {k:<{w0}} | {v} |" for k, v in rows])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--directory-results", default=None, help="default: the latest bench/results/directory-*.json")
    p.add_argument("--server", default=None, help="which measured Redis version to size with (default: jemalloc)")
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--chunks", type=float, default=1e9)
    p.add_argument("--holders", type=float, default=1.2, help="mean holders per chunk (replicas from pulls)")
    p.add_argument("--prompt-chunks", type=int, default=64, help="mean chunks per prompt group (16k tokens)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--requests-per-gpu-s", type=float, default=4.0)
    p.add_argument("--new-chunks-per-request", type=float, default=4.0)
    p.add_argument("--zipf-s", type=float, default=1.0)
    p.add_argument("--exact-groups", type=int, default=1_000_000, help="groups placed by their real slot")
    p.add_argument("--shard-ram-gib", type=float, default=32.0)
    p.add_argument("--max-fill", type=float, default=0.6)
    p.add_argument("--target-util", type=float, default=0.5)
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--node-refresh-s", type=float, default=0.5)
    p.add_argument("--membership-changes-per-s", type=float, default=1 / 60)
    p.add_argument("--core-speedup", type=float, default=1.0,
                   help="server core speed relative to this shared 2-core box (1: use the figures as measured)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    path = a.directory_results or latest_directory_results()
    with open(path) as f:
        d = json.load(f)
    s = size(a, d)
    md = table(a, s)
    print(md)
    save("scale", {"directory_results": os.path.basename(path), "assumptions": vars(a), "sizing": s,
                   "table_markdown": md})


if __name__ == "__main__":
    main()
