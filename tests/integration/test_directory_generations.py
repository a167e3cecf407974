"""A generation counter (`Directory.generations`) against a real redis-server: missing until raised, started at
the caller's start where it is missing, never lowered, raised by `step` in the same atomic step."""

from kvmesh.directory import Directory
from kvmesh.directory.generations import GEN_START, fresh_start, generation_key

ROOT = b"r" * 16


def test_a_counter_is_raised_never_lowered(redis_server):
    d = Directory(redis_server.url, prefix="gens")
    try:
        g = d.generations
        d.redis.delete(g.key(ROOT))
        assert g.key(ROOT) == generation_key("gens", ROOT) == f"gens:sglang:{{{ROOT.hex()}}}:gen"
        assert g.read(ROOT) is None
        assert g.raise_to(ROOT, 0, 0, 77) == 77  # a missing counter starts where the caller says
        assert g.raise_to(ROOT, 10, 0, 5) == 77  # never lowered, the start ignored once it exists
        assert g.raise_to(ROOT, 100, 1, 5) == 101  # at least 100, then one more: one step
        assert g.read(ROOT) == 101
        assert all(1 <= fresh_start() <= GEN_START for _ in range(100))
    finally:
        d.close()
