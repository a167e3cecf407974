"""The `Fetcher` with fake sources, without Ray, Redis or a KVNode: the deadline, a run that comes up short, windows
of a fetch larger than half the slab, and the release of every begun transfer on every way out."""

import time
from types import SimpleNamespace

import pytest

from kvmesh.dataplane.fetcher import Fetcher, FetchOptions
from kvmesh.dataplane.sinks import Sink
from kvmesh.dataplane.sources import Env, Source
from kvmesh.dataplane.transfers import Landed, Transfer
from kvmesh.directory import Holder
from kvmesh.match import ChunkMatch
from kvmesh.tiers import TIER_CPU, TIER_DISK

HERE, PEER = "a" * 8, "b" * 8


def chunks(n: int, node: str, tier: int = TIER_CPU) -> list[ChunkMatch]:
    return [ChunkMatch(i.to_bytes(16, "little"), (Holder(node, 1, tier),)) for i in range(n)]


class Log:
    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.open: set[int] = set()  # runs begun and not released
        self.most_open = 0


class FakeTransfer(Transfer):
    def __init__(self, run, sink, kind, log: Log, deliver: int, error: str = "", boom: bool = False) -> None:
        super().__init__(run, sink)
        self.kind, self._log, self._deliver, self._error, self._boom = kind, log, deliver, error, boom
        self._released = False

    def complete(self, deadline: float) -> Landed:
        if self._boom:
            raise RuntimeError("a source that fails in complete")
        for j in range(self._deliver):
            self.sink.put(self.run.start + j, b"x")
        return Landed(self._deliver, self._error if self._deliver < len(self.run.keys) else "")

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._log.open.discard(self.run.start)
            self._log.events.append(("release", self.run.start))


class FakeSource(Source):
    """Delivers every chunk of a run, except where `short` (run start -> chunks delivered) or `boom` says."""

    def __init__(self, kind: str, pinned: bool, log: Log, short=None, boom=()) -> None:
        self.kind, self.pinned, self.staged = kind, pinned, not pinned
        self.log, self.short, self.boom = log, short or {}, set(boom)

    def begin(self, env, run, sink, opts, copy=False) -> Transfer:
        self.log.events.append(("begin", run.start, len(run.keys), copy))
        self.log.open.add(run.start)
        self.log.most_open = max(self.log.most_open, len(self.log.open))
        deliver = self.short.get(run.start, len(run.keys))
        return FakeTransfer(run, sink, self.kind, self.log, deliver, "not_held", run.start in self.boom)


class FakeFetcher(Fetcher):
    def __init__(self, env: Env, local: Source, peer: Source) -> None:
        super().__init__(env)
        self._local, self._peer = local, peer

    def source(self, run, opts) -> Source:
        return self._local if run.local else self._peer


class RecordingSink(Sink):
    def __init__(self) -> None:
        self.prepared: list[int] = []
        self.put_at: list[int] = []
        self.finished: int | None = None

    def prepare(self, staged) -> None:
        self.prepared = list(staged)

    def segments(self, i: int):
        raise AssertionError("the fake sources put")

    def put(self, i: int, src) -> None:
        self.put_at.append(i)

    def finish(self, n: int) -> int:
        self.finished = n
        return n


def env(slab_slots: int = 0) -> Env:
    local = SimpleNamespace()  # (a handle without orphans)
    slab = SimpleNamespace(size=slab_slots * 64) if slab_slots else None
    view = SimpleNamespace(table=lambda: SimpleNamespace(by_node=lambda: {}))
    return Env(HERE, local if slab else None, slab, 64, lambda n: None, view, None, None)


def opts(deadline_s: float = 5.0, per_batch: int = 2) -> FetchOptions:
    return FetchOptions(64, time.monotonic() + deadline_s, per_batch=per_batch)


def test_a_short_run_ends_the_fetch_there_and_every_run_is_released():
    log = Log()
    f = FakeFetcher(env(), FakeSource("slab", True, log), FakeSource("tcp", False, log, short={2: 1}))
    sink = RecordingSink()
    result, st = f.fetch(chunks(6, PEER), sink, opts())
    assert result == 3 and sink.finished == 3 and st.peer_chunks == 3 and st.error == "not_held"
    assert [r.delivered for r in st.runs] == [2, 1]  # the third run is not completed: stopped
    assert sink.prepared == list(range(6))  # peer runs land through put: announced up front
    assert {e[1] for e in log.events if e[0] == "begin"} == {0, 2, 4}  # all begun at once
    assert not log.open and [e for e in log.events if e[0] == "release"] == [("release", s) for s in (0, 2, 4)]


def test_a_fetch_begun_past_its_deadline_sends_nothing_and_delivers_nothing():
    log = Log()
    f = FakeFetcher(env(), FakeSource("slab", True, log), FakeSource("tcp", False, log))
    sink = RecordingSink()
    result, st = f.fetch(chunks(4, PEER), sink, opts(deadline_s=-1.0))
    assert result == 0 and st.chunks == 0 and st.error == "deadline"
    assert not log.events  # no source was asked
    assert [r.source for r in st.runs] == ["tcp"] and st.runs[0].seconds == 0.0


def test_a_fetch_larger_than_half_the_slab_comes_in_windows_copied_never_adopted():
    log = Log()
    f = FakeFetcher(env(slab_slots=4), FakeSource("slab", True, log), FakeSource("tcp", False, log))
    sink = RecordingSink()
    result, st = f.fetch(chunks(8, HERE, TIER_DISK), sink, opts(per_batch=8))  # budget: 2 slots of 4
    assert result == 8 and st.local_chunks == 8 and not st.error
    begins = [e for e in log.events if e[0] == "begin"]
    assert len(begins) == 8 and all(n == 1 and copy for _, _, n, copy in begins)  # windows of 1, copied
    assert log.most_open <= 2  # never more pinned at once than the budget
    assert sink.prepared == list(range(8))  # copied windows need staging
    assert not log.open


def test_chunks_already_in_the_slab_are_never_windowed_whatever_their_number():
    log = Log()
    f = FakeFetcher(env(slab_slots=4), FakeSource("slab", True, log), FakeSource("tcp", False, log))
    result, _ = f.fetch(chunks(8, HERE, TIER_CPU), RecordingSink(), opts(per_batch=8))
    assert result == 8 and [e[:4] for e in log.events if e[0] == "begin"] == [("begin", 0, 8, False)]


def test_every_begun_run_is_released_when_a_source_raises():
    log = Log()
    f = FakeFetcher(env(), FakeSource("slab", True, log), FakeSource("tcp", False, log, boom=[2]))
    with pytest.raises(RuntimeError, match="fails in complete"):
        f.fetch(chunks(6, PEER), RecordingSink(), opts())
    assert not log.open and len([e for e in log.events if e[0] == "release"]) == 3


def test_the_fetcher_picks_a_source_object_per_run():
    from kvmesh.dataplane import sources

    view = SimpleNamespace(info=lambda node, inc: SimpleNamespace(data_addr=""))  # a holder that serves Ray only
    e = Env(HERE, SimpleNamespace(), SimpleNamespace(size=64), 64, lambda n: None, view, None, None)
    f = Fetcher(e)
    (local_run,) = f.plan(chunks(2, HERE), opts())[0]
    assert f.source(local_run, opts()) is sources.SLAB
    peer_run = f.plan(chunks(2, PEER), opts())[0][0]
    assert f.source(peer_run, opts()) is sources.RAY  # (no data address)
    assert f.source(peer_run, FetchOptions(64, 0.0, coalesce=True, group=b"g")) is sources.VIA
    assert sources.VIA.brings(peer_run) == 2 and sources.SLAB.brings(peer_run) == 0
