"""A client's telemetry flush runs on its background thread while the worker's threads add counters: it must not
fail (it once iterated the live Counter: "dictionary changed size during iteration", which killed the thread that
also refreshes the node table)."""

import threading
from collections import Counter

from kvmesh.telemetry import ClientExporter


def test_flushing_counters_while_other_threads_add_new_ones_never_fails():
    exporter = ClientExporter(None, "node")
    counts: Counter = Counter({f"k{i}": 1 for i in range(200)})
    def worker():
        for i in range(20000):
            counts[f"new{i}"] += 1  # a counter name seen for the first time (a first miss of some reason)

    t = threading.Thread(target=worker)
    t.start()
    flushes = 0
    try:
        while t.is_alive() or not flushes:
            exporter.flush(counts, [], [])
            flushes += 1
    finally:
        t.join()
