"""The command line as a user runs it: kvmesh up, status, down; clear one-line errors."""

import os
import subprocess
import sys


def kvmesh(*args, env=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_every_subcommand_has_help():
    for cmd in ("up", "status", "down", "demo", "bench"):
        r = kvmesh(cmd, "--help")
        assert r.returncode == 0 and "usage: kvmesh " + cmd in r.stdout


def test_up_status_down(tmp_path):
    env = dict(os.environ, KVMESH_STATE_DIR=str(tmp_path))
    r = kvmesh("up", "--nodes", "2", "--port", "0", env=env)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert "kvmesh is up: 2 node(s)" in r.stdout and "live page" in r.stdout
        s = kvmesh("status", env=env)
        assert s.returncode == 0 and s.stdout.count(" alive ") == 2 and "hit rate" in s.stdout, s.stdout
    finally:
        d = kvmesh("down", env=env)
    assert d.returncode == 0 and "stopped" in d.stdout
    after = kvmesh("status", env=env)
    assert after.returncode == 1 and "no kvmesh is up" in after.stdout


def test_status_against_a_dead_cluster_says_so_in_one_line(tmp_path):
    env = dict(os.environ, KVMESH_STATE_DIR=str(tmp_path))
    r = kvmesh("status", "--redis-url", "redis://:s3cret@127.0.0.1:1/0", env=env, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr
    assert len(r.stdout.strip().splitlines()) == 1 and "unreachable" in r.stdout
    # the same words as kvmesh.connect's DirectoryUnavailable: the URL without its password, and the cause
    assert "redis://:***@127.0.0.1:1/0 is unavailable" in r.stdout and "s3cret" not in r.stdout
    assert "Connection refused" in r.stdout, r.stdout


def test_bad_configuration_is_one_clear_error(tmp_path):
    env = dict(os.environ, KVMESH_STATE_DIR=str(tmp_path), KVMESH_CPU_BYTEZ="1")
    r = kvmesh("up", env=env, timeout=60)
    assert r.returncode == 2 and "KVMESH_CPU_BYTEZ" in r.stderr and "Traceback" not in r.stderr
    cfg = tmp_path / "kvmesh.yaml"
    cfg.write_text("cpu_bytes: lots\n")
    r = kvmesh("up", "--config", str(cfg), env=dict(os.environ, KVMESH_STATE_DIR=str(tmp_path)), timeout=60)
    assert r.returncode == 2 and "cpu_bytes" in r.stderr and "not a size" in r.stderr
    cfg.write_text("lease_s: 2\nheartbeat_s: 1.5\n")
    r = kvmesh("up", "--config", str(cfg), env=dict(os.environ, KVMESH_STATE_DIR=str(tmp_path)), timeout=60)
    assert r.returncode == 2 and "heartbeat_s" in r.stderr


def test_up_without_address_refuses_a_redis_url_it_would_not_use(tmp_path):
    """A local `kvmesh up` starts its own embedded Redis: `--redis-url` was dropped without a word, and the user's
    workers, pointed at their own Redis, never met the KVNodes' directory."""
    env = dict(os.environ, KVMESH_STATE_DIR=str(tmp_path))
    try:
        r = kvmesh("up", "--redis-url", "redis://127.0.0.1:1/0", env=env)
        assert r.returncode == 2 and "--redis-url needs --address" in r.stderr and "Traceback" not in r.stderr
        assert not (tmp_path / "up.log").exists()  # nothing was started
    finally:
        kvmesh("down", env=env)  # (before the fix: a local kvmesh with its own Redis was up)


def test_up_local_serves_the_live_page_on_host(tmp_path):
    """`--host` (the address the live page listens on) was dropped by a local `kvmesh up`: the page was always on
    127.0.0.1. (127.0.0.2: another loopback address, so the test listens nowhere else.)"""
    env = dict(os.environ, KVMESH_STATE_DIR=str(tmp_path))
    r = kvmesh("up", "--nodes", "1", "--port", "0", "--host", "127.0.0.2", env=env)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert "live page    http://127.0.0.2:" in r.stdout, r.stdout
    finally:
        kvmesh("down", env=env)
