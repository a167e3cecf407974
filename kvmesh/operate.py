"""`kvmesh up / status / down`: running kvmesh by hand.

`up` without `--address` starts a local kvmesh on this machine in a background supervisor process (an embedded
redis-server, a Ray cluster of N raylets on 127.0.0.1, a KVNode on each, the live page) and records where it is
in a state file; `down` stops it. With `--address` it joins an existing Ray cluster instead: KVNodes on every
node and the live page in a detached actor, all of which outlive the command. `status` reads the directory
(Redis only, no Ray connection needed) and prints the nodes, their tiers and the hit rate.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvmesh.config import redact_url
from kvmesh.raybootstrap import init_ray

MiB = 1 << 20


def state_dir() -> Path:
    return Path(os.environ.get("KVMESH_STATE_DIR") or Path.home() / ".kvmesh")


def state_file() -> Path:
    return state_dir() / "up.json"


def read_state() -> dict | None:
    try:
        return json.loads(state_file().read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# -- up ------------------------------------------------------------------------------------------------------------
def up_local(
    config_path: str | None, nodes: int, port: int, timeout_s: float = 180.0, out=print, host: str = "127.0.0.1"
) -> int:
    from kvmesh.config import KVMeshConfig
    from kvmesh.local import redis_server_binary

    KVMeshConfig.load(config_path)  # bad options fail here, in one line, not in the background
    redis_server_binary()  # and so does a missing redis-server (kvmesh[local])
    st = read_state()
    if st and _alive(st["pid"]):
        out(
            f"kvmesh is already up (pid {st['pid']}): ray {st['ray_address']}, redis {redact_url(st['redis_url'])}, "
            f"live page {st['dashboard_url']}"
        )
        return 0
    state_dir().mkdir(parents=True, exist_ok=True)
    state_file().unlink(missing_ok=True)
    log = open(state_dir() / "up.log", "w")
    cmd = [sys.executable, "-m", "kvmesh.cli", "_supervise", "--nodes", str(nodes), "--port", str(port), "--host", host]
    if config_path:
        cmd += ["--config", config_path]
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
    )  # outlives this command
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = read_state()
        if st:
            out(
                f"kvmesh is up: {len(st['nodes'])} node(s)\n  ray address  {st['ray_address']}\n"
                f"  redis        {redact_url(st['redis_url'])}\n  live page    {st['dashboard_url']}\n"
                f'  workers: ray.init(address="{st["ray_address"]}"); kvmesh.connect(spec)\n'
                f"  stop with: kvmesh down"
            )
            return 0
        if proc.poll() is not None:
            out(f"kvmesh up failed (exit {proc.returncode}); see {state_dir() / 'up.log'}")
            return 1
        time.sleep(0.5)
    out(f"kvmesh up timed out after {timeout_s:.0f} s; see {state_dir() / 'up.log'}")
    proc.terminate()
    return 1


def supervise(config_path: str | None, nodes: int, port: int, host: str = "127.0.0.1") -> int:
    """The background process of `kvmesh up`: owns every process it starts and stops them on SIGTERM."""
    import threading

    import kvmesh
    from kvmesh.config import KVMeshConfig
    from kvmesh.dashboard import Dashboard
    from kvmesh.local import LocalRayCluster, RedisServer

    stop = threading.Event()
    cfg = KVMeshConfig.load(config_path)
    redis_server = RedisServer()
    cluster = dash = None
    try:
        cluster = LocalRayCluster(nodes)
        # after ray.init, which installs a SIGTERM handler of its own that would end us without cleaning up
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        mesh = kvmesh.start(config=cfg.replace(redis_url=redis_server.url))
        dash = Dashboard(redis_server.url, cfg.key_prefix, host=host, port=port).start()
        state = {
            "pid": os.getpid(),
            "ray_address": cluster.address,
            "redis_url": redis_server.url,
            "key_prefix": cfg.key_prefix,
            "dashboard_url": dash.url,
            "nodes": mesh.node_ids,
            "started": time.time(),
        }
        tmp = state_file().with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(state_file())
        print(f"kvmesh up: {state}", flush=True)
        stop.wait()
        return 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        state_file().unlink(missing_ok=True)
        if dash:
            dash.stop()
        try:
            if cluster:
                kvmesh.stop()
        finally:
            if cluster:
                cluster.shutdown()
            redis_server.stop()


class DashboardActor:
    """The live page inside a Ray cluster (for `kvmesh up --address`)."""

    def __init__(self, redis_url: str, key_prefix: str, host: str, port: int) -> None:
        from kvmesh.dashboard import Dashboard

        self.dash = Dashboard(redis_url, key_prefix, host=host, port=port).start()

    def url(self) -> str:
        return self.dash.url


def up_join(address: str, config_path: str | None, redis_url: str | None, host: str, port: int, out=print) -> int:
    import ray

    import kvmesh
    from kvmesh.config import KVMeshConfig

    cfg = KVMeshConfig.load(config_path)
    if redis_url:
        cfg = cfg.replace(redis_url=redis_url)
    init_ray(address, "kvmesh")
    mesh = kvmesh.start(config=cfg)
    actor = ray.remote(DashboardActor).options(
        name="kvmesh-dashboard", namespace="kvmesh", lifetime="detached", get_if_exists=True, num_cpus=0
    )
    actor = actor.remote(cfg.redis_url, cfg.key_prefix, host, port)
    url = ray.get(actor.url.remote(), timeout=60)
    out(
        f"kvmesh is up on {address}: {len(mesh.nodes)} KVNode(s), directory {redact_url(cfg.redis_url)}\n"
        f"  live page  {url}"
    )
    return 0


# -- status --------------------------------------------------------------------------------------------------------
def status(redis_url: str | None, key_prefix: str | None, out=print) -> int:
    import redis

    from kvmesh.config import KVMeshConfig
    from kvmesh.dashboard import Dashboard
    from kvmesh.directory import DirectoryUnavailable, probe

    st = read_state()
    url = redis_url or os.environ.get("KVMESH_REDIS_URL") or (st or {}).get("redis_url")
    prefix = key_prefix or os.environ.get("KVMESH_KEY_PREFIX") or (st or {}).get("key_prefix") or "kvmesh"
    if not url:
        out("kvmesh status: no kvmesh is up on this machine (kvmesh up), and no --redis-url was given")
        return 1
    try:  # the cause, in the words connect() and start() use
        probe(url, KVMeshConfig.load().lease_s)
    except DirectoryUnavailable as e:
        out(f"kvmesh status: {e}")
        return 1
    try:
        dash = Dashboard(url, prefix)
        dash._sample()
        s = dash.state()
        advice = dash.directory.encoding_advice()
        dash.stop()
    except (redis.RedisError, OSError) as e:
        out(f"kvmesh status: no kvmesh directory reachable at {redact_url(url)} ({e})")
        return 1
    if s.get("error"):
        out(f"kvmesh status: {s['error']}")
        return 1
    rows = [("node", "state", "incarnation", "tiers (used / capacity, chunks of slots)")]
    for n in s["nodes"]:
        tiers = ", ".join(
            f"{t['tier']} {t['used_bytes'] / MiB:.0f}/{t['capacity_bytes'] / MiB:.0f} MiB "
            f"({t['chunks']}{'/' + str(t['slots']) if 'slots' in t else ''})"
            for t in n.get("tiers", [])
        )
        rows.append(
            (n["node_id"][:12], "alive" if n["alive"] else "dead", str(n.get("incarnation") or "-"), tiers or "-")
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        out("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    hr = "-" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f} %"
    share = "-" if s["reuse_fraction"] is None else f"{100 * s['reuse_fraction']:.1f} %"
    out(
        f"lookups {s['lookups']}, hit rate {hr}; prompt tokens reused {s['reused_tokens']} ({share}), "
        f"recomputed {s['recomputed_tokens']}"
    )
    if s["misses"]:
        out("misses: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sorted(s["misses"].items())))
    if advice:
        out(advice)
    return 0


# -- down ----------------------------------------------------------------------------------------------------------
def down(address: str | None, out=print) -> int:
    if address:
        import ray

        import kvmesh

        init_ray(address, "kvmesh")
        n = kvmesh.stop()
        try:
            ray.kill(ray.get_actor("kvmesh-dashboard", namespace="kvmesh"))
        except ValueError:
            pass
        out(f"kvmesh down: removed {n} KVNode(s) and the live page from {address}")
        return 0
    st = read_state()
    if not st or not _alive(st["pid"]):
        state_file().unlink(missing_ok=True)
        out("kvmesh down: nothing started by `kvmesh up` is running on this machine")
        return 0
    os.kill(st["pid"], signal.SIGTERM)
    deadline = time.monotonic() + 60
    while _alive(st["pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(st["pid"]):
        out(f"kvmesh down: supervisor {st['pid']} did not stop in 60 s")
        return 1
    out("kvmesh down: stopped the local kvmesh (Ray cluster, KVNodes, Redis, live page)")
    return 0
