"""The data-plane matrix on the real 3-node Ray cluster plus a fourth node with a disk tier (tests/dataplane_matrix.py
says what each case checks). The device sink runs on the CPU here; tests/gpu/test_matrix_cuda.py runs it on CUDA."""

import time

import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import kvmesh
from kvmesh.mesh import node_actors
from tests import dataplane_matrix as mx
from tests.conftest import wait_until

MiB = 1 << 20


@ray.remote(num_cpus=0)
class Worker:
    """A worker process on one node: one client per case (made at its lookup, closed after its fetch)."""

    def __init__(self):
        self.client = None

    def store(self, toks, kv, only, filler=None):
        kv = mx.from_ray(kv)
        if filler is not None:
            filler = (filler[0], mx.from_ray(filler[1]))
        c = kvmesh.connect(mx.SPEC)
        try:
            keys = c.hashes(toks)
            c.store_keys(keys[0], [keys[i] for i in only], [mx.chunk(kv, i) for i in only])
            n = c.flush()
            if filler is not None:  # push what was just stored out of the CPU tier, onto the disk tier
                c.store(*filler)
                c.flush()
            return n
        finally:
            c.close()

    def lookup(self, toks, opts):
        if self.client is not None:
            self.client.close()
        self.client = kvmesh.connect(mx.SPEC, **opts)
        return self.client.lookup(toks, cost_model=False)

    def lookup_len(self, toks, opts):
        c = kvmesh.connect(mx.SPEC, **opts)
        try:
            return c.lookup(toks, cost_model=False).num_chunks
        finally:
            c.close()

    def fetch(self, match, sink):
        c, s = self.client, mx.SPEC
        try:
            if sink == "device":
                load, n = c.fetch_to_device(match, "cpu")
                if load is None:
                    return 0, mx.to_ray(torch_empty()), []
                try:
                    n = min(n, load.first_unverified())
                    got = load.staging[:n].permute(1, 2, 0, 3, 4, 5).reshape(s.kv_shape(n * s.chunk_tokens)).clone()
                finally:
                    load.release()
                return n, mx.to_ray(got), mx.device_checked(load)
            out = None
            if sink == "out":
                import torch

                out = torch.full(s.kv_shape(match.num_tokens + s.chunk_tokens), float("nan"), dtype=s.torch_dtype)
            got = c.fetch(match, out=out)
            return got.shape[2] // s.chunk_tokens, mx.to_ray(got.clone()), []
        finally:
            c.close()
            self.client = None


def torch_empty():
    import torch

    return torch.empty(mx.SPEC.kv_shape(0), dtype=mx.SPEC.torch_dtype)


def pid_alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class RayBackend:
    def __init__(self, mesh, disk_node, disk_config):
        a, b, c = mesh.node_ids
        self.nodes = {"A": a, "B": b, "C": c, "D": disk_node}
        self.configs = {"A": mesh.config, "B": mesh.config, "C": mesh.config, "D": disk_config}
        self.workers = {r: Worker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
                        for r, n in self.nodes.items()}
        self.seq = 0
        self.device_checked: list[int] = []  # of the last fetch

    def actor(self, role):
        return node_actors()[self.nodes[role]]

    def store(self, role, toks, kv, only):
        filler = None
        if role == "D":  # more chunks than D's CPU tier holds, stored after: the case's chunks go to disk
            self.seq += 1
            filler_toks, filler_kv = mx.data(1_000_000 + self.seq, n=12)
            filler = (filler_toks, mx.to_ray(filler_kv))
        assert ray.get(self.workers[role].store.remote(toks, mx.to_ray(kv), only, filler), timeout=60) == len(only)
        if role == "D":
            keys = mx.keys(toks)
            want = [keys[i] for i in only]
            wait_until(lambda: all([w[0] for w in where] == ["disk"] for where in
                                   ray.get(self.actor("D").locate.remote(want))), 10)

    def lookup(self, role, toks, opts):
        return ray.get(self.workers[role].lookup.remote(toks, opts), timeout=60)

    def fetch(self, role, match, sink, opts):
        n, got, self.device_checked = ray.get(self.workers[role].fetch.remote(match, sink), timeout=60)
        return n, mx.from_ray(got)

    def kill(self, role):
        actor = self.actor(role)
        pid = ray.get(actor.stats.remote(), timeout=30)["pid"]
        ray.kill(actor, no_restart=True)
        wait_until(lambda: not pid_alive(pid), 20)  # its data server dies with the process, not with the actor

    def revive(self, role):
        kvmesh.start(config=self.configs[role])  # makes the missing KVNode only

    def corrupt(self, role, toks, index):
        key = mx.keys(toks)[index]
        (tier, path, offset), = [w for w in ray.get(self.actor(role).locate.remote([key]))[0]
                                 if w[0] == ("disk" if role == "D" else "cpu")]
        import os

        with open(path, "r+b") as f:
            f.seek(offset + mx.corrupt_offset())
            b = f.read(1)
            f.seek(offset + mx.corrupt_offset())
            f.write(bytes([b[0] ^ 0x20]))
            f.flush()
            os.fsync(f.fileno())

    def counters(self, role):
        return ray.get(self.actor(role).stats.remote(), timeout=30)

    def no_pins(self):
        actors = node_actors()
        ids = list(self.nodes.values())
        pinned = lambda: {r: s["pinned"] for r, s in zip(self.nodes, ray.get([actors[n].stats.remote()  # noqa: E731
                                                                              for n in ids])) if s["pinned"]}
        try:
            wait_until(lambda: not pinned(), 5)
        except AssertionError:
            raise AssertionError(f"pins outlived the fetch: {pinned()}") from None

    def wait_lookup_len(self, role, toks, opts, n):
        got = lambda: ray.get(self.workers[role].lookup_len.remote(toks, opts))  # noqa: E731
        try:
            wait_until(lambda: got() == n, 5)
        except AssertionError:
            raise AssertionError(f"a lookup still finds {got()} chunks, not {n}: the corrupt one stays listed") \
                from None


@pytest.fixture(scope="module")
def backend(mesh, ray_cluster, tmp_path_factory):
    node = ray_cluster.add_node(num_cpus=1)
    disk_config = mesh.config.replace(cpu_bytes=8 * mesh.config.slot_bytes, disk_bytes=64 * mesh.config.slot_bytes,
                                      disk_dir=str(tmp_path_factory.mktemp("matrix-disk")))
    kvmesh.start(config=disk_config)  # only the new node gets a KVNode, and this config
    wait_until(lambda: node.node_id in node_actors(), 30)
    yield RayBackend(mesh, node.node_id, disk_config)
    ray.kill(node_actors()[node.node_id], no_restart=True)  # its detached actor's name would outlive the node
    wait_until(lambda: node.node_id not in node_actors(), 30)
    ray_cluster.remove_node(node, graceful=True)  # the GCS knows at once, so a later kvmesh.start never places an actor on it


@pytest.mark.parametrize("case", mx.cases(), ids=mx.case_id)
def test_matrix(backend, case):
    t0 = time.monotonic()
    mx.run_case(backend, case)
    assert time.monotonic() - t0 < 30
