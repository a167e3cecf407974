"""Keep one KVNode on every node of a Ray cluster, nodes that join later included, and serve kvmesh's live page.

Runs on the head node of a long-lived Ray cluster: the KubeRay head container (helm/kvmesh), `ray up`'s head start
commands (cluster/ray-up.yaml) or a bare head machine (cluster/bare-metal.sh):

    python kvmesh_keeper.py [--address auto] [--interval 15] [--dashboard-host 0.0.0.0 --dashboard-port 8266]

`kvmesh up --address` places KVNodes once; this calls the same `kvmesh.start` every `--interval` seconds, which is
idempotent: existing KVNodes are kept, each new alive Ray node gets one. Configuration is kvmesh's own: `--config` /
`$KVMESH_CONFIG` and `KVMESH_*` variables (`KVMeshConfig.load`). The live page needs only Redis, so it is up before
Ray is. It waits up to `--wait-s` for Ray to come up; once connected, losing the Ray cluster ends it with exit
status 1 so that whatever started it (the chart's shell loop, systemd) starts it again. The chart ships a copy
(helm/kvmesh/files/kvmesh_keeper.py; tests/deploy checks that they are equal).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time

log = logging.getLogger("kvmesh.keeper")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="auto", help="the Ray cluster (default auto: the one on this machine)")
    p.add_argument("--config", help="YAML file of kvmesh options (or $KVMESH_CONFIG)")
    p.add_argument("--interval", type=float, default=15.0, help="seconds between passes over the Ray nodes")
    p.add_argument("--wait-s", type=float, default=600.0, help="how long to wait for Ray to come up")
    p.add_argument("--dashboard-host", default="127.0.0.1", help="address the live page listens on")
    p.add_argument("--dashboard-port", type=int, default=-1, help="port of the live page (-1: no live page)")
    p.add_argument("--once", action="store_true", help="one pass, then exit (0 if every node has a KVNode)")
    return p.parse_args(argv)


def connect_ray(address: str, wait_s: float, stop: threading.Event):
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        try:
            ray.init(address=address, namespace="kvmesh", logging_level="WARNING", log_to_driver=False)
            return ray
        except (ConnectionError, RuntimeError) as e:
            if time.monotonic() > deadline or stop.is_set():
                raise SystemExit(f"kvmesh keeper: no Ray cluster at {address} after {wait_s:.0f} s ({e})")
            log.info("waiting for Ray at %s: %s", address, e)
            stop.wait(2.0)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    from kvmesh.config import KVMeshConfig

    try:
        cfg = KVMeshConfig.load(args.config)
    except ValueError as e:  # a configuration error is one line, and retrying will not fix it
        print(f"kvmesh keeper: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    dash = None
    if args.dashboard_port >= 0:
        from kvmesh.dashboard import Dashboard

        dash = Dashboard(cfg.redis_url, cfg.key_prefix, host=args.dashboard_host, port=args.dashboard_port).start()
        log.info("live page at %s", dash.url)
    try:
        ray = connect_ray(args.address, args.wait_s, stop)
        # ray.init installs SIGTERM handling of its own; ours stops the loop
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        import kvmesh

        known: set[str] = set()
        while not stop.is_set():
            try:
                alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            except Exception as e:  # the Ray cluster went away: let the supervisor start us again
                log.error("lost the Ray cluster: %s", e)
                return 1
            try:
                mesh = kvmesh.start(config=cfg)
                have = set(mesh.node_ids)
                if have != known:
                    log.info("KVNodes on %d of %d Ray node(s): +%s -%s", len(have & alive), len(alive),
                             sorted(n[:12] for n in have - known), sorted(n[:12] for n in known - have))
                    known = have
                if args.once:
                    return 0 if alive <= have else 1
            except Exception as e:  # Redis down, a node that cannot take a KVNode yet: try again next pass
                log.warning("placing KVNodes failed (retrying in %.0f s): %s", args.interval, e)
                if args.once:
                    return 1
            stop.wait(args.interval)
        return 0
    finally:
        if dash:
            dash.stop()


if __name__ == "__main__":
    sys.exit(main())
