"""Each sink on its own, without Ray or a KVNode: where chunk i lands, what adopting means for it, when the sources'
releases run, and what `finish(n)` gives. The device sink runs on the CPU here (tests/gpu runs it on CUDA)."""

import concurrent.futures
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvmesh import KVSpec
from kvmesh.dataplane.sinks import DeviceSink, HostSink, Sink
from kvmesh.pullthrough import BufferSink, SlotSink
from kvmesh.tiers import checksum

SPEC = KVSpec("sinks", num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", chunk_tokens=4)
CB = SPEC.chunk_bytes


def chunk_bytes(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, CB, dtype=np.uint8).tobytes()


def as_kv(raw: bytes) -> torch.Tensor:
    """A chunk's bytes (chunk layout: [layers, 2, tokens, heads, dim]) as KV."""
    return torch.frombuffer(bytearray(raw), dtype=SPEC.torch_dtype).view(SPEC.chunk_shape)


def same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bit for bit (random bytes hold NaNs, which never equal themselves)."""
    return torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))


def test_the_base_sink_copies_only_and_releases_at_once():
    s = Sink()
    released = []
    s.prepare([0, 1])
    assert s.adopt(0, b"", 0, lambda: None) is False and not s.device_reads
    s.commit(0, 0)
    s.on_release(lambda: released.append(1))
    assert released == [1]
    for call in (lambda: s.segments(0), lambda: s.put(0, b""), lambda: s.finish(0)):
        with pytest.raises(NotImplementedError):
            call()


def test_every_sink_is_a_sink():
    assert all(issubclass(c, Sink) for c in (HostSink, DeviceSink, SlotSink, BufferSink))


def test_host_sink_puts_and_receives_each_chunk_into_its_tokens_and_finishes_with_the_leading_part():
    out = torch.zeros(SPEC.kv_shape(3 * SPEC.chunk_tokens), dtype=SPEC.torch_dtype)
    sink = HostSink(SPEC, out)
    a, b = chunk_bytes(1), chunk_bytes(2)
    sink.put(0, a)
    flat = np.frombuffer(b, dtype=np.uint8)
    segs = sink.segments(1)  # a receiver writes a chunk's bytes in chunk order across these
    assert sum(x.nbytes for x in segs) == CB
    off = 0
    for seg in segs:
        seg.reshape(-1)[:] = flat[off : off + seg.nbytes]
        off += seg.nbytes
    got = sink.finish(2)
    c = SPEC.chunk_tokens
    assert got.shape[2] == 2 * c and got.data_ptr() == out.data_ptr()  # a view of `out`
    assert same(got[:, :, :c], as_kv(a)) and same(got[:, :, c:], as_kv(b))
    assert sink.adopt(0, a, checksum(a), lambda: None) is False  # never adopts: copies
    released = []
    sink.on_release(lambda: released.append(1))
    assert released == [1]


def test_device_sink_stages_peer_chunks_in_rows_of_its_own():
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sink = DeviceSink(SPEC, torch.device("cpu"), pool)
        sink.prepare([1, 3])
        a = chunk_bytes(3)
        sink.put(1, a)
        (seg,) = sink.segments(3)
        assert seg.nbytes == CB and not np.shares_memory(seg, sink.segments(1)[0])
        with pytest.raises(AssertionError, match="not announced"):
            sink.put(0, a)  # chunk 0 was not announced as a staged one


def test_device_sink_verifies_adopted_chunks_and_holds_their_release_until_the_load_lets_go():
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sink = DeviceSink(SPEC, torch.device("cpu"), pool)
        good, bad = chunk_bytes(5), chunk_bytes(6)
        reported, released = [], []
        assert sink.adopt(0, np.frombuffer(good, dtype=np.uint8), checksum(good), lambda: reported.append(0))
        assert sink.adopt(1, np.frombuffer(bad, dtype=np.uint8), checksum(good), lambda: reported.append(1))
        sink.on_release(lambda: released.append("unpin"))
        assert released == []  # the sink still reads the adopted memory
        assert [f.result() for f in sink._checks] == [True, False] and reported == [1]
        assert sink.finish(0) == (None, 0)  # nothing delivered: released at once
        assert released == ["unpin"]


def test_slot_sink_lands_chunks_in_their_slots_and_completes_or_aborts_each_ticket():
    slots = {7: bytearray(CB), 9: bytearray(CB)}
    done = []
    cascade = SimpleNamespace(cpu=SimpleNamespace(buffer=lambda slot: slots[slot]),
                              complete=lambda t, s: done.append(("complete", t.slot, s)),
                              abort=lambda t: done.append(("abort", t.slot)))
    tickets = [SimpleNamespace(slot=7), SimpleNamespace(slot=9)]
    sink = SlotSink(cascade, __import__("threading").Lock(), lambda: done.append("posted"), tickets, CB)
    a = chunk_bytes(7)
    sink.put(0, a)
    sink.commit(0, checksum(a))
    assert sink.adopt(0, a, 0, lambda: None) is False
    assert sink.finish(1) == 1 and bytes(slots[7]) == a
    assert done == [("complete", 7, checksum(a)), ("abort", 9), "posted"]  # (the cascade counts what it completes)


def test_buffer_sink_hands_what_arrived_to_the_node_store_path():
    stored = []
    def store(items, buf):
        stored.append((items, bytes(buf)))
        return len(items)

    keys = [b"k" * 16, b"l" * 16]
    sink = BufferSink(store, keys, b"g" * 16, CB)
    a = chunk_bytes(8)
    sink.put(0, a)
    sink.commit(0, checksum(a))
    assert sink.finish(1) == 1
    (items, buf), = stored
    assert [i.key for i in items] == [keys[0]] and buf == a and items[0].checksum == checksum(a)
    assert BufferSink(store, keys, b"g" * 16, CB).finish(0) == 0 and len(stored) == 1
