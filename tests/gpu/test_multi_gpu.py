"""A GPU tier on GPU 0 read by a worker on GPU 1 (issue 20): the node is bench.gpu_node's stand-in process (a real
GpuTier, its pool on cuda:0), this process maps the pool through CUDA IPC and reads into cuda:1, peer to peer where
the GPUs allow and through page-locked host memory with peer=False. The cross-GPU cases skip below two GPUs; the
`same` case runs every step with the reader on cuda:0 too (path d2d instead of p2p), so a 1-GPU machine runs it."""

import pytest
import torch

from kvmesh.tiers.devsum import device_checksum, reference_checksum
from bench.gpu_ipc_layerwise import read_to_device
from kvmesh.tiers.gpu_ipc import PoolMapper, read_chunks, write_chunks
from tests.gpu.test_gpu_ipc import CB, SPEC, views

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")]
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs >= 2 CUDA devices")
READERS = [pytest.param(1, id="cross", marks=two_gpus), pytest.param(0, id="same")]


@pytest.fixture(scope="module")
def node():
    from bench.gpu_node import GpuNodeProcess

    n = GpuNodeProcess(16, CB, device="cuda:0")
    yield n
    n.close()


def expected_path(reader: torch.device, peer) -> str:
    """What `read_chunks` should take from a pool on cuda:0 into `reader`."""
    if peer is False:
        return "host"
    if reader.index == 0:
        return "d2d"
    return "p2p" if torch.cuda.can_device_access_peer(reader.index, 0) else "host"


@pytest.mark.parametrize("reader_index", READERS)
@pytest.mark.parametrize("peer", [None, False], ids=["peer", "host"])
def test_a_chunk_on_gpu0_reads_into_the_reader_gpu_bit_exact_and_verified(node, reader_index, peer):
    reader = torch.device("cuda", reader_index)
    placed = node.store_random(3, seed=30 + 2 * reader_index + (peer is False))  # (a new key per case)
    slots, sums = [s for s, _ in placed], [v for _, v in placed]
    mapper = PoolMapper()
    src = views(mapper, node.exports(), slots)
    assert src[0].device == torch.device("cuda", 0)  # the pool is on GPU 0 in this process too
    dst = [torch.empty(CB, dtype=torch.uint8, device=reader) for _ in slots]
    with torch.cuda.device(reader):
        r = read_chunks(src, dst, sums, peer=peer)
        assert r.path == expected_path(reader, peer)
        assert r.verified() and r.good_prefix() == 3
        r.wait()
        for s, d in zip(slots, dst):
            host = node.chunk(s)
            assert d.device == reader and d.cpu().numpy().tobytes() == host
            assert int(device_checksum(d)) == reference_checksum(host)
    mapper.close()


@pytest.mark.parametrize("reader_index", READERS)
def test_a_corrupted_byte_on_gpu0_fails_verification_on_both_paths(node, reader_index):
    reader = torch.device("cuda", reader_index)
    placed = node.store_random(3, seed=40 + reader_index)
    slots, sums = [s for s, _ in placed], [v for _, v in placed]
    mapper = PoolMapper()
    src = views(mapper, node.exports(), slots)
    dst = [torch.empty(CB, dtype=torch.uint8, device=reader) for _ in slots]
    node.corrupt(slots[1], offset=777)
    try:
        with torch.cuda.device(reader):
            for peer in (None, False):
                r = read_chunks(src, dst, sums, peer=peer)
                assert not r.verified() and r.good_prefix() == 1, peer
    finally:
        node.corrupt(slots[1], offset=777)  # the same flip again: whole for the tests after
    assert node.verify(slots) == [True, True, True]
    mapper.close()


@pytest.mark.parametrize("reader_index", READERS)
def test_a_layerwise_load_from_gpu0_lands_on_the_reader_verified(node, reader_index):
    reader = torch.device("cuda", reader_index)
    placed = node.store_random(4, seed=50 + reader_index)
    slots, sums = [s for s, _ in placed], [v for _, v in placed]
    mapper = PoolMapper()
    src = views(mapper, node.exports(), slots)
    with torch.cuda.device(reader):
        load = read_to_device(src, SPEC, reader, sums, min_copy_bytes=1)
        for layer in range(SPEC.num_layers):
            load.wait(layer)
        assert load.staging.device == reader and load.verified()
        got = load.staging.view(4, -1).view(torch.uint8).cpu()
    for i, s in enumerate(slots):
        assert got[i].numpy().tobytes() == node.chunk(s)
    mapper.close()


@pytest.mark.parametrize("reader_index", READERS)
def test_a_store_from_the_reader_gpu_lands_on_gpu0_with_its_device_sums(node, reader_index):
    reader = torch.device("cuda", reader_index)
    mapper = PoolMapper()
    slots = node.reserve(3)
    src = [torch.randint(0, 256, (CB,), dtype=torch.uint8, device=reader) for _ in slots]
    with torch.cuda.device(reader):
        w = write_chunks(src, views(mapper, node.exports(), slots))
        sums = w.sums()
    assert w.path == expected_path(reader, None)
    assert sums == [int(device_checksum(s)) for s in src]
    assert node.complete_device(slots, sums) == [True, True, True]
    for s, x in zip(slots, src):
        assert node.chunk(s) == x.cpu().numpy().tobytes()
    node.check_integrity()
    mapper.close()


@two_gpus
def test_peer_access_between_the_two_gpus_is_reported_both_ways():
    """The bench reports it; NVLink (or PCIe P2P) pairs allow it both ways, else `read_chunks` takes the host."""
    from bench.gpu_multi import peer_access

    p = peer_access(torch.device("cuda", 0), torch.device("cuda", 1))
    assert p["same_device"] is False
    assert p["reader_can_access_node"] == p["node_can_access_reader"]
