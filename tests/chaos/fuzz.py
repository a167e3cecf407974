"""R6: fuzzing (hypothesis) of what a KVNode accepts and of the public API. Every call gets generated input —
random bytes, or valid messages and arguments with one field swapped for a random value — and may only end in a
typed error (`WireError` for messages, `TypeError`/`ValueError` for API arguments); a KVNode must keep serving.

    fuzz_node(node, examples)              a KVNode (the plain class): pin, unpin, pull, store, report_corrupt,
                                           pull_through
    fuzz_data_server(node, examples)       raw frames to a KVNode's TCP data server
    fuzz_actor(actor, examples)            the same messages to a KVNode Ray actor: typed errors, same process
    fuzz_api(client, examples)             lookup/fetch/store/lookup_keys/store_keys, KVSpec, KVMeshConfig

Each returns counts: examples run and how each call ended. A call that ends otherwise raises (hypothesis shrinks it
first), which is what the tests and bench/chaos.py report (`scenarios.r6_fuzz` runs them all).
"""

from __future__ import annotations

import socket
import struct
from collections import Counter

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.wire import StoreItem, WireError, pack_keys, pack_store

K16 = st.binary(min_size=16, max_size=16)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20), st.binary(max_size=40), K16)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                      max_leaves=12)


def _settings(examples: int, derandomize: bool):
    """`derandomize`: the same examples every run (CI: a failure is a regression, never luck); otherwise new
    ones each run (bench/chaos.py: long runs that look for what CI has not seen)."""
    return settings(max_examples=examples, deadline=None, database=None, derandomize=derandomize,
                    suppress_health_check=list(HealthCheck))


@st.composite
def messages(draw) -> bytes:
    """Bytes a KVNode may be sent: noise, or a valid message of some kind with a field replaced, dropped or
    added."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=300))
    keys = draw(st.lists(K16, max_size=4))
    templates = [
        [1, keys, "requester"],
        [1, [[k, k, 64, 1] for k in keys]],
        [1, keys, draw(K16), 64, draw(st.text(max_size=8)), draw(st.sampled_from(["tcp", "ray"])), 100],
    ]
    msg = list(draw(st.sampled_from(templates)))
    how = draw(st.integers(0, 3))
    if how == 1 and msg:
        msg[draw(st.integers(0, len(msg) - 1))] = draw(VALUES)
    elif how == 2:
        msg = msg[: draw(st.integers(0, len(msg)))]
    elif how == 3:
        msg.append(draw(VALUES))
    try:
        return msgpack.packb(msg, use_bin_type=draw(st.booleans()))
    except (OverflowError, TypeError, ValueError):  # a value msgpack cannot encode: send noise instead
        return draw(st.binary(max_size=50))


def _typed(call, allowed, out: Counter) -> None:
    try:
        call()
        out["ok"] += 1
    except allowed as e:
        out[type(e).__name__] += 1


def fuzz_node(node, examples: int = 200, derandomize: bool = True) -> dict:
    out: Counter = Counter()

    @_settings(examples, derandomize)
    @given(kind=st.sampled_from(["pin", "pull", "report_corrupt", "pull_through", "store", "unpin"]),
           msg=messages(), buf=st.one_of(st.binary(max_size=200), st.integers(0, 3)), pin_id=VALUES)
    def one(kind, msg, buf, pin_id):
        out["examples"] += 1
        if kind == "unpin":
            _typed(lambda: node.unpin(pin_id), WireError, out)
        elif kind == "store":
            data = np.frombuffer(buf, dtype=np.uint8) if isinstance(buf, bytes) else np.zeros(64 * buf, np.uint8)
            _typed(lambda: node.store(msg, data), WireError, out)
        else:
            _typed(lambda: getattr(node, kind)(msg), WireError, out)

    one()
    return dict(out)


def _frame(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


def fuzz_data_server(node, examples: int = 100, derandomize: bool = True) -> dict:
    """Frames of noise, of bad lengths and of malformed requests to the node's DataServer; after each, a valid
    request on a new connection must still be answered."""
    host, port = node.data_server.address.rsplit(":", 1)
    out: Counter = Counter()

    @_settings(examples, derandomize)
    @given(raw=st.one_of(st.binary(max_size=64), messages().map(_frame),
                         st.integers(0, 2**32 - 1).map(lambda n: struct.pack("<I", n))))
    def one(raw):
        out["examples"] += 1
        with socket.create_connection((host, int(port)), timeout=2) as s:
            try:
                s.sendall(raw)
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):
                    pass
                out["answered_or_closed"] += 1
            except TimeoutError:
                out["held_open"] += 1  # it waits for the rest of a frame we never send: fine, until we close
            except OSError:
                out["reset"] += 1  # it closed on us with our bytes unread
        with socket.create_connection((host, int(port)), timeout=5) as s:  # still serving
            s.sendall(_frame(pack_keys([b"\0" * 16])))
            head = s.recv(4)
            assert len(head) == 4, "the data server stopped answering"

    one()
    return dict(out)


def fuzz_actor(actor, examples: int = 60, derandomize: bool = True) -> dict:
    """Messages to a KVNode Ray actor: each call ends in a WireError or a reply, and it is the same process
    afterwards (no crash, no restart)."""
    import ray

    pid = ray.get(actor.stats.remote())["pid"]
    out: Counter = Counter()

    @_settings(examples, derandomize)
    @given(kind=st.sampled_from(["pin", "pull", "report_corrupt", "pull_through", "store", "unpin"]),
           msg=messages(), pin_id=VALUES)
    def one(kind, msg, pin_id):
        out["examples"] += 1
        if kind == "unpin":
            ref = actor.unpin.remote(pin_id)
        elif kind == "store":
            ref = actor.store.remote(msg, np.zeros(64, np.uint8))
        else:
            ref = getattr(actor, kind).remote(msg)
        _typed(lambda: ray.get(ref, timeout=60), WireError, out)

    one()
    assert ray.get(actor.stats.remote())["pid"] == pid, "the KVNode actor restarted"
    out["same_process_after"] = 1
    return dict(out)


# -- the public API --------------------------------------------------------------------------------------------------
TOKENS = st.one_of(
    st.lists(st.integers(-5, 2**33), max_size=80), st.lists(SCALARS, max_size=5), SCALARS,
    st.builds(lambda n, dt: np.arange(n).astype(dt), st.integers(0, 80),
              st.sampled_from(["int64", "uint32", "int8", "float32", "bool"])),
    st.builds(lambda n, dim: np.zeros((n,) * dim, np.int64), st.integers(0, 4), st.integers(0, 3)))


def _tensors(spec):
    import torch

    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.uint8]
    return st.builds(lambda shape, dt: torch.zeros(shape, dtype=dt),
                     st.one_of(st.just(spec.kv_shape(64)), st.just(spec.chunk_shape),
                               st.just(spec.kv_shape(5)), st.lists(st.integers(0, 6), max_size=6)),
                     st.sampled_from(dtypes))


def fuzz_api(client, examples: int = 200, derandomize: bool = True) -> dict:
    from kvmesh.client import ChunkMatch, Match
    from kvmesh.config import KVMeshConfig
    from kvmesh.directory import Holder
    from kvmesh.spec import KVSpec

    spec = client.spec
    allowed = (TypeError, ValueError)
    out: Counter = Counter()
    matches = st.builds(
        lambda n, node, tier, ns, ct: Match(ns, ct, tuple(ChunkMatch(bytes([i]) * 16, (Holder(node, 1, tier),))
                                                          for i in range(n))),
        st.integers(0, 3), st.sampled_from([client.node_id or "", "no-such-node", ""]), st.integers(-1, 3),
        st.sampled_from([spec.namespace, b"\1" * 16]), st.sampled_from([spec.chunk_tokens, 7]))
    spec_fields = st.fixed_dictionaries({}, optional={
        "model_id": VALUES, "num_layers": VALUES, "num_kv_heads": VALUES, "head_dim": VALUES, "dtype": VALUES,
        "chunk_tokens": VALUES, "tp_rank": VALUES, "tp_size": VALUES, "lora_id": VALUES, "layout_version": VALUES})
    config_fields = st.dictionaries(st.sampled_from(list(KVMeshConfig.__dataclass_fields__) + ["bogus"]), VALUES,
                                    max_size=3)

    @_settings(examples, derandomize)
    @given(kind=st.sampled_from(["lookup", "fetch", "store", "lookup_keys", "store_keys", "spec", "config",
                                 "config_env"]),
           tokens=TOKENS, salt=st.one_of(st.none(), st.text(max_size=5), st.binary(max_size=5), SCALARS),
           match=st.one_of(matches, VALUES), kv=st.one_of(_tensors(spec), VALUES),
           device=st.one_of(st.sampled_from(["cpu", "meta", "bogus", "cuda:99"]), VALUES),
           deadline=st.one_of(st.none(), VALUES), group=st.one_of(K16, VALUES),
           keys=st.one_of(st.lists(K16, max_size=3), VALUES), fields=spec_fields, options=config_fields,
           env=st.dictionaries(st.sampled_from(["KVMESH_CPU_BYTES", "KVMESH_LEASE_S", "KVMESH_BOGUS",
                                                "KVMESH_COALESCE_PULLS", "KVMESH_PEER_TRANSPORT"]),
                               st.text(max_size=8), max_size=3))
    def one(kind, tokens, salt, match, kv, device, deadline, group, keys, fields, options, env):
        out["examples"] += 1
        if kind == "lookup":
            _typed(lambda: client.lookup(tokens, cache_salt=salt), allowed, out)
        elif kind == "fetch":
            _typed(lambda: client.fetch(match, device=device, deadline_s=deadline), allowed, out)
        elif kind == "store":
            _typed(lambda: client.store(tokens, kv, cache_salt=salt), allowed, out)
        elif kind == "lookup_keys":
            _typed(lambda: client.lookup_keys(group, keys), allowed, out)
        elif kind == "store_keys":
            chunks = [kv] * (len(keys) if isinstance(keys, list) else 1)
            _typed(lambda: client.store_keys(group, keys, chunks), allowed, out)
        elif kind == "spec":
            base = dict(model_id="m", num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32")
            _typed(lambda: KVSpec(**{**base, **fields}), allowed, out)
        elif kind == "config":
            _typed(lambda: KVMeshConfig(**options), allowed, out)
        else:
            _typed(lambda: KVMeshConfig.load(env=env), allowed, out)

    one()
    client.flush()
    return dict(out)


def valid_store(keys: list[bytes], group: bytes, size: int):
    """A well-formed StoreRequest and its buffer (for checking a node still serves after fuzzing)."""
    from kvmesh.tiers import checksum

    datas = [np.full(size, i + 1, dtype=np.uint8) for i in range(len(keys))]
    items = [StoreItem(group, k, size, checksum(d)) for k, d in zip(keys, datas)]
    return pack_store(items), np.concatenate(datas)
