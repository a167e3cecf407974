"""The main job, end to end, as a user runs it (small settings to keep CI short), and its live page in a real
headless Chromium while it runs."""

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import urllib.request

import pytest

from tests.conftest import wait_until

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
         "--no-first-run", "--disable-component-update", "--disable-sync"]


def _proc(pid: str) -> tuple[int, str, str, bytes] | None:
    """(parent pid, start time, command line, environment) of a live process; None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return None
    return (int(fields[1]), fields[19], cmd, env) if cmd and fields[0] != "Z" else None


def demo_processes(root: int, tag: str) -> dict[tuple[int, str], str]:
    """(pid, start time) -> command line of the demo (`root`) and every process it started: those whose
    environment holds KVMESH_TEST_RUN=`tag` (Ray's processes inherit it) and the descendants of `root` (redis-server
    writes its title over its environment). Nothing else on the machine: another Ray or Redis beside the test does
    not count."""
    procs = {int(p): info for p in os.listdir("/proc") if p.isdigit() and (info := _proc(p)) is not None}
    want = f"KVMESH_TEST_RUN={tag}".encode()
    mine = {pid for pid, (_, _, _, env) in procs.items() if want in env.split(b"\0")} | {root}
    grew = True
    while grew:
        more = {pid for pid, (ppid, _, _, _) in procs.items() if ppid in mine} - mine
        mine |= more
        grew = bool(more)
    return {(pid, procs[pid][1]): procs[pid][2] for pid in mine if pid in procs}


def still_running(seen: dict[tuple[int, str], str]) -> dict[tuple[int, str], str]:
    """Those of `seen` that still run (the same pid with the same start time: not a new process reusing it)."""
    out = {}
    for (pid, start), cmd in seen.items():
        info = _proc(str(pid))
        if info is not None and info[1] == start:
            out[(pid, start)] = cmd
    return out


def chromium() -> str:
    browser = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    if browser is None:  # `make test` installs Debian's chromium; a page test that skips proves nothing
        pytest.fail("no Chromium on this machine: install Debian's chromium package (make test does, as root)")
    return browser


def text_of(dom: str, element_id: str) -> str:
    m = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', dom)
    assert m, f"no #{element_id} in the page"
    return m.group(1)


def fmt_n(n: int) -> str:
    return f"{n:,}"


def pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def nodes_of(state: dict) -> list:
    """What the page's node rows show of each node: its id, incarnation and CPU tier's chunks."""
    return sorted((n["node_id"], n["incarnation"], [(t["tier"], t["chunks"]) for t in n.get("tiers", [])])
                  for n in state["nodes"])


def check_page(browser: str, url: str, tmp_path, summary_rows: dict) -> None:
    def state():
        return json.load(urllib.request.urlopen(url + "api/state", timeout=10))
    # the workers' counters reach the directory on their telemetry interval
    env = dict(os.environ, HOME=str(tmp_path))
    for _ in range(5):
        api = wait_until(lambda: (s := state()).get("reused_tokens") == summary_rows["reused"] and s, 30)
        polls_before = api["api_requests"]
        dom = subprocess.run([browser, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000",
                              "--dump-dom", url], capture_output=True, text=True, timeout=120, env=env).stdout
        assert "kvmesh" in dom and "connecting" not in dom, dom[:2000]
        after = state()
        # the page was rendered between `api` and `after`: its node rows can be checked against them only where the
        # nodes did not change in between (the demo's workers are done, but the nodes go on replicating hot
        # prefixes to each other for a while, and a node whose lease lapsed on a loaded machine joins again)
        if nodes_of(api) == nodes_of(after):
            break
    else:
        raise AssertionError(f"the nodes never held still for a page read: {nodes_of(api)} {nodes_of(after)}")
    # the page refreshes itself: it polled the state several times while it was open (once a second)
    assert after["api_requests"] - polls_before - 1 >= 3, (polls_before, after["api_requests"])  # (-1: ours)
    # the numbers are the running cluster's: the demo's own count of reused and recomputed tokens, and the directory's
    assert text_of(dom, "reused") == fmt_n(summary_rows["reused"]) == fmt_n(api["reused_tokens"])
    assert text_of(dom, "recomputed") == fmt_n(api["recomputed_tokens"])
    assert text_of(dom, "lookups") == fmt_n(api["lookups"]) and api["lookups"] >= summary_rows["requests"]
    assert text_of(dom, "hitrate") == pct(api["hit_rate"]) and api["hit_rate"] > 0
    assert text_of(dom, "share") == pct(api["reuse_fraction"])
    alive = [n for n in api["nodes"] if n["alive"]]
    assert len(alive) == 3
    for n in alive:  # every node with its incarnation and its CPU tier's occupancy
        row = re.search(rf"<tr><td><code>{n['node_id'][:10]}</code>.*?</tr>", dom)
        assert row and "alive" in row.group(0) and str(n["incarnation"]) in row.group(0), n["node_id"]
        cpu = next(t for t in n["tiers"] if t["tier"] == "cpu")
        assert f"({cpu['chunks']} of {cpu['slots']} slots)" in row.group(0) and "cpu" in row.group(0)  # chunks held
    assert sum(next(t for t in n["tiers"] if t["tier"] == "cpu")["used_bytes"] for n in alive) > 0
    assert api["traffic"] and all(t["bytes"] > 0 for t in api["traffic"])  # peers served each other
    traffic = dom[dom.index('id="traffic"'):dom.index('id="prefixes"')]
    assert all(t["from"][:10] in traffic and (t["to"][:10] in traffic or t["to"] == t["from"] and "same node" in traffic)
               for t in api["traffic"])
    prefixes = dom[dom.index('id="prefixes"'):dom.index('id="misses"')]
    assert api["top_prefixes"] and api["top_prefixes"][0]["group"][:16] in prefixes  # the most reused prefix
    misses = dom[dom.index('id="misses"'):]
    assert "not cached" in misses  # each document's first request missed, with its reason
    shot = tmp_path / "page.png"
    r = subprocess.run([browser, *FLAGS, f"--user-data-dir={tmp_path / 'profile2'}", "--virtual-time-budget=5000",
                        "--window-size=1400,1100", f"--screenshot={shot}", url], capture_output=True, timeout=120,
                       env=env)
    assert r.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kvmesh_demo_runs_shows_its_live_page_and_cleans_up(tmp_path):
    browser = chromium()
    out = tmp_path / "demo.json"
    tag = f"demo-{os.getpid()}-{tmp_path.name}"
    cmd = [sys.executable, "-m", "kvmesh.cli", "demo", "--nodes", "3", "--docs", "2", "--questions", "3",
           "--doc-tokens", "512", "--chunk-tokens", "64", "--hidden-size", "128", "--layers", "2",
           "--new-tokens", "4", "--cpu-mib", "64", "--threads", "1", "--json", str(out), "--linger", "300"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "KVMESH_TEST_RUN": tag})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)], daemon=True).start()
    printed = []
    seen: dict = {}
    try:
        while True:
            line = lines.get(timeout=600)
            assert line is not None, "".join(printed)
            printed.append(line)
            if "the live page stays up" in line:
                break
        stdout = "".join(printed)
        url = re.search(r"live page: (http://\S+)", stdout).group(1)
        assert line.rstrip().endswith(url)  # the same URL, printed again for the user
        reused = int(re.search(r"\| prefix tokens reused\s+\| (\d+)", stdout).group(1))
        seen = demo_processes(proc.pid, tag)
        running = " | ".join(seen.values())
        assert "raylet" in running and "redis-server" in running, running  # the leak check below can see them
        check_page(browser, url, tmp_path, {"reused": reused, "requests": 6})
        proc.stdin.write("\n")  # Enter ends the linger
        proc.stdin.flush()
        assert proc.wait(timeout=120) == 0, stdout
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    try:  # the demo and everything it started have exited (allowing a moment for the last exits)
        wait_until(lambda: not still_running(seen) and not demo_processes(proc.pid, tag), 10)
    except AssertionError:
        left = {**still_running(seen), **demo_processes(proc.pid, tag)}
        raise AssertionError(f"the demo left processes running: {left}") from None
    for row in ("requests", "prefix tokens reused", "from a peer node", "tokens recomputed",
                "wall time without kvmesh", "wall time with kvmesh", "output check"):
        assert row in stdout
    s = json.loads(out.read_text())
    assert s["requests"] == 6 and s["outputs_identical"] is True
    assert s["reused_peer_tokens"] > 0 and s["reused_tokens"] == s["reused_local_tokens"] + s["reused_peer_tokens"]
    # 2 documents x 3 questions: every request after a document's first reuses its 512 tokens
    assert s["reused_tokens"] == 4 * 512 == reused
    help_ = subprocess.run([sys.executable, "-m", "kvmesh.cli", "demo", "--help"], capture_output=True, text=True)
    assert help_.returncode == 0 and "--nodes" in help_.stdout
