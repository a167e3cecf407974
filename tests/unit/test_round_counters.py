"""The round counters tests wait on instead of the clock: `Janitor.rounds` counts every round that ended, whether it
purged anything or not; `NodeView.refreshes` every refresh that read a table, however it read it. Stand-ins for
the directory (the real-Redis stories are tests/integration)."""

import types

import pytest
import redis

from kvmesh.directory import NodeTable
from kvmesh.janitor import Janitor
from kvmesh.nodeview import NodeView, TableFile


class StandIn:
    """A directory with nothing to purge; `claimed`: whether this node holds the janitor claim."""

    def __init__(self, claimed: bool) -> None:
        self.claimed, self.down, self.purged = claimed, False, []

    def holder_of(self, inc):
        return None

    def purge(self, inc):
        self.purged.append(inc)
        return 1

    def claim(self, job, holder, ms):
        if self.down:
            raise redis.ConnectionError("down")
        return self.claimed

    def node_table(self):
        return NodeTable(b"e", 1000, {}, (), {}, {})


def janitor(d: StandIn) -> Janitor:
    lease = types.SimpleNamespace(incarnation=7)
    return Janitor(d, "n", 1.0, lambda: lease, lambda *a: None, lambda *a: None)  # type: ignore[arg-type]


@pytest.mark.parametrize("claimed", [False, True])
def test_janitor_rounds_count_every_round_that_ended(claimed):
    d = StandIn(claimed)
    j = janitor(d)
    assert j.rounds == 0
    j.round()  # nothing to purge
    j.round()
    assert j.rounds == 2
    j.purge_later([3])
    j.round()  # one that purged
    assert d.purged == [3] and j.rounds == 3


def test_a_janitor_round_that_raised_is_not_counted():
    d = StandIn(True)
    j = janitor(d)
    d.down = True
    with pytest.raises(redis.ConnectionError):
        j.round()
    assert j.rounds == 0
    d.down = False
    j.round()
    assert j.rounds == 1


def test_view_refreshes_count_every_refresh_that_read_a_table(tmp_path):
    table = NodeTable(b"e", 1000, {}, (), {}, {})
    state = {"down": False, "direct": 0}

    def read():
        if state["down"]:
            raise redis.ConnectionError("down")
        return table

    def direct():
        state["direct"] += 1
        return table

    v = NodeView(read, publish=TableFile(str(tmp_path / "t.nodes")), direct=direct)
    assert v.refreshes == 0
    assert v.refresh() and v.refresh(direct=True)
    assert v.refreshes == 2 and state["direct"] == 1
    state["down"] = True
    assert not v.refresh()  # read no table: not counted
    assert v.refreshes == 2 and v.errors == 1
    v.current()  # (a refresh from the directory itself)
    assert v.refreshes == 3
    assert (tmp_path / "t.nodes").exists()  # counted once relayed
