"""The data-plane matrix's device-sink cases on real CUDA tensors (tests/dataplane_matrix.py says what each case
checks). The GPU machine has no Ray: five KVNodes run as plain objects in this process against a real redis-server
(A and B hold in memory, C reads, D holds on its disk tier, G in its GPU tier), and readers use `connect_local`.
Sources: slab, tcp, via, disk and gpu (the Ray transport needs Ray: it runs in tests/integration/test_matrix.py).
Skipped without CUDA."""

import os

import pytest
import torch

from kvmesh.connecting import connect_local
from kvmesh.config import KVMeshConfig
from kvmesh.handle import LocalHandle
from kvmesh.node import KVNode
from tests import dataplane_matrix as mx
from tests.conftest import wait_until

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (KVMESH_PLAIN_MATRIX=1 runs it on the CPU device sink, to debug it where there is no GPU)
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(DEVICE == "cpu" and not os.environ.get("KVMESH_PLAIN_MATRIX"),
                                                  reason="needs a CUDA GPU")]
SLOT = max(64 * 1024, mx.SPEC.chunk_bytes)


class PlainBackend:
    def __init__(self, url: str, tmp) -> None:
        base = KVMeshConfig(redis_url=url, key_prefix="mxc", cpu_bytes=64 * SLOT, slot_bytes=SLOT, lease_s=4.0,
                            heartbeat_s=0.5, node_refresh_s=0.2, fetch_timeout_s=5.0, shm_dir=str(tmp / "shm"))
        os.makedirs(base.shm_dir, exist_ok=True)
        self.configs = {r: base for r in "ABC"}
        self.configs["D"] = base.replace(cpu_bytes=8 * SLOT, disk_bytes=64 * SLOT, disk_dir=str(tmp / "disk"))
        roles = "ABCD"
        if DEVICE == "cuda":  # G: a GPU tier of 16 slots above its slab (in this process its readers use the pool
            # itself, as CUDA IPC cannot open a handle of its own process; tests/gpu/test_gpu_ipc.py maps it from a
            # second process)
            self.configs["G"] = base.replace(gpu_bytes=16 * SLOT, gpu_device="cuda")
            roles += "G"
        self.nodes = {r: self._node(r, f"node-{r}" * 6) for r in roles}
        self.reader = None
        self.seq = 0
        self.device_checked: list[int] = []  # of the last fetch

    def _node(self, role, node_id):
        n = KVNode(self.configs[role], node_id, f"kvnode-{role}")
        # without Ray a node reaches its peers' KVNodes in this process (to report a corrupt copy to its holder)
        n.peers = lambda node: next((LocalHandle(p, n.node_id) for p in self.nodes.values()
                                     if p.node_id == node and not p.closed), None)
        return n

    def client(self, role, **opts):
        others = [n for r, n in self.nodes.items() if r != role and not n.closed]
        return connect_local(mx.SPEC, self.nodes[role], peers=others, **opts)

    def store(self, role, toks, kv, only):
        c = self.client(role)
        try:
            keys = mx.keys(toks)
            chunks = [mx.chunk(kv, i) for i in only]
            if role == "G":  # KV on the GPU: stored device to device into G's GPU tier
                assert c.fetcher.env.gpu is not None, "the client did not map G's GPU tier"
                chunks = [t.to(DEVICE) for t in chunks]
            c.store_keys(keys[0], [keys[i] for i in only], chunks)
            assert c.flush() == len(only)
            if role == "G":
                gpu = self.nodes["G"].cascade.gpu
                assert c.counts["stored_chunks_d2d"] == len(only) and not c.counts["store_d2d_fallback"]
                assert all(gpu.slot_of(keys[i]) is not None for i in only), "not in the GPU tier"
            if role == "D":  # more chunks than D's CPU tier holds, stored after: the case's chunks go to disk
                self.seq += 1
                c.store(*mx.data(2_000_000 + self.seq, n=12))
                c.flush()
                want = [keys[i] for i in only]
                wait_until(lambda: all([w[0] for w in where] == ["disk"] for where in self.nodes["D"].locate(want)),
                           10)
        finally:
            c.close()

    def lookup(self, role, toks, opts):
        self.reader = self.client(role, **opts)
        return self.reader.lookup(toks, cost_model=False)

    def fetch(self, role, match, sink, opts):
        c, s = self.reader, mx.SPEC
        try:
            load, n = c.fetch_to_device(match, DEVICE)
            self.device_checked = []
            if load is None:
                return 0, torch.empty(s.kv_shape(0), dtype=s.torch_dtype)
            self.device_checked = mx.device_checked(load)
            try:
                n = min(n, load.first_unverified())
                got = load.staging[:n].permute(1, 2, 0, 3, 4, 5).reshape(s.kv_shape(n * s.chunk_tokens)).cpu()
            finally:
                load.release()
            return n, got
        finally:
            c.close()

    def kill(self, role):
        self.nodes[role].kill()  # its handles refuse calls from now on, as a dead actor's would

    def revive(self, role):
        old = self.nodes[role]
        old.shutdown()  # (after a kill: frees what is left, the slab and the GPU tier)
        self.nodes[role] = self._node(role, old.node_id)

    def corrupt(self, role, toks, index):
        key = mx.keys(toks)[index]
        if role == "G":  # one byte of the chunk's slot in the GPU pool
            gpu = self.nodes[role].cascade.gpu
            at = mx.corrupt_offset()
            byte = gpu.buffer(gpu.slot_of(key))[at:at + 1]
            byte.bitwise_xor_(0x20)
            torch.cuda.synchronize()
            return
        (tier, path, offset), = [w for w in self.nodes[role].locate([key])[0]
                                 if w[0] == ("disk" if role == "D" else "cpu")]
        with open(path, "r+b") as f:
            f.seek(offset + mx.corrupt_offset())
            b = f.read(1)
            f.seek(offset + mx.corrupt_offset())
            f.write(bytes([b[0] ^ 0x20]))
            f.flush()
            os.fsync(f.fileno())

    def counters(self, role):
        return self.nodes[role].stats()

    def no_pins(self):
        wait_until(lambda: all(n.stats()["pinned"] == 0 for n in self.nodes.values()), 5)

    def wait_lookup_len(self, role, toks, opts, n):
        c = self.client(role, **opts)
        try:
            wait_until(lambda: c.lookup(toks, cost_model=False).num_chunks == n, 5)
        finally:
            c.close()


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    from kvmesh.local import RedisServer

    with RedisServer() as server:
        b = PlainBackend(server.url, tmp_path_factory.mktemp("mxc"))
        yield b
        for n in b.nodes.values():
            n.shutdown()


@pytest.mark.parametrize("case", mx.cases(sources=("slab", "tcp", "via", "disk") + mx.GPU_SOURCES, sinks=("device",)),
                         ids=mx.case_id)
def test_matrix_on_cuda(backend, case):
    mx.run_case(backend, case)
