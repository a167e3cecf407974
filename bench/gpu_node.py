"""A stand-in KVNode process for GPU-tier runs without Ray (the H200 machine has none): it holds a real `GpuTier`
and answers a few requests over a pipe, as the KVNode's GPU-tier source will (export the pools, reserve and
complete slots, verify them). The tests in tests/gpu and bench/gpu.py drive it from a second process, so every
read and write crosses a real process boundary through CUDA IPC.

    GpuNodeProcess(num_slots, slot_bytes)     starts it (torch.multiprocessing, spawn)
      .exports() -> [PoolExport]               the pools' CUDA IPC handles (as the KVNode's reply would carry)
      .store_random(n, seed) -> [(slot, device_sum)]   n chunks of random bytes placed "from the host"
      .reserve(n) -> [slot]  /  .complete_device(slots, sums) -> [verified]   a device-to-device store
      .verify(slots) -> [bool]   .chunk(slot) -> bytes   .corrupt(slot, offset)   .restart(incarnation)
      .close()

The control messages are pickled: this is a harness between two processes of one test, not node data.
"""

from __future__ import annotations

import traceback


def _serve(conn, num_slots: int, slot_bytes: int, device: str, node_id: str, incarnation: str) -> None:
    import torch

    from kvmesh.tiers import checksum
    from kvmesh.tiers.gpu import GpuTier

    tier = GpuTier(num_slots, slot_bytes, device)
    tickets = {}

    def store_random(n: int, seed: int):
        out = []
        g = torch.Generator(device=tier.device).manual_seed(seed)
        for i in range(n):
            t = tier.prepare_store(seed.to_bytes(8, "little") + i.to_bytes(8, "little"), b"g" * 16, slot_bytes)
            if t is None:
                break
            buf = tier.buffer(t.slot)
            buf.copy_(torch.randint(0, 256, (slot_bytes,), dtype=torch.uint8, device=buf.device, generator=g))
            tier.complete_store(t, checksum(buf.cpu().numpy()))
            out.append((t.slot, tier.device_sum(t.slot)))
        torch.cuda.synchronize()
        return out

    def reserve(n: int):
        slots = []
        for _ in range(n):
            t = tier.prepare_store(torch.randint(0, 2**62, (1,)).item().to_bytes(16, "little"), b"d" * 16,
                                   slot_bytes)
            if t is None:
                break
            tickets[t.slot] = t
            slots.append(t.slot)
        return slots

    def complete_device(slots, sums):
        for s, v in zip(slots, sums):
            tier.complete_device_store(tickets.pop(s), v)
        return [tier.verify(s) for s in slots]

    def corrupt(slot: int, offset: int):
        b = tier.buffer(slot)
        b[offset] = b[offset] ^ 0x5A
        torch.cuda.synchronize()

    def restart(new_incarnation: str):
        nonlocal tier, incarnation
        tier.close()
        tier, incarnation = GpuTier(num_slots, slot_bytes, device), new_incarnation
        tickets.clear()
        return True

    ops = {
        "exports": lambda: [e.pack() for e in tier.exports(node_id, incarnation)],
        "store_random": store_random, "reserve": reserve, "complete_device": complete_device,
        "verify": lambda slots: [tier.verify(s) for s in slots],
        "chunk": lambda slot: tier.chunk_view(slot).cpu().numpy().tobytes(),
        "corrupt": corrupt, "restart": restart,
        "integrity": lambda: tier.check_integrity(verify_checksums=True),
    }
    while True:
        msg = conn.recv()
        if msg[0] == "quit":
            break
        try:
            conn.send(("ok", ops[msg[0]](*msg[1:])))
        except Exception as e:  # the caller re-raises it
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    tier.close()
    conn.send(("ok", None))


class GpuNodeProcess:
    def __init__(self, num_slots: int, slot_bytes: int, device: str = "cuda", node_id: str = "node-a",
                 incarnation: str = "inc-1") -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.node_id = node_id
        self.proc = ctx.Process(target=_serve, args=(child, num_slots, slot_bytes, device, node_id, incarnation),
                                daemon=True)
        self.proc.start()

    def call(self, op: str, *args):
        self.conn.send((op, *args))
        if not self.conn.poll(300):
            raise TimeoutError(f"the GPU node process did not answer {op}")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"GPU node process: {value}")
        return value

    def exports(self):
        from kvmesh.tiers.gpu_ipc import PoolExport

        return [PoolExport.unpack(b) for b in self.call("exports")]

    def store_random(self, n: int, seed: int):
        return self.call("store_random", n, seed)

    def reserve(self, n: int):
        return self.call("reserve", n)

    def complete_device(self, slots, sums):
        return self.call("complete_device", list(slots), list(sums))

    def verify(self, slots):
        return self.call("verify", list(slots))

    def chunk(self, slot: int) -> bytes:
        return self.call("chunk", slot)

    def corrupt(self, slot: int, offset: int = 0) -> None:
        self.call("corrupt", slot, offset)

    def restart(self, incarnation: str) -> None:
        self.call("restart", incarnation)

    def check_integrity(self) -> None:
        self.call("integrity")

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("quit",))
                self.conn.poll(30) and self.conn.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
