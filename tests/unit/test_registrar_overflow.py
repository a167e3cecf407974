"""The registrar's queue overflowing (a long Redis outage under churn) while a batch is in flight: the batch that
fails must not be put back into the emptied queue, or an old unregister of a chunk stored again meanwhile (its
register lost with the queue) outlives the re-join's registration of what is held, and the held chunk ends up
unlisted. Pure logic of the registrar against a stand-in directory (the real-Redis story of the overflow is
tests/integration/test_node.py)."""

import threading
import time
import types

import redis

from kvmesh import registrar
from kvmesh.directory import Lease

G = b"g" * 16


class StandIn:
    """A directory whose writes hang while `down`, then fail."""

    def __init__(self) -> None:
        self.inc, self.entries, self.down = 0, {}, False
        self.in_write, self.release = threading.Event(), threading.Event()

    def join(self, info, lease_ms, last=0):
        self.inc += 1
        return Lease("n", self.inc, b"e", last)

    def server_identity(self):
        return "s"

    def heartbeat(self, lease, ms, info=None):
        if self.down:
            raise redis.ConnectionError("down")
        return "ok"

    def _hang(self):
        if self.down:
            self.in_write.set()
            self.release.wait(5)
            raise redis.ConnectionError("down")

    def unregister(self, lease, group, keys):
        self._hang()
        for k in keys:
            if self.entries.get(k) == lease.incarnation:
                del self.entries[k]

    def register(self, lease, tier, group, keys):
        self._hang()
        self.entries.update(dict.fromkeys(keys, lease.incarnation))
        return []

    def register_many(self, lease, tier, groups):
        for g, keys in groups.items():
            self.register(lease, tier, g, keys)
        return {}

    def disown(self, *a):
        return 0


def test_a_batch_in_flight_across_an_overflow_is_not_put_back(monkeypatch):
    monkeypatch.setattr(registrar, "MAX_QUEUED", 4)
    d, lock, held = StandIn(), threading.Lock(), {}
    reg = registrar.Registrar(d, types.SimpleNamespace(node_id="n" * 32), 4000, 0.05, lock,
                              lambda: [(G, k, t) for k, t in held.items()], lambda g: bool(held),
                              lambda *a: None, lambda *a: None, lambda incs: None)

    def store(k):
        with lock:
            held[k] = 1
            reg.post({(G, k): 1})

    def evict(k):
        with lock:
            held.pop(k, None)
            reg.post({(G, k): None})

    try:
        store(b"X")
        assert reg.flush(2) and d.entries == {b"X": 1}
        d.down = True
        evict(b"X")  # its unregister goes out in a write that hangs
        assert d.in_write.wait(2)
        store(b"X")  # stored again meanwhile
        for i in range(5):
            store(b"k%d" % i)  # churn: the queue overflows
        d.down = False
        d.release.set()  # the hanging write fails; Redis answers again
        end = time.monotonic() + 5
        while (reg.pending or reg.lease.incarnation == 1) and time.monotonic() < end:
            time.sleep(0.02)
        assert reg.lease.incarnation == 2
        assert d.entries == dict.fromkeys(held, 2)  # every chunk held is listed, under the new incarnation
    finally:
        with reg._cv:
            reg._stop = True
            reg._cv.notify_all()
