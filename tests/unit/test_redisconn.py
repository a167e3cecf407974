"""`same_directory`: whether two directory URLs name one database, however they are spelled (kvmesh.start refuses
to join a mesh that runs with another directory, and the keeper calls it every round with its own spelling)."""

import pytest

from kvmesh.redisconn import same_directory


@pytest.mark.parametrize("other", ["redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/", "redis://127.0.0.1",
                                   "redis://:secret@127.0.0.1:6379", "redis://127.0.0.1:6379?db=0",
                                   "REDIS://127.0.0.1:6379/0", "redis://alice@127.0.0.1:6379",
                                   "redis://default:pw@127.0.0.1:6379/0?ssl_cert_reqs=none",
                                   "redis://127.0.0.1:6379?cluster=0"])
def test_spellings_of_one_database_are_the_same_directory(other):
    assert same_directory("redis://127.0.0.1:6379", other)


@pytest.mark.parametrize("other", ["redis://127.0.0.1:6380", "redis://127.0.0.1:6379/1", "redis://10.0.0.5:6379",
                                   "rediss://127.0.0.1:6379", "redis://127.0.0.1:6379?cluster=1",
                                   "redis://127.0.0.1:6379?db=2", "unix:///tmp/redis.sock"])
def test_another_server_database_user_or_protocol_is_another_directory(other):
    assert not same_directory("redis://127.0.0.1:6379", other)


def test_unix_socket_spellings():
    assert same_directory("unix:///tmp/r.sock", "unix:///tmp/r.sock?db=0")
    assert not same_directory("unix:///tmp/r.sock", "unix:///tmp/r.sock?db=1")
    assert not same_directory("unix:///tmp/r.sock", "unix:///tmp/other.sock")
