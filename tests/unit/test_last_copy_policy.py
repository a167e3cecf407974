"""`policy.save_last_copy` as tiny stories: 1 MiB chunks, a model that makes 1 MiB of KV in 0.1 s, a 1 GiB/s link."""

from kvmesh.policy import HANDOFF_LATENCY_S, Leaving, save_last_copy

MiB = 1 << 20
WINDOW = 60.0
RECOMPUTE = 10 * MiB  # bytes of KV a second of prefill makes
MOVE = 1 << 30


def save(nbytes=MiB, reads=1, idle_s=0.0, replica=False, recompute=RECOMPUTE) -> bool:
    return save_last_copy(Leaving(nbytes, reads, idle_s, replica), WINDOW, recompute, MOVE)


def test_a_chunk_other_nodes_read_lately_is_saved():
    assert save()  # 0.1 s of prefill against ~3 ms of move


def test_a_chunk_nobody_else_read_is_dropped():
    assert not save(reads=0)


def test_a_replica_pulled_from_elsewhere_is_judged_like_any_chunk():
    """The holder it came from may have evicted its copy since (skipping its own handoff because this replica
    existed): whether it is the last copy is the directory's to say, in the handoff thread."""
    assert save(replica=True) == save(replica=False)


def test_reads_fade_as_the_chunk_stays_idle_and_end_with_the_window():
    assert save(idle_s=30.0)
    assert not save(idle_s=WINDOW)
    # one read nearly a window ago is not worth a move that ten such reads are
    assert not save(idle_s=59.99) and save(reads=10, idle_s=59.0)


def test_recompute_cost_against_bytes_moved():
    fast = 100 << 30  # a model that remakes KV faster than the link moves it: never worth a move
    assert not save(recompute=fast)
    # small chunks pay the handoff's fixed cost: worth it only when their recompute exceeds it
    tiny = 1024
    assert not save(nbytes=tiny)
    assert save(nbytes=tiny, recompute=tiny / (2 * HANDOFF_LATENCY_S))


def test_off_when_the_window_is_zero():
    assert not save_last_copy(Leaving(MiB, 5, 0.0, False), 0.0, RECOMPUTE, MOVE)
