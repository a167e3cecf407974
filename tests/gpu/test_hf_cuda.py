"""Reuse through every transformers model family of tests/integration/test_hf_architectures.py on a GPU, in
float32 and bfloat16: a prompt of 5 chunks and 7 tokens is computed and stored by one client; a longer one that
shares it is reused by another (fetched from the node's slab straight onto the device) and must give the greedy
tokens of a full recompute on the GPU, logits within the dtype's tolerance. No Ray on the GPU machine: a KVNode as
a plain object against a real redis-server. Skipped without CUDA."""

import pytest
import torch

from kvmesh.connecting import connect_local
from kvmesh.config import KVMeshConfig
from kvmesh.integrations.hf import generate, spec_for_model
from kvmesh.node import KVNode
from tests.hf_archs import ARCHS, CHUNK, model, prompt

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ATOL = {"float32": 1e-3, "bfloat16": 0.15}  # the reused run computes the suffix alone: other kernel shapes


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    from kvmesh.local import RedisServer

    shm = str(tmp_path_factory.mktemp("hf-cuda"))
    with RedisServer() as server:
        cfg = KVMeshConfig(redis_url=server.url, key_prefix="hfc", cpu_bytes=256 << 20, slot_bytes=1 << 20,
                           shm_dir=shm)
        n = KVNode(cfg, "node-hf-cuda" * 3, "kvnode-hfc")
        yield n
        n.shutdown()


def run(m, tokens, client):
    r = generate(m, tokens, max_new_tokens=8, client=client, keep_logits=True)
    if client is not None:
        client.flush()
    return r


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_stored_prefix_is_reused_on_the_gpu_with_the_tokens_of_a_recompute(node, arch, dtype):
    m = model(arch).to("cuda", getattr(torch, dtype))
    spec = spec_for_model(m, chunk_tokens=CHUNK)
    doc = prompt(5 * CHUNK + 7, seed=ARCHS.index(arch) + 50 * (dtype == "bfloat16"))
    longer = doc + prompt(9, seed=101)
    writer = connect_local(spec, node)
    try:
        first = run(m, doc, writer)
    finally:
        writer.close()
    assert first.reused_tokens == 0 and first.stored_chunks == 5
    reader = connect_local(spec, node)
    try:
        reused = run(m, longer, reader)
        assert reader.counts["fetched_chunks_to_device"] == 5, dict(reader.counts)
    finally:
        reader.close()
    plain = run(m, longer, None)
    assert reused.reused_tokens == 5 * CHUNK
    assert reused.tokens == plain.tokens
    assert torch.allclose(reused.first_logits.float(), plain.first_logits.float(), atol=ATOL[dtype], rtol=0)
    assert run(m, prompt(len(longer), seed=200), None).tokens != plain.tokens  # the comparison proves something
