"""``/health`` and ``/metrics`` over HTTP, off by default, 127.0.0.1 by default.

Each request asks every rank's socket for ``stats`` (the same path an
engine uses), so 200 means every rank answers on its socket now, not that a
process merely exists. prometheus_client owns the exposition format: a
:class:`RankCollector` in a registry private to the server (never the
process-wide default one) turns the ranks' answers into metric families at
scrape time, and ``generate_latest`` writes them.

The names and labels are what operators' dashboards read; they stay as they
are even where Prometheus' naming advice would differ (``rank_up`` samples of
a rank that does not answer carry only ``socket``: there is no rank or digest
to report).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from pgbase.errors import PreloadGateError
from preload.client import DaemonClient

PREFIX = "preload_gate_"


def rank_stats(socket_path: str | Path) -> dict[str, Any] | None:
    """A rank's ``stats`` answer, or None when its socket does not answer."""
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


def metric_families(stats: Sequence[dict[str, Any] | None], sockets: Sequence[str]) -> list[Metric]:
    """The daemon's metric families from each rank's ``stats`` (None: the
    rank did not answer), in the order of ``sockets``.

    ``rank_up`` (gauge, 1/0) per socket; per answering rank, labelled
    ``rank`` and ``digest``: ``hits_total``, ``misses_total`` (by ``reason``)
    and ``attach_failures_total`` (by ``kind``) (counters),
    ``attached_engines``, ``resident_bytes`` and ``load_seconds`` (gauges).
    """
    base_labels = ["rank", "digest"]
    up = GaugeMetricFamily(PREFIX + "rank_up", "1 when the rank answers on its socket")
    hits = CounterMetricFamily(PREFIX + "hits", "attaches the engine reported done after a get_state that matched",
                               labels=base_labels)
    misses = CounterMetricFamily(PREFIX + "misses", "get_state answers that did not match, by reason",
                                 labels=[*base_labels, "reason"])
    failures = CounterMetricFamily(PREFIX + "attach_failures", "get_state answers that matched whose attach then "
                                   "failed, by kind (closed: no report came)", labels=[*base_labels, "kind"])
    attached = GaugeMetricFamily(PREFIX + "attached_engines", "engines holding a watch connection", labels=base_labels)
    resident = GaugeMetricFamily(PREFIX + "resident_bytes", "bytes held in the rank's arena", labels=base_labels)
    load = GaugeMetricFamily(PREFIX + "load_seconds", "seconds the rank took to read, hash and place its weights",
                             labels=base_labels)
    for sock, s in zip(sockets, stats, strict=True):
        if s is None:
            up.add_sample(up.name, {"socket": sock}, 0)
            continue
        rank, digest = str(s["rank"]), str(s["digest"])
        base = [rank, digest]
        up.add_sample(up.name, {"socket": sock, "rank": rank, "digest": digest}, 1)
        hits.add_metric(base, s["hits"])
        for reason, n in sorted(s["misses"].items()):
            misses.add_metric([*base, str(reason)], n)
        for kind, n in sorted(s["attach_failures"].items()):
            failures.add_metric([*base, str(kind)], n)
        attached.add_metric(base, s["attached"])
        resident.add_metric(base, s["resident_bytes"])
        load.add_metric(base, s["load_seconds"])
    return [up, hits, misses, failures, attached, resident, load]


class RankCollector(Collector):
    """Asks every rank for ``stats`` when scraped (prometheus_client's custom
    collector shape), so a scrape reports the ranks as they are now."""

    def __init__(self, sockets: Sequence[str]) -> None:
        self.sockets = list(sockets)

    def collect(self) -> Iterator[Metric]:
        yield from metric_families([rank_stats(s) for s in self.sockets], self.sockets)


def metrics_registry(sockets: Sequence[str]) -> CollectorRegistry:
    """A registry of its own holding only the ranks' collector: the default
    registry would add this process' own metrics and outlive the server."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankCollector(sockets))
    return registry


class HealthServer:
    """``GET /health`` (200 ``ok`` when every rank answers, else 503) and
    ``GET /metrics`` on ``host:port`` (port 0: any free port, see ``port``)."""

    def __init__(self, host: str, port: int, sockets: list[str]) -> None:
        sockets = list(sockets)
        registry = metrics_registry(sockets)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path == "/health":
                    ok = all(rank_stats(s) is not None for s in sockets)
                    body = (b"ok\n" if ok else b"unavailable\n")
                    self._send(200 if ok else 503, body, "text/plain")
                elif self.path == "/metrics":
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
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
