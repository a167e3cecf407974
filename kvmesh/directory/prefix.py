"""The live prefix: given the entry values of a prompt's chunks (in order, from its first chunk) and a plain
`NodeTable`, which leading chunks have a live holder, who those holders are, and why the run stops. Pure: no Redis,
no clock; what a lookup reads comes in as values (or runs of one value), and the liveness it is judged by is the
table's.

An entry is live only while its incarnation is the node's current one and that node's lease deadline has not
passed: the table lists exactly those (`NodeTable.live`), so an entry naming any other incarnation (a dead node, a
node that restarted since) is no holder. The run stops at the first chunk without an entry (`NOT_CACHED`) or whose
entry names no live holder (`HOLDER_DEAD`); `why` is None when it does not stop before the values end. Callers pass
the reason on as `Match.why` ("" for None) and count misses by it (`miss_not_cached`, `miss_holder_dead`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from kvmesh.directory.records import Holder, NodeTable, decode_holders

NOT_CACHED = "not_cached"  # a chunk has no entry: nothing past it is cached (a prompt's chain names its prefix)
HOLDER_DEAD = "holder_dead"  # a chunk has an entry, but every holder it names is dead or superseded

Runs = Iterable[tuple[bytes | None, int]]
Decode = Callable[[bytes], tuple[tuple[int, int], ...]]


def runs(values: list[bytes | None]) -> list[tuple[bytes | None, int]]:
    """Entry values as runs of one value: (value, how many chunks in a row)."""
    return [(v, len(list(run))) for v, run in itertools.groupby(values)]


def names_newer(values: Iterable[bytes], newest: int, decode: Decode = decode_holders) -> bool:
    """Whether an entry among `values` names an incarnation newer than `newest` (one that joined after the table
    was read)."""
    return any(inc > newest for v in values for inc, _ in decode(v))


def live_prefix(
    entries: Runs,
    table: NodeTable,
    prefer: str | None = None,
    newer: Callable[[], NodeTable] | None = None,
    decode: Decode = decode_holders,
) -> tuple[list[tuple[Holder, ...]], str | None]:
    """The holders of each leading chunk that has at least one live holder in `table`, and why the run ends before
    `entries` do (NOT_CACHED, HOLDER_DEAD; None if it does not). `entries`: the chunks' values as runs (value or
    None for no entry, how many chunks in a row); each distinct value is decoded and filtered once per call. A
    chunk's holders: the node `prefer` (the caller's own) first, then by tier (GPU, CPU, disk), the order the value
    lists them in otherwise. `newer()`: a table read now, asked (at most once) when an entry names an incarnation
    newer than `table` knows, so a node that joined since `table` was read counts as a holder."""
    out: list[tuple[Holder, ...]] = []
    memo: dict[bytes, tuple[Holder, ...]] = {}
    why = None
    newest = table.newest() if newer is not None else 0
    for v, count in entries:
        if v is None:
            why = NOT_CACHED
            break
        row = memo.get(v)
        if row is None:
            if newer is not None and names_newer((v,), newest, decode):
                table, newer = newer(), None  # a node joined since `table` was read
            hs = [
                Holder(info.node_id, inc, tier) for inc, tier in decode(v) if (info := table.live.get(inc)) is not None
            ]
            row = memo[v] = tuple(sorted(hs, key=lambda h: (h.node_id != prefer, h.tier)))
        if not row:
            why = HOLDER_DEAD
            break
        out.extend([row] * count)
    return out, why


def longest_prefix(
    values: list[bytes | None],
    table: NodeTable,
    prefer: str | None = None,
    newer: Callable[[], NodeTable] | None = None,
    decode: Decode = decode_holders,
) -> tuple[list[tuple[Holder, ...]], str | None]:
    """`live_prefix` of one value per chunk (as an HMGET answers), grouped into runs as it goes (C-level grouping:
    Python work per run, not per chunk, and none past where the prefix stops)."""
    return live_prefix(((v, len(list(run))) for v, run in itertools.groupby(values)), table, prefer, newer, decode)
