"""Wire messages round-trip and reject malformed input with WireError."""

import msgpack
import pytest

from kvmesh.wire import (NodeInfo, PinnedChunk, StoreItem, WireError, pack_chunk_header, pack_keys, pack_pin_reply,
                         pack_store, unpack_chunk_header, unpack_keys, unpack_pin_reply, unpack_store)

K = b"k" * 16


def test_round_trips():
    assert unpack_keys(pack_keys([K, K])) == [K, K]
    pin_id, rows, path, _ = unpack_pin_reply(pack_pin_reply(7, [PinnedChunk(1, 2, 3)], "/dev/shm/x"))
    assert (pin_id, rows, path) == (7, [PinnedChunk(1, 2, 3)], "/dev/shm/x")
    assert unpack_chunk_header(pack_chunk_header([(10, 2**64 - 1)])) == [(10, 2**64 - 1)]
    items = [StoreItem(K, K, 100, 5)]
    assert unpack_store(pack_store(items)) == items
    info = NodeInfo("n1", "kvnode-n1", "/dev/shm/s", 1024, 64)
    assert NodeInfo.unpack(info.pack(), incarnation=3) == info.with_incarnation(3)


def test_appended_fields_are_ignored():
    data = msgpack.packb([1, [K], "a field from a newer version"], use_bin_type=True)
    assert unpack_keys(data) == [K]


@pytest.mark.parametrize("data", [
    b"", b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([]), msgpack.packb([2, [K]]), msgpack.packb([1]),
    msgpack.packb([1, [b"short"]]), msgpack.packb([1, ["a string key" * 2]]), msgpack.packb([1, "notalist"]),
    "not bytes", 12, None,
])
def test_malformed_key_requests_raise_wire_error(data):
    with pytest.raises(WireError):
        unpack_keys(data)


@pytest.mark.parametrize("rows", [[[K, K, 0, 1]], [[K, K, -1, 1]], [[K, b"x", 10, 1]], [[K, K, 10]],
                                  [[K, K, 10, -5]], [[K, K, True, 1]], ["row"]])
def test_malformed_store_requests_raise_wire_error(rows):
    with pytest.raises(WireError):
        unpack_store(msgpack.packb([1, rows], use_bin_type=True))


def test_wire_error_is_a_value_error():
    assert issubclass(WireError, ValueError)


def test_pull_through_round_trips_and_rejects_what_a_node_must_not_act_on():
    from kvmesh.wire import PullThrough, pack_pull_through, unpack_pull_through

    p = PullThrough([K, K], K, 4096, "node-b", "tcp", 2500)
    assert unpack_pull_through(pack_pull_through(p)) == p
    for bad in (PullThrough([K], b"short", 4096, "n", "tcp", 1), PullThrough([K], K, 0, "n", "tcp", 1),
                PullThrough([K], K, 1, "", "tcp", 1), PullThrough([K], K, 1, "n", "carrier-pigeon", 1),
                PullThrough([K], K, 1, "n", "tcp", 10**9), PullThrough([b"k"], K, 1, "n", "tcp", 1)):
        with pytest.raises(WireError):
            unpack_pull_through(pack_pull_through(bad))
    with pytest.raises(WireError):
        unpack_pull_through(msgpack.packb([1, [K], K, 1, "n", "tcp"]))  # a field missing


def test_a_pin_request_carries_how_long_the_reader_may_read_its_slots():
    from kvmesh.wire import MAX_DEADLINE_MS, unpack_pin_request

    assert unpack_pin_request(pack_keys([K], "n1", True, 12_345)) == ([K], "n1", True, 12_345)
    assert unpack_pin_request(pack_keys([K], "n1"))[3] == 0
    # a request of before the field (four elements) holds for the TTL alone; nonsense is clamped, never raised
    assert unpack_pin_request(msgpack.packb([1, [K], "n1", False]))[3] == 0
    assert unpack_pin_request(msgpack.packb([1, [K], "n1", False, -5]))[3] == 0
    assert unpack_pin_request(msgpack.packb([1, [K], "n1", False, 10**12]))[3] == MAX_DEADLINE_MS
    assert unpack_pin_request(msgpack.packb([1, [K], "n1", False, True]))[3] == 0
