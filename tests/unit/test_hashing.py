"""Chained chunk hashes: deterministic bytes, salted, prefix-shared, and the token normalisation in front."""

import hashlib
import os
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import torch

from kvmesh import KVSpec
from kvmesh.hashing import as_tokens, chunk_hashes, root_hash

SPEC = KVSpec("golden/llama@rev1", num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", chunk_tokens=4)


def test_golden_vectors():
    # The exact bytes are part of the wire contract: a change here orphans every cached chunk in every cluster.
    assert SPEC.namespace.hex() == "123a35b3f489c0e6957648b24045e1ed"
    assert [h.hex() for h in chunk_hashes(SPEC.namespace, as_tokens(range_list(10)), 4)] == [
        "b7639f8412e76d2465d71789b603cd71", "13990589414a49cf72d2d9c79373092f"]
    assert [h.hex() for h in chunk_hashes(SPEC.namespace, as_tokens(range_list(10)), 4, "tenant-a")] == [
        "f229af83ae256aa8f8f246aefde7d99a", "837fc706e308d8b93e9bb18c86eeec0b"]


def test_golden_vectors_follow_the_documented_layout():
    canon = msgpack.packb([b"kvmesh-spec", 1, "golden/llama@rev1", 2, 2, 4, "bfloat16", 4, 0, 1, "", 1],
                          use_bin_type=True)
    ns = hashlib.blake2b(canon, digest_size=16, person=b"kvmesh.spec").digest()
    assert ns == SPEC.namespace
    h = hashlib.blake2b(ns, digest_size=16, person=b"kvmesh.salt").digest()
    for i in range(2):
        tokens = b"".join(t.to_bytes(4, "little") for t in range(4 * i, 4 * i + 4))
        h = hashlib.blake2b(h + tokens, digest_size=16, person=b"kvmesh.chunk").digest()
        assert h == chunk_hashes(ns, as_tokens(range_list(10)), 4)[i]


def range_list(n):
    return list(range(n))


def test_same_hashes_in_processes_with_different_hash_seeds():
    code = ("from kvmesh import KVSpec; from kvmesh.hashing import as_tokens, chunk_hashes; "
            "s = KVSpec('m', 2, 2, 4, 'float16', chunk_tokens=8); "
            "print(','.join(h.hex() for h in chunk_hashes(s.namespace, as_tokens(list(range(50))), 8, 'salt'))); "
            "print(hash('make sure the seed matters'))")
    outs = []
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.append(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                   check=True).stdout.split("\n"))
    assert outs[0][1] != outs[1][1], "the two processes did not actually use different hash seeds"
    assert outs[0][0] == outs[1][0] and len(outs[0][0].split(",")) == 6


def test_salt_changes_every_chunk_and_prefixes_share_hashes():
    toks = as_tokens(list(range(100, 140)))
    plain = chunk_hashes(SPEC.namespace, toks, 4)
    salted = chunk_hashes(SPEC.namespace, toks, 4, b"tenant-b")
    assert not set(plain) & set(salted)
    assert root_hash(SPEC.namespace) != root_hash(SPEC.namespace, "x")
    # a prompt that shares the first 5 chunks shares exactly their hashes
    other = as_tokens(list(range(100, 120)) + [7] * 20)
    o = chunk_hashes(SPEC.namespace, other, 4)
    assert o[:5] == plain[:5] and not set(o[5:]) & set(plain)


def test_only_full_chunks_are_hashed():
    assert len(chunk_hashes(SPEC.namespace, as_tokens(range_list(3)), 4)) == 0
    assert len(chunk_hashes(SPEC.namespace, as_tokens(range_list(11)), 4)) == 2


def test_token_inputs_are_normalised_alike():
    ref = as_tokens([1, 2, 3, 2**32 - 1])
    for t in (np.array([1, 2, 3, 2**32 - 1], dtype=np.int64), torch.tensor([1, 2, 3, 2**32 - 1]),
              (1, 2, 3, 2**32 - 1), np.array([1, 2, 3, 2**32 - 1], dtype=np.uint32)):
        got = as_tokens(t)
        assert got.dtype == np.dtype("<u4") and np.array_equal(got, ref)


@pytest.mark.parametrize("bad,err", [
    ("abc", TypeError), (b"abc", TypeError), (3, TypeError), ([1.0, 2.0], TypeError), ([1, "2"], TypeError),
    (np.array([1.5]), TypeError), (torch.tensor([1.0]), TypeError), (torch.tensor([True]), TypeError),
    (np.zeros((2, 2), dtype=np.int64), ValueError), ([-1, 2], ValueError), ([2**32], ValueError),
    ([2**70], ValueError), ([True, False], TypeError),
])
def test_bad_tokens_raise_typed_errors_naming_the_argument(bad, err):
    with pytest.raises(err, match="tokens"):
        as_tokens(bad)


# -- the chain in C (kvmesh._chainhash) and in Python give the same bytes ------------------------------------------
def test_the_chain_in_c_is_built_here():
    # setup.py builds it wherever a C compiler is (this project's machines have one); a build that silently lost it
    # would hash every prompt ~25 % slower
    from kvmesh.hashing import native_chain_built

    assert native_chain_built()


@pytest.fixture(params=["c", "python"])
def chain_impl(request, monkeypatch):
    from kvmesh import hashing

    if request.param == "python":
        monkeypatch.setattr(hashing, "_native_chain", None)
    elif not hashing.native_chain_built():
        pytest.skip("kvmesh._chainhash is not built")
    return request.param


def test_golden_vectors_in_both_implementations(chain_impl):
    test_golden_vectors()
    test_golden_vectors_follow_the_documented_layout()


# every way a chunk's message (16 bytes of the previous hash, then the chunk) meets BLAKE2b's 128-byte blocks: one
# block, exactly one, one byte more, whole blocks, and long chunks
@pytest.mark.parametrize("chunk_tokens", [1, 2, 3, 27, 28, 29, 31, 32, 33, 60, 64, 100, 252, 256, 257, 1000, 4096])
def test_the_chain_is_the_documented_layout_for_every_chunk_size(chain_impl, chunk_tokens):
    for n_tokens, salt in ((chunk_tokens * 3 + chunk_tokens // 2, None), (chunk_tokens * 2, "t" * 300),
                           (chunk_tokens - 1, "x"), (min(chunk_tokens * 37, 40_000) + 1, "t")):
        toks = as_tokens(np.random.default_rng(chunk_tokens).integers(0, 2**32, n_tokens, dtype=np.uint64))
        h = hashlib.blake2b(SPEC.namespace + (salt or "").encode(), digest_size=16, person=b"kvmesh.salt").digest()
        want = []
        for i in range(n_tokens // chunk_tokens):
            chunk = b"".join(int(t).to_bytes(4, "little") for t in toks[i * chunk_tokens:(i + 1) * chunk_tokens])
            h = hashlib.blake2b(h + chunk, digest_size=16, person=b"kvmesh.chunk").digest()
            want.append(h)
        got = chunk_hashes(SPEC.namespace, toks, chunk_tokens, salt)
        assert got == want and all(type(g) is bytes for g in got)


def test_the_chain_of_a_slice_or_a_copy_of_the_tokens_is_the_same():
    toks = as_tokens(np.random.default_rng(5).integers(0, 2**32, 4 * 64 + 7, dtype=np.uint64))
    whole = chunk_hashes(SPEC.namespace, toks, 64)
    assert chunk_hashes(SPEC.namespace, as_tokens(toks[: 3 * 64 + 1]), 64) == whole[:3]
    assert chunk_hashes(SPEC.namespace, as_tokens(list(map(int, toks))), 64) == whole


def test_the_c_chain_refuses_bad_arguments_with_a_typed_error():
    from kvmesh import hashing

    if not hashing.native_chain_built():
        pytest.skip("kvmesh._chainhash is not built")
    chain = hashing._native_chain
    for args in ((b"x" * 15, b"", 4, b"p"), (b"x" * 16, b"abc", 2, b"p"), (b"x" * 16, b"", 0, b"p"),
                 (b"x" * 16, b"", 4, b"p" * 17)):
        with pytest.raises(ValueError, match="chain:"):
            chain(*args)
    with pytest.raises(TypeError):
        chain("x" * 16, b"", 4, b"p")
    assert chain(b"x" * 16, b"", 4, b"p") == []
