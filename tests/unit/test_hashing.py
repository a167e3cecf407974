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


@pytest.mark.parametrize("chunk_tokens, n_tokens", [(1, 5), (3, 100), (256, 256 * 37 + 100)])
def test_long_chains_match_the_documented_layout(chunk_tokens, n_tokens):
    # the fast loop (one copied personalised state, memoryview slices) against the layout written out plainly
    toks = as_tokens(np.random.default_rng(n_tokens).integers(0, 2**32, n_tokens, dtype=np.uint64))
    h = hashlib.blake2b(SPEC.namespace + b"t", digest_size=16, person=b"kvmesh.salt").digest()
    want = []
    for i in range(n_tokens // chunk_tokens):
        chunk = b"".join(int(t).to_bytes(4, "little") for t in toks[i * chunk_tokens:(i + 1) * chunk_tokens])
        h = hashlib.blake2b(h + chunk, digest_size=16, person=b"kvmesh.chunk").digest()
        want.append(h)
    assert chunk_hashes(SPEC.namespace, toks, chunk_tokens, "t") == want
