"""The `kvmesh` command line: up, status, down, demo, bench."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

from kvmesh._extras import MissingExtra

BENCHES = {"reuse": "reuse.py", "core": "core.py", "disk": "disk.py", "gpu": "gpu.py"}


def build_parser() -> argparse.ArgumentParser:
    from kvmesh import demo

    p = argparse.ArgumentParser(
        prog="kvmesh",
        description="kvmesh: a distributed, shared KV cache on Ray. "
        "Options may also come from a YAML file (--config) and KVMESH_* variables.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser(
        "up",
        help="start kvmesh: a local cluster, or KVNodes on an existing Ray cluster",
        description="Without --address: an embedded Redis, a local Ray cluster of --nodes raylets "
        "on 127.0.0.1, a KVNode on each and the live page, kept running in the background until "
        "`kvmesh down`. With --address: KVNodes on every node of that Ray cluster and the live "
        "page in a detached actor.",
    )
    up.add_argument("--nodes", type=int, default=3, help="raylets of the local cluster (default 3)")
    up.add_argument("--address", help="join this Ray cluster instead (e.g. auto, 10.0.0.1:6379)")
    up.add_argument("--redis-url", help="the directory, with --address (default: the config's redis_url)")
    up.add_argument("--config", help="YAML file of kvmesh options")
    up.add_argument("--host", default="127.0.0.1", help="address the live page listens on")
    up.add_argument("--port", type=int, default=8266, help="port of the live page (0: any free one)")
    up.set_defaults(func=_up)

    st = sub.add_parser(
        "status",
        help="nodes, tiers and hit rates, as a table",
        description="Reads the directory (Redis) directly; no Ray connection is needed.",
    )
    st.add_argument("--redis-url", help="the directory (default: the local `kvmesh up`, or $KVMESH_REDIS_URL)")
    st.add_argument("--key-prefix", help="the deployment's key prefix (default kvmesh)")
    st.set_defaults(func=lambda a: _operate().status(a.redis_url, a.key_prefix))

    dn = sub.add_parser(
        "down",
        help="stop what `kvmesh up` started",
        description="Stops the local kvmesh, or with --address removes the KVNodes and the live "
        "page from that Ray cluster.",
    )
    dn.add_argument("--address", help="the Ray cluster `kvmesh up --address` joined")
    dn.set_defaults(func=lambda a: _operate().down(a.address))

    d = sub.add_parser(
        "demo",
        help="run the local end-to-end demo (embedded Redis + multi-node Ray)",
        description=demo.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(d)
    d.set_defaults(func=demo.main)

    b = sub.add_parser(
        "bench",
        help="run a benchmark; JSON and PNG plots go to bench/results/",
        description="reuse: TTFT with a CPU-tier hit vs recompute over context lengths (default); "
        "core: lookup / cross-node / same-node ratios; disk: disk tier vs dd and vs recompute; "
        "gpu: the GPU data plane (on a CUDA machine). Needs the repository's bench/ folder.",
    )
    b.add_argument("which", nargs="?", default="reuse", choices=sorted(BENCHES))
    b.add_argument("args", nargs=argparse.REMAINDER, help="passed on to the benchmark")
    b.set_defaults(func=_bench)

    sv = sub.add_parser("_supervise")  # the background process of `kvmesh up`
    sv.add_argument("--nodes", type=int, default=3)
    sv.add_argument("--port", type=int, default=8266)
    sv.add_argument("--config")
    sv.add_argument("--host", default="127.0.0.1")
    sv.set_defaults(func=lambda a: _operate().supervise(a.config, a.nodes, a.port, a.host))
    return p


def _operate():
    from kvmesh import operate

    return operate


def _up(a) -> int:
    if a.nodes < 1:
        print("kvmesh up: --nodes must be at least 1", file=sys.stderr)
        return 2
    if a.address:
        return _operate().up_join(a.address, a.config, a.redis_url, a.host, a.port)
    if a.redis_url:  # a local `up` runs its own embedded Redis: the URL would be dropped without a word
        print(
            "kvmesh up: --redis-url needs --address (a local kvmesh up starts its own Redis; to use yours, start "
            "a Ray cluster and run kvmesh up --address auto --redis-url ...)",
            file=sys.stderr,
        )
        return 2
    return _operate().up_local(a.config, a.nodes, a.port, host=a.host)


def _bench(a) -> int:
    bench_dir = Path(__file__).resolve().parent.parent / "bench"
    script = bench_dir / BENCHES[a.which]
    if not script.exists():
        print(f"kvmesh bench: {script} not found (run from a clone of the kvmesh repository)", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(script), *a.args], cwd=bench_dir.parent)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from kvmesh.directory import DirectoryUnavailable

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, MissingExtra, DirectoryUnavailable) as e:  # configuration errors, missing extras, a
        # directory that cannot be used (`up --address` with a wrong --redis-url): one clear line
        if os.environ.get("KVMESH_DEBUG"):
            raise
        print(f"kvmesh {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
