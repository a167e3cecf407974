"""Reuse through the raw API is counted: a worker's `store`, `lookup` and `fetch`, then the live page's API (served
over HTTP by a real `Dashboard` on the test cluster's directory) and the client's counters (what the metrics export)
show the fetched tokens as reused, local or peer, once, also when an integration reports its own requests."""

import json
import urllib.request

import torch

import kvmesh
from kvmesh.cost import LinkModel
from kvmesh.dashboard import Dashboard
from kvmesh.integrations.hf import generate, spec_for_model, tiny_llama
from tests.conftest import wait_until
from tests.integration.conftest import on_node

C = 16  # tokens per chunk
SPEC = kvmesh.KVSpec("raw-api-counting", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=C)
REUSED = ("reused_tokens_local", "reused_tokens_peer", "recomputed_tokens")


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def w_store(toks: list[int], salt: str) -> int:
    c = kvmesh.connect(SPEC, cache_salt=salt)
    try:
        n = c.store(toks, torch.randn(SPEC.kv_shape(len(toks))).to(torch.float16))
        c.flush()
        return n
    finally:
        c.close()


def w_fetch(toks: list[int], salt: str, report: bool = False, count_fetches: bool = True) -> dict:
    """lookup + fetch; `report`: then report the request as an integration does (reuse and the recomputed tail)."""
    c = kvmesh.connect(SPEC, cache_salt=salt, count_fetches=count_fetches)
    try:
        m = c.lookup(toks)
        kv = c.fetch(m)
        got = kv.shape[2]
        st = c.last_fetch
        if report:
            c.record_request(st.local_chunks * C, st.peer_chunks * C, len(toks) - got)
        return {"matched": m.num_tokens, "got": got, "local": st.local_chunks * C, "peer": st.peer_chunks * C,
                "counts": {k: c.counts[k] for k in REUSED}}
    finally:
        c.close()  # flushes its telemetry into the directory's totals


class Page:
    """The live page's API, as a browser polls it."""

    def __init__(self, redis_url: str) -> None:
        self.dash = Dashboard(redis_url, "it", port=0).start()

    def state(self) -> dict:
        return json.load(urllib.request.urlopen(self.dash.url + "api/state", timeout=10))

    def totals(self) -> dict:
        s = self.state()
        t = s["totals"]
        assert s["reused_tokens"] == t.get("reused_tokens_local", 0) + t.get("reused_tokens_peer", 0)
        return {k: t.get(k, 0) for k in REUSED}

    def settled(self, before: dict, want: dict) -> dict:
        """The page's totals once they moved by `want` (the page samples every second); fails if they move by
        anything else."""
        def moved():
            now = self.totals()
            delta = {k: now[k] - before[k] for k in REUSED}
            return delta if delta == want else None
        try:
            return wait_until(moved, 15, interval_s=0.25)
        except AssertionError:
            now = self.totals()
            raise AssertionError(f"page moved by {({k: now[k] - before[k] for k in REUSED})}, want {want}") from None

    def close(self) -> None:
        self.dash.stop()


def test_a_raw_fetch_counts_its_tokens_as_reused_local_and_peer(mesh, redis_server):
    a, b = mesh.node_ids[:2]
    toks = tokens(1, 7 * C + 5)  # 7 full chunks and a partial one, which is never stored
    page = Page(redis_server.url)
    try:
        before = page.totals()
        assert on_node(a, w_store, toks, "raw-1") == 7
        here = on_node(a, w_fetch, toks, "raw-1")  # the chunks' own node: from its slab
        assert (here["matched"], here["got"], here["local"], here["peer"]) == (7 * C, 7 * C, 7 * C, 0)
        # what the metrics export (telemetry.CLIENT_EXPORTS) is these counters
        assert here["counts"] == {"reused_tokens_local": 7 * C, "reused_tokens_peer": 0, "recomputed_tokens": 0}
        there = on_node(b, w_fetch, toks, "raw-1")  # another node: pulled from node a
        assert (there["got"], there["local"], there["peer"]) == (7 * C, 0, 7 * C)
        assert there["counts"] == {"reused_tokens_local": 0, "reused_tokens_peer": 7 * C, "recomputed_tokens": 0}
        # the raw API reports no prefill of its own, so nothing counts as recomputed
        page.settled(before, {"reused_tokens_local": 7 * C, "reused_tokens_peer": 7 * C, "recomputed_tokens": 0})
        s = page.state()
        assert s["reused_tokens"] >= 14 * C and s["reuse_fraction"] is not None
    finally:
        page.close()


def test_a_request_reported_by_its_caller_is_not_counted_twice(mesh, redis_server):
    a, b = mesh.node_ids[:2]
    toks = tokens(2, 4 * C + 3)
    page = Page(redis_server.url)
    try:
        on_node(a, w_store, toks, "raw-2")
        before = page.totals()
        # an integration on a default client (hf, SGLang): its fetch counted the reuse, its report adds the
        # recomputed tail only
        r = on_node(b, w_fetch, toks, "raw-2", report=True)
        assert r["counts"] == {"reused_tokens_local": 0, "reused_tokens_peer": 4 * C, "recomputed_tokens": 3}
        page.settled(before, {"reused_tokens_local": 0, "reused_tokens_peer": 4 * C, "recomputed_tokens": 3})
        # an integration whose fetches do not count (vLLM's clients): its report is the one count
        before = page.totals()
        r = on_node(a, w_fetch, toks, "raw-2", report=True, count_fetches=False)
        assert r["counts"] == {"reused_tokens_local": 4 * C, "reused_tokens_peer": 0, "recomputed_tokens": 3}
        # ... and without a report such a client counts nothing: the fetch is not a request of its own
        r = on_node(a, w_fetch, toks, "raw-2", count_fetches=False)
        assert r["got"] == 4 * C and r["counts"] == {k: 0 for k in REUSED}
        page.settled(before, {"reused_tokens_local": 4 * C, "reused_tokens_peer": 0, "recomputed_tokens": 3})
    finally:
        page.close()


def _model():
    return tiny_llama(seed=3, vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=128)


def w_generate(prompt: list[int]) -> dict:
    torch.set_num_threads(1)
    m = _model()
    client = kvmesh.connect(spec_for_model(m, chunk_tokens=C))
    # a synthetic machine where loading a chunk is 100 times faster than computing it: the plan loads it all
    for n in (16, 32, 64, 128):
        client.cost.prefill.observe(n, 0, 1e-3 * n / C)
    for name in ("local", "peer"):
        client.cost.links[name] = LinkModel(client.spec.chunk_bytes / 1e-5, 1e-9)
    try:
        r = generate(m, prompt, max_new_tokens=2, client=client)
        client.flush()
        return {"reused": r.reused_tokens, "local": r.reused_local_tokens, "peer": r.reused_peer_tokens,
                "computed": r.computed_tokens, "counts": {k: client.counts[k] for k in REUSED}}
    finally:
        client.close()


def test_the_hf_integration_counts_each_request_once(mesh, redis_server):
    a, b = mesh.node_ids[:2]
    prompt = torch.randint(0, 512, (5 * C + 7,), generator=torch.Generator().manual_seed(4)).tolist()
    page = Page(redis_server.url)
    try:
        before = page.totals()
        first = on_node(a, w_generate, prompt)  # computes and stores 5 chunks
        assert first["reused"] == 0 and first["counts"]["recomputed_tokens"] == len(prompt)
        page.settled(before, {"reused_tokens_local": 0, "reused_tokens_peer": 0, "recomputed_tokens": len(prompt)})
        before = page.totals()
        again = on_node(b, w_generate, prompt)  # fetches them from node a: hf reports, the fetch counted
        assert again["reused"] == 5 * C and again["peer"] == 5 * C and again["computed"] == 7
        assert again["counts"] == {"reused_tokens_local": 0, "reused_tokens_peer": 5 * C, "recomputed_tokens": 7}
        page.settled(before, {"reused_tokens_local": 0, "reused_tokens_peer": 5 * C, "recomputed_tokens": 7})
    finally:
        page.close()
