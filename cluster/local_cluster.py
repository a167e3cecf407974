"""Start a local kvmesh cluster on this machine and keep it up until Ctrl-C: an embedded redis-server, a Ray
cluster of N nodes (one raylet each, all on 127.0.0.1) and one KVNode per node.

    .venv/bin/python cluster/local_cluster.py --nodes 3 --cpu-mib 1024

Workers join with `ray.init(address=<printed address>)` and `kvmesh.connect(spec)`.
"""

import argparse
import signal
import threading

from kvmesh.local import LocalRayCluster, RedisServer

MiB = 1 << 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--cpu-mib", type=int, default=1024, help="CPU tier per node, MiB")
    p.add_argument("--slot-mib", type=int, default=4, help="slot size, MiB (a chunk must fit in one)")
    args = p.parse_args()
    import kvmesh

    redis_server = RedisServer()
    cluster = LocalRayCluster(args.nodes)
    try:
        mesh = kvmesh.start(redis_server.url, cpu_bytes=args.cpu_mib * MiB, slot_bytes=args.slot_mib * MiB)
        print(f"ray address: {cluster.address}\nredis url:   {redis_server.url}")
        for n in mesh.nodes:
            print(f"KVNode {n.node_id[:12]} incarnation {n.incarnation} data {n.data_addr}")
        print("Ctrl-C to stop")
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
    finally:
        kvmesh.stop()
        cluster.shutdown()
        redis_server.stop()


if __name__ == "__main__":
    main()
