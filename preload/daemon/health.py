"""``/health`` and ``/metrics`` over HTTP, off by default, 127.0.0.1 by default.

Each request asks every rank's socket for ``stats`` (the same path an
engine uses), so 200 means every rank answers on its socket now, not that a
process merely exists. Metrics are Prometheus text format, written by hand
(a few lines; no dependency).
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from preload.client import DaemonClient
from preload.errors import PreloadGateError


def rank_stats(socket_path: str | Path) -> dict[str, Any] | None:
    p = Path(socket_path)
    rank = int(p.stem.removeprefix("rank"))
    try:
        c = DaemonClient.connect(p.parent, rank, timeout_s=2.0, deadline_s=5.0, client="preload-gate-health")
    except PreloadGateError:
        return None
    try:
        return c.stats()
    except PreloadGateError:
        return None
    finally:
        c.close()


def _label(v: Any) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def render_metrics(stats: list[dict[str, Any] | None], sockets: list[str]) -> str:
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, rows: list[tuple[dict[str, Any], float]]) -> None:
        lines.append(f"# HELP preload_gate_{name} {help_}")
        lines.append(f"# TYPE preload_gate_{name} {kind}")
        for labels, value in rows:
            lab = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            lines.append(f"preload_gate_{name}{{{lab}}} {value}")

    Rows = list[tuple[dict[str, Any], float]]
    up: Rows = []
    hits: Rows = []
    misses: Rows = []
    attached: Rows = []
    resident: Rows = []
    load: Rows = []
    for sock, s in zip(sockets, stats, strict=True):
        if s is None:
            up.append(({"socket": sock}, 0))
            continue
        base = {"rank": s["rank"], "digest": s["digest"]}
        up.append(({"socket": sock, **base}, 1))
        hits.append((base, s["hits"]))
        for reason, n in sorted(s["misses"].items()):
            misses.append(({**base, "reason": reason}, n))
        attached.append((base, s["attached"]))
        resident.append((base, s["resident_bytes"]))
        load.append((base, s["load_seconds"]))
    metric("rank_up", "gauge", "1 when the rank answers on its socket", up)
    metric("hits_total", "counter", "get_state answers that matched the key", hits)
    metric("misses_total", "counter", "get_state answers that did not, by reason", misses)
    metric("attached_engines", "gauge", "engines holding a watch connection", attached)
    metric("resident_bytes", "gauge", "bytes held in the rank's arena", resident)
    metric("load_seconds", "gauge", "seconds the rank took to read, hash and place its weights", load)
    return "\n".join(lines) + "\n"


class HealthServer:
    def __init__(self, host: str, port: int, sockets: list[str]) -> None:
        sockets = list(sockets)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                stats = [rank_stats(s) for s in sockets]
                if self.path == "/health":
                    ok = all(s is not None for s in stats)
                    body = (b"ok\n" if ok else b"unavailable\n")
                    self._send(200 if ok else 503, body, "text/plain")
                elif self.path == "/metrics":
                    self._send(200, render_metrics(stats, sockets).encode(), "text/plain; version=0.0.4")
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
