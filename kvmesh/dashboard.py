"""kvmesh's live page: one HTTP server that reads the directory and the telemetry records from Redis (no Ray
needed), keeps a few minutes of history in memory, and serves

    /             the page (HTML + inline JavaScript; nothing is loaded from anywhere else)
    /api/state    the current state as JSON: nodes (liveness, incarnation, lease, tiers), totals and hit rate,
                  history, traffic between nodes, the most reused prefixes, recent failures with reasons

`Dashboard(redis_url).start()` runs it on a thread (kvmesh demo, kvmesh up); `dashboard.url` is where it is.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import redis

from kvmesh.config import redact_url
from kvmesh.directory import Directory
from kvmesh.telemetry import Records

HISTORY = 600  # samples kept (one a second)
PAGE = (Path(__file__).parent / "dashboard.html").read_text()


class Dashboard:
    def __init__(
        self,
        redis_url: str,
        key_prefix: str = "kvmesh",
        host: str = "127.0.0.1",
        port: int = 0,
        chunk_tokens: int = 256,
    ) -> None:
        self.redis_url = redact_url(redis_url)  # what the page and messages show: never the password
        self.directory = Directory(redis_url, key_prefix, timeout_s=2.0)
        self.records = Records(self.directory.redis, key_prefix)
        self.chunk_tokens = chunk_tokens
        self.history: deque = deque(maxlen=HISTORY)
        self._state: dict = {"error": "starting"}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = False
        self.api_requests = 0  # how often pages polled the state (each open page does once a second)
        dash = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path.startswith("/api/state"):
                    with dash._lock:
                        dash.api_requests += 1
                        n = dash.api_requests
                    body, kind = json.dumps({**dash.state(), "api_requests": n}).encode(), "application/json"
                elif self.path in ("/", "/index.html"):
                    body, kind = PAGE.encode(), "text/html; charset=utf-8"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Cache-Control", "no-store")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # quiet
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self._server.server_address[1]}/"
        self._threads = [
            threading.Thread(target=self._server.serve_forever, name="kvmesh-dashboard-http", daemon=True),
            threading.Thread(target=self._sample_loop, name="kvmesh-dashboard-sample", daemon=True),
        ]

    def start(self) -> Dashboard:
        self._sample()
        for t in self._threads:
            t.start()
        self._started = True
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._started:
            self._server.shutdown()
        self._server.server_close()
        self.directory.close()

    def state(self) -> dict:
        with self._lock:
            return dict(self._state, history=list(self.history))

    def _sample_loop(self) -> None:
        while not self._stop.wait(1.0):
            self._sample()

    def _sample(self) -> None:
        try:
            table = self.directory.node_table()
            stats, totals, events = self.records.read()
        except redis.RedisError as e:
            with self._lock:
                self._state = {"error": f"directory unreachable at {self.redis_url}: {e}", "time": time.time()}
            return
        now = time.time()
        nodes = []
        for inc, info in table.live.items():
            s = stats.get(info.node_id, {})
            nodes.append(
                {
                    "node_id": info.node_id,
                    "incarnation": inc,
                    "alive": True,
                    "lease_left_s": round((table.deadlines[inc] - table.now_ms) / 1000.0, 1),
                    "data_addr": info.data_addr,
                    "tiers": s.get("tiers", []),
                    "stored_chunks": s.get("stored_chunks", 0),
                    "evictions": s.get("evictions", 0),
                    "demotions": s.get("demotions", 0),
                    "promotions": s.get("promotions", 0),
                    "corrupt_dropped": s.get("corrupt_dropped", 0),
                    "replicated_chunks": s.get("replicated_chunks", 0),
                    "replicated_bytes": s.get("replicated_bytes", 0),
                    "saved_last_copies": s.get("saved_last_copies", 0),
                }
            )
        for node_id in table.dead:
            s = stats.get(node_id, {})
            nodes.append(
                {
                    "node_id": node_id,
                    "incarnation": s.get("incarnation"),
                    "alive": False,
                    "lease_left_s": 0,
                    "tiers": s.get("tiers", []),
                }
            )
        nodes.sort(key=lambda n: (not n["alive"], n["node_id"]))
        traffic: list[dict] = []
        top: dict[str, dict] = {}
        for holder, s in stats.items():
            for peer, nbytes in s.get("served_bytes", {}).items():
                traffic.append({"from": holder, "to": peer, "bytes": nbytes})
            for group, hits in s.get("top_prefixes", []):
                t = top.setdefault(group, {"group": group, "chunk_hits": 0, "nodes": []})
                t["chunk_hits"] += hits
                t["nodes"].append(holder)
        lookups = totals.get("lookups", 0)
        hits = totals.get("hits", 0)
        reused = totals.get("reused_tokens_local", 0) + totals.get("reused_tokens_peer", 0)
        recomputed = totals.get("recomputed_tokens", 0)
        self.history.append(
            {
                "t": now,
                "lookups": lookups,
                "hits": hits,
                "reused": reused,
                "reused_local": totals.get("reused_tokens_local", 0),
                "reused_peer": totals.get("reused_tokens_peer", 0),
                "recomputed": recomputed,
            }
        )
        misses = {k[5:]: v for k, v in totals.items() if k.startswith("miss_")}
        with self._lock:
            self._state = {
                "time": now,
                "redis": self.redis_url,
                "epoch": (table.epoch or b"").decode(errors="replace"),
                "nodes": nodes,
                "totals": totals,
                "lookups": lookups,
                "hits": hits,
                "hit_rate": hits / lookups if lookups else None,
                "misses": misses,
                "reused_tokens": reused,
                "recomputed_tokens": recomputed,
                "reuse_fraction": reused / (reused + recomputed) if reused + recomputed else None,
                "traffic": sorted(traffic, key=lambda x: -x["bytes"]),
                "top_prefixes": sorted(top.values(), key=lambda x: -x["chunk_hits"])[:10],
                "events": [
                    {"time": e[0], "node": e[1], "kind": e[2], "reason": e[3], "detail": e[4]} for e in events[:50]
                ],
            }
