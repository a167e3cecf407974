"""Worker processes that fork: a client made in the parent, used or closed in the child, and kvmesh.connect in a
child that inherited its parent's Ray connection. Either it works or it says so at once, typed: never a wait on a
Ray connection that is not there, a silent miss, or a store counted as handed over and never made."""

import multiprocessing
import os
import pickle
import signal
import time

import ray
import torch

import kvmesh
from kvmesh import KVSpec
from tests.integration.conftest import on_node
from tests.integration.test_mesh import random_kv, tokens
from tests.integration.test_mesh import spec as mesh_spec


def spec(model="fork") -> KVSpec:
    return mesh_spec(model)


def in_forked_child(fn, start_method: str = "os.fork", timeout_s: int = 15):
    """fn() in a forked child of this process: ("ok", repr of its result) or ("raised", type name, message), and
    the seconds it took; ("killed", status) if it had not answered within timeout_s."""
    r, w = os.pipe()

    def child():
        os.close(r)
        signal.alarm(timeout_s)
        try:
            out = ("ok", repr(fn()))
        except BaseException as e:
            out = ("raised", type(e).__name__, str(e))
        os.write(w, pickle.dumps(out))
        os._exit(0)

    t0 = time.monotonic()
    if start_method == "os.fork":
        pid = os.fork()
        if pid == 0:
            child()
        os.close(w)
    else:
        proc = multiprocessing.get_context("fork").Process(target=child)
        proc.start()
        os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    if start_method == "os.fork":
        _, status = os.waitpid(pid, 0)
    else:
        proc.join()
        status = proc.exitcode
    return (pickle.loads(data) if data else ("killed", status)), time.monotonic() - t0


def w_use_the_parents_client(s, toks, kv):
    c = kvmesh.connect(s)
    assert c.fetch(c.lookup(toks)).shape[2] == len(toks)  # (the parent has used its client: threads, a mapping)
    other, other_kv = tokens(64, 99), random_kv(s, 64, 99)
    out = {
        "fetch": in_forked_child(lambda: c.fetch(c.lookup(toks)).shape[2]),
        "store": in_forked_child(lambda: (c.store(other, other_kv), c.flush(5))),
        "lookup": in_forked_child(lambda: c.lookup(toks).num_tokens),
        "close": in_forked_child(lambda: (c.close(), c.closed)),
    }
    got = c.fetch(c.lookup(toks))  # the parent's client is untouched by all that
    out["parent"] = torch.equal(got, kv), c.lookup(other).num_tokens
    c.close()
    return out


def w_connect_in_a_child(s, toks, start_method):
    c = kvmesh.connect(s)
    c.close()
    return in_forked_child(lambda: kvmesh.connect(s).lookup(toks).num_tokens, start_method)


def test_a_client_made_before_a_fork_says_so_in_the_child_and_the_parent_s_keeps_working(mesh):
    s = spec("fork-client")
    toks, kv = tokens(128, 5), random_kv(s, 128, 5)
    c = kvmesh.connect(s)
    c.store(toks, kv)
    assert c.flush() == 4
    c.close()
    nid = ray.get_runtime_context().get_node_id()
    out = on_node(nid, w_use_the_parents_client, s, toks, kv)
    for call in ("fetch", "store", "lookup"):
        (result, seconds) = out[call]
        assert result[:2] == ("raised", "ForkedProcessError"), (call, result)
        assert "kvmesh.connect" in result[2] and seconds < 3, (call, result, seconds)
    assert out["close"][0] == ("ok", "(None, True)"), out["close"]
    # the parent reads its KV bit-exact; the child's refused store made nothing
    assert out["parent"] == (True, 0)


def test_connect_in_a_child_that_inherited_its_parent_s_ray_connection_says_so_at_once(mesh):
    s = spec("fork-connect")
    nid = ray.get_runtime_context().get_node_id()
    for start_method in ("os.fork", "multiprocessing-fork"):
        result, seconds = on_node(nid, w_connect_in_a_child, s, tokens(64, 1), start_method)
        assert result[:2] == ("raised", "ForkedProcessError"), (start_method, result, seconds)
        assert "spawn" in result[2] and seconds < 3, (start_method, result, seconds)
