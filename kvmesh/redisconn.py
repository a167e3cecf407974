"""Connecting to the directory's Redis: `connect` builds the redis-py client for a directory URL (`redis://`,
`rediss://`, `?cluster=1`), `probe` checks that a Redis answers there, and `DirectoryUnavailable` is what connecting
raises when one does not. `kvmesh.directory` re-exports all three.
"""

from __future__ import annotations

import os
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from kvmesh.config import redact_url

CA_ENV = "KVMESH_REDIS_CA_CERTS"  # the CA file of a TLS directory whose URL does not name one


class DirectoryUnavailable(ConnectionError):
    """The directory at `url` did not answer as a Redis should when kvmesh connected (`probe`): nothing listens,
    it does not answer in time, it refuses AUTH, or it is not Redis. `url` has its password redacted; `cause` says
    which, in words. Only connecting raises it: once connected, a directory that fails is a miss."""

    def __init__(self, url: str, cause: str) -> None:
        self.url = redact_url(url)
        self.cause = cause
        super().__init__(f"kvmesh directory {self.url} is unavailable: {cause}")

    def __reduce__(self):  # pickled as what it was built from: it crosses Ray task and actor boundaries intact
        return type(self), (self.url, self.cause)


def probe(url: str, timeout_s: float) -> None:
    """Raises `DirectoryUnavailable` unless a Redis at `url` answers PING, AUTH (and SELECT) included, on a
    connection of its own. Bounded: connecting and then each reply wait at most `timeout_s` (so 2 x `timeout_s`
    for a server that accepts the connection and then never answers; a Redis Cluster's discovery asks each
    master in turn)."""
    try:
        r = connect(url, timeout_s)
    except ValueError as e:  # a URL redis-py cannot read (a bad port, an unknown ssl_* option)
        raise DirectoryUnavailable(url, f"unreadable URL ({e})") from None
    except (redis.RedisError, RedisClusterException, OSError) as e:  # Redis Cluster connects while it is built
        raise DirectoryUnavailable(url, _cause(e, timeout_s)) from None
    try:
        pong = r.ping()
    except Exception as e:  # a server that is not Redis can fail redis-py in its own ways (an echoed HELLO reply
        # is read as a map: AttributeError); whatever it is, this directory cannot be used
        raise DirectoryUnavailable(url, _cause(e, timeout_s)) from None
    finally:
        r.close()
    if pong is not True:  # a server that echoes what it is sent reads as a PING that got "PING" back
        raise DirectoryUnavailable(url, f"not a Redis server (PING answered {pong!r})")


def _cause(e: Exception, timeout_s: float) -> str:
    """What went wrong, in words: the error's class alone says too little ("ConnectionError")."""
    text = str(e) or type(e).__name__
    if isinstance(e, redis.AuthenticationError) or text.startswith(("NOAUTH", "WRONGPASS", "invalid username")):
        return f"authentication refused ({text})"
    if isinstance(e, (redis.TimeoutError, TimeoutError)):
        return f"no answer within {timeout_s:g} s ({text})"
    if isinstance(e, redis.ConnectionError) and "Connection closed by server" in text:
        return f"the server closed the connection: not a Redis server? ({text})"
    if isinstance(e, (RedisClusterException, OSError)) or (
        isinstance(e, redis.ConnectionError) and "Bad response" not in text
    ):
        return f"unreachable ({text})"
    return f"not a Redis server, or not one kvmesh can use ({type(e).__name__}: {text})"


def same_directory(a: str, b: str) -> bool:
    """Whether two directory URLs name one database by their text: scheme and host (case aside), port (6379 when
    left out), database (0 when left out) and whether they speak Redis Cluster, whatever the spelling. Users,
    passwords and connection options (`?ssl_*`) are not compared: they change how a client reaches the database,
    not which one.
    `same_server` also asks the servers, for two spellings of one (a host name and its address)."""

    def key(url: str) -> tuple:
        p = urlsplit(url)
        query = dict(parse_qsl(p.query, keep_blank_values=True))
        cluster = query.get("cluster", "").lower() in ("1", "true", "yes")
        if p.scheme == "unix":
            return ("unix", p.path, query.get("db") or "0", cluster)
        db = query.get("db") or p.path.strip("/") or "0"
        return (p.scheme.lower(), (p.hostname or "").lower(), p.port or 6379, db, cluster)

    try:
        return key(a) == key(b)
    except ValueError:  # (a port that is not a number: only the same text is the same directory)
        return a == b


def _per_primary(client, command: str, arg: str) -> list[dict]:
    """`command arg` (a method of redis-py's client that answers a dict) on each master of a Redis Cluster client
    (redis-py folds a one-master cluster's answer into the bare dict, not {node: dict}), or on the one server of a
    plain client."""
    call = getattr(client, command)
    if not hasattr(client, "get_primaries"):
        return [call(arg)]
    from redis.cluster import RedisCluster

    got = call(arg, target_nodes=RedisCluster.PRIMARIES)
    if not isinstance(got, dict):
        return []
    if got and all(isinstance(v, dict) for v in got.values()):
        return list(got.values())
    return [got]


def primaries_info(client, section: str = "server") -> list[dict]:
    """`INFO section` of each master (of the one server of a plain client)."""
    return _per_primary(client, "info", section)


def primaries_config(client, pattern: str) -> list[dict]:
    """`CONFIG GET pattern` of each master (of the one server of a plain client)."""
    return _per_primary(client, "config_get", pattern)


def _database(url: str, timeout_s: float) -> tuple[str, str]:
    """(the server's identity: its run id, each master's in Redis Cluster; the database number)."""
    client = connect(url, timeout_s)
    try:
        ids = ",".join(sorted(str(i["run_id"]) for i in primaries_info(client)))
        db = "0" if hasattr(client, "get_primaries") else str(client.connection_pool.connection_kwargs.get("db", 0))
        return ids, db
    finally:
        client.close()


def same_server(a: str, b: str, timeout_s: float = 2.0) -> bool | None:
    """Whether two directory URLs name one database: by their text, else by asking both servers (their run ids and
    the database numbers), each within `timeout_s`. None where a server does not answer or will not say (an ACL
    user without INFO): it cannot be told."""
    if same_directory(a, b):
        return True
    try:
        return _database(a, timeout_s) == _database(b, timeout_s)
    except (redis.RedisError, RedisClusterException, OSError, KeyError, TypeError, ValueError):
        return None


def connect(url: str, timeout_s: float = 2.0):
    """A redis-py client for `url`: `redis://` or `rediss://` (TLS; `?ssl_ca_certs=/path/ca.pem` and the other
    `ssl_*` query options of redis-py; a `rediss://` URL without `ssl_ca_certs` takes `$KVMESH_REDIS_CA_CERTS`),
    with `user:password@` for AUTH/ACL users. `?cluster=1` speaks Redis Cluster
    (any master's address; the others are discovered). No retries: callers have deadlines, and a directory that
    does not answer is a miss, not a wait."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    ca = os.environ.get(CA_ENV)
    if ca and parts.scheme == "rediss" and not any(k == "ssl_ca_certs" for k, _ in query):
        query.append(("ssl_ca_certs", ca))  # (a URL kept whole in a Secret cannot know where the CA is mounted)
    cluster = any(k == "cluster" and v.lower() in ("1", "true", "yes") for k, v in query)
    rest = urlencode([(k, v) for k, v in query if k != "cluster"])
    # (not urlunsplit: it writes unix:///path back as unix:/path, which redis-py refuses)
    plain = f"{parts.scheme}://{parts.netloc}{parts.path}" + (f"?{rest}" if rest else "")
    kw = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
    if cluster:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(plain, cluster_error_retry_attempts=1, **kw)
    return redis.Redis.from_url(plain, health_check_interval=30, **kw)
