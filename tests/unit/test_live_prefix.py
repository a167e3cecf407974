"""The live prefix over a plain NodeTable, without Redis (`kvmesh.directory.prefix`): which leading chunks of a
prompt have a live holder, who they are, and why the run stops. The reasons are what `Match.why` carries ("" for
None) and what the client counts misses by (`miss_not_cached`, `miss_holder_dead`)."""

import pytest

from kvmesh.directory import Holder, NodeTable
from kvmesh.directory.prefix import HOLDER_DEAD, NOT_CACHED, live_prefix, longest_prefix, names_newer, runs
from kvmesh.directory.records import HOLDERS_VERSION, HolderDecoder, decode_holders, encode_holders
from kvmesh.tiers import TIER_CPU, TIER_DISK, TIER_GPU
from kvmesh.wire import NodeInfo


def table(*nodes: tuple[str, int], dead: dict[str, int] | None = None) -> NodeTable:
    """A table of live (node id, incarnation) pairs, as `Directory.node_table` builds it; `dead`: node id -> the
    incarnation whose lease lapsed."""
    live = {inc: NodeInfo(node, f"kvnode-{node}", f"/dev/shm/{node}", 1 << 20, 4096, incarnation=inc)
            for node, inc in nodes}
    dead = dead or {}
    return NodeTable(b"epoch", 1_000, live, tuple(dead), {inc: 9_000 for inc in live}, dead)


def entry(*holders: tuple[int, int]) -> bytes:
    return encode_holders(list(holders))


A, B, C = ("node-a", 11), ("node-b", 12), ("node-c", 13)


def test_a_chain_whose_every_chunk_has_a_live_holder_is_matched_whole():
    t = table(A, B)
    values = [entry((11, TIER_CPU)), entry((11, TIER_CPU), (12, TIER_GPU)), entry((12, TIER_DISK))]
    holders, why = longest_prefix(values, t)
    assert why is None  # (Match.why "": the whole prompt's full chunks)
    assert holders == [(Holder("node-a", 11, TIER_CPU),),
                       (Holder("node-b", 12, TIER_GPU), Holder("node-a", 11, TIER_CPU)),  # by tier: GPU first
                       (Holder("node-b", 12, TIER_DISK),)]


def test_the_callers_own_node_comes_first_then_by_tier():
    t = table(A, B, C)
    value = entry((13, TIER_DISK), (12, TIER_GPU), (11, TIER_CPU))
    holders, _ = longest_prefix([value], t, prefer="node-c")
    assert [h.node_id for h in holders[0]] == ["node-c", "node-b", "node-a"]
    holders, _ = longest_prefix([value], t)
    assert [h.node_id for h in holders[0]] == ["node-b", "node-a", "node-c"]


def test_a_dead_holder_mid_chain_ends_the_prefix_there():
    t = table(A, dead={"node-b": 12})
    values = [entry((11, TIER_CPU)), entry((11, TIER_CPU)), entry((12, TIER_CPU)), entry((11, TIER_CPU))]
    holders, why = longest_prefix(values, t)
    assert len(holders) == 2 and why == HOLDER_DEAD == "holder_dead"  # (not past it, though chunk 3 is held)


def test_a_dead_holder_beside_a_live_one_is_dropped_and_the_prefix_goes_on():
    t = table(A, dead={"node-b": 12})
    holders, why = longest_prefix([entry((12, TIER_GPU), (11, TIER_CPU))] * 3, t)
    assert holders == [(Holder("node-a", 11, TIER_CPU),)] * 3 and why is None


def test_a_superseded_incarnation_is_no_holder():
    # node-a restarted: its incarnation 11 is gone, 21 is current. Entries of 11 are not node-a's chunks any more
    t = table(("node-a", 21), dead={})
    holders, why = longest_prefix([entry((11, TIER_CPU))], t)
    assert holders == [] and why == HOLDER_DEAD
    holders, why = longest_prefix([entry((11, TIER_GPU), (21, TIER_CPU))], t)
    assert holders == [(Holder("node-a", 21, TIER_CPU),)] and why is None


def test_a_holder_listed_at_several_tiers_is_one_holder_per_tier_gpu_first():
    t = table(A, B)
    holders, why = longest_prefix([entry((11, TIER_DISK), (11, TIER_GPU), (12, TIER_CPU), (11, TIER_CPU))], t)
    assert why is None
    assert holders[0] == (Holder("node-a", 11, TIER_GPU), Holder("node-b", 12, TIER_CPU),
                          Holder("node-a", 11, TIER_CPU), Holder("node-a", 11, TIER_DISK))
    holders, _ = longest_prefix([entry((11, TIER_DISK), (11, TIER_GPU), (12, TIER_CPU))], t, prefer="node-b")
    assert holders[0][0] == Holder("node-b", 12, TIER_CPU)


def test_an_empty_chain_matches_nothing_and_does_not_stop_short():
    assert longest_prefix([], table(A)) == ([], None)
    assert live_prefix([], table(A)) == ([], None)


@pytest.mark.parametrize("values,length,why", [
    ([None], 0, "not_cached"),  # the first chunk is not cached: nothing is
    ([b"A", b"A", None, b"A"], 2, NOT_CACHED),  # no entry: the chain names its prefix, nothing past it is cached
    ([b"A", b"D"], 1, HOLDER_DEAD),  # an entry whose every holder is dead
    ([b"A", b"U"], 1, HOLDER_DEAD),  # an entry this version cannot read names no holder
    ([b"A", b"E"], 1, HOLDER_DEAD),  # an entry that lists no holder
    ([b"A", b"A", b"A"], 3, None),  # the whole chain
])
def test_why_the_prefix_stops(values, length, why):
    named = {b"A": entry((11, TIER_CPU)), b"D": entry((12, TIER_CPU)), b"U": bytes([HOLDERS_VERSION + 1, 0]),
             b"E": bytes([HOLDERS_VERSION])}
    t = table(A, dead={"node-b": 12})
    values = [named.get(v) if v is not None else None for v in values]
    holders, got = longest_prefix(values, t)
    assert (len(holders), got) == (length, why)
    assert live_prefix(runs(values), t) == (holders, got)  # the same, from runs of one value


def test_runs_count_the_chunks_in_a_row_of_one_value():
    a, b = entry((11, TIER_CPU)), entry((12, TIER_CPU))
    assert runs([a, a, b, None, None, a]) == [(a, 2), (b, 1), (None, 2), (a, 1)]
    assert runs([]) == []
    holders, why = live_prefix([(a, 300), (None, 1)], table(A))  # (summaries give runs of a bucket or more)
    assert len(holders) == 300 and why == NOT_CACHED


def test_an_incarnation_newer_than_the_table_asks_for_a_newer_table_once():
    old, new = table(A), table(A, ("node-d", 40))
    asked = []

    def newer():
        asked.append(1)
        return new

    values = [entry((11, TIER_CPU), (40, TIER_GPU))] * 2 + [entry((40, TIER_CPU))]
    holders, why = longest_prefix(values, old, newer=newer)
    assert asked == [1] and why is None and holders[-1] == (Holder("node-d", 40, TIER_CPU),)
    assert holders[0] == (Holder("node-d", 40, TIER_GPU), Holder("node-a", 11, TIER_CPU))
    asked.clear()
    longest_prefix([entry((11, TIER_CPU))], old, newer=newer)
    assert asked == []  # nothing newer than the table: not asked
    holders, why = longest_prefix([entry((40, TIER_CPU))], old)  # without `newer`, a node the table does not know
    assert holders == [] and why == HOLDER_DEAD
    assert names_newer([entry((40, TIER_CPU))], old.newest()) and not names_newer([entry((11, 1))], old.newest())


def test_holders_values_decode_as_the_scripts_write_them():
    value = entry((11, TIER_CPU), (4_000_000_000, TIER_DISK))
    assert value[0] == HOLDERS_VERSION and len(value) == 1 + 5 * 2
    assert decode_holders(value) == ((11, TIER_CPU), (4_000_000_000, TIER_DISK))
    assert decode_holders(b"") == decode_holders(value[:-1]) == decode_holders(b"\x01" + value[1:]) == ()
    cached = HolderDecoder()
    assert cached(value) == decode_holders(value) and cached(value) is cached(value)
    t = table(A)
    assert longest_prefix([value], t, decode=cached) == longest_prefix([value], t)
