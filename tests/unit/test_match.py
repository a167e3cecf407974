"""`Match.select` and `Match.truncate`: parts of a lookup's result, and a clear error for a part it does not have
(a negative slice would have shifted `start` off the chunks it names)."""

import numpy as np
import pytest

from kvmesh.directory import Holder
from kvmesh.match import ChunkMatch, Match


def match(n: int, start: int = 0) -> Match:
    holder = (Holder("node-a", 1, 1),)
    return Match(b"n" * 16, 4, tuple(ChunkMatch(bytes([i]) * 16, holder) for i in range(n)), start=start,
                 group=b"g" * 16)


def test_select_names_the_chunks_it_keeps_by_their_place_in_the_prompt():
    m = match(5, start=2).select(1, 4)
    assert [c.hash[0] for c in m.chunks] == [1, 2, 3] and m.start == 3 and m.num_tokens == 12
    assert match(5).select(np.int64(2), np.int64(2)).num_chunks == 0  # numpy integers are integers


@pytest.mark.parametrize("first,end", [(3, 2), (0, 6), (-2, 5), (-1, -1)])
def test_select_outside_the_match_is_a_value_error(first, end):
    with pytest.raises(ValueError):
        match(5).select(first, end)


def test_truncate_keeps_at_most_n_and_refuses_what_is_not_a_count():
    assert match(5).truncate(3).num_chunks == 3 and match(5).truncate(9).num_chunks == 5
    with pytest.raises(ValueError):
        match(5).truncate(-1)
    for bad in (1.0, True, "2"):
        with pytest.raises(TypeError):
            match(5).truncate(bad)
