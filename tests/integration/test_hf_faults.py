"""transformers workers around KVNode faults (found by a seeded model-level differential hunt): a worker that
connects while its node's KVNode restarts, ... Each output is compared with a recompute without kvmesh."""

import ray
import torch

import kvmesh
from kvmesh.integrations.hf import generate, spec_for_model, tiny_llama
from kvmesh.mesh import node_actors
from tests.conftest import wait_until
from tests.integration.conftest import on_node
from tests.integration.test_mesh import pid_alive

CHUNK = 16


def model():
    return tiny_llama(seed=11, vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=128, initializer_range=0.2)


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def w_generate(tokens, use_kvmesh: bool):
    torch.set_num_threads(1)
    m = model()
    client = kvmesh.connect(spec_for_model(m, chunk_tokens=CHUNK)) if use_kvmesh else None
    try:
        r = generate(m, tokens, max_new_tokens=6, client=client, keep_logits=True)
        if client:
            client.flush()
        return r
    finally:
        if client:
            client.close()


def w_kill_then_generate(tokens):
    """A worker process that has talked to its node's KVNode (a first request) connects again just as that
    KVNode's process dies (killed here; Ray restarts it)."""
    first = w_generate(tokens, True)
    me = ray.get_runtime_context().get_node_id()
    ray.kill(node_actors()[me], no_restart=False)
    return first, w_generate(tokens, True)


def test_a_worker_that_connects_while_ray_restarts_its_kvnode_waits_for_it(mesh):
    # Ray restarts a KVNode whose process died (max_restarts=-1); until the new process is up its calls fail with
    # ActorUnavailableError. connect took that for "no KVNode runs on this Ray node (call kvmesh.start first)" and
    # raised a RuntimeError: a worker started during the restart (a second or two) could not start at all.
    _, _, c = mesh.node_ids
    p = prompt(CHUNK * 3 + 5, seed=1)
    plain = on_node(c, w_generate, p, False)
    pid = ray.get(node_actors()[c].stats.remote(), timeout=30)["pid"]
    first, r = on_node(c, w_kill_then_generate, p)
    assert not pid_alive(pid)
    assert first.tokens == plain.tokens and r.tokens == plain.tokens
    # the restarted node stores and serves again (for the tests after this one)
    wait_until(lambda: on_node(c, w_generate, p, True).reused_tokens == CHUNK * 3, 30, 0.2)
