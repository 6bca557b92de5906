"""The health server answers what probes, scrapers and load balancers send.

A battery of requests the way each client sends them, through real HTTP
clients (``http.client``, raw sockets for what clients do not build, and
``requests`` where installed), against a health server asking a live
raw-stage daemon's socket, while another thread keeps attaching to that
socket (get_state, attach, report) to show the daemon serves throughout:

- Kubernetes probes: ``GET /health`` over HTTP/1.1 with ``Host``,
  ``User-Agent: kube-probe``, ``Connection: close``;
- Prometheus: ``GET /metrics`` with the ``Accept`` headers Prometheus 2 and 3
  send (OpenMetrics first), gzip, ``?name[]=`` filters; the content type and
  the filter are prometheus_client's own answer (``choose_encoder``), held
  against it;
- load balancers: ``HEAD`` (the GET's headers, no body) on keep-alive
  connections;
- everything else a web server meets: query strings, the absolute form,
  HTTP/1.0, OPTIONS, 405 with ``Allow`` for other methods, 404 for other
  paths, 400/414/505 for malformed requests, clients that trickle their
  request (cut at the head deadline, never holding others up), and 1,000
  requests from four keep-alive clients at once.

Run by hand against a daemon's own server (``preload-gate preload CKPT
--stage raw --health-port P``)::

    python tests/unit/test_health_http.py 127.0.0.1:P /path/to/<digest16>/rank0.sock
"""

from __future__ import annotations

import gzip
import http.client
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# Prometheus' scrape Accept headers (scrape/scrape.go: 3.x default, then 2.x).
PROMETHEUS_3_ACCEPT = ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
                       "application/openmetrics-text;version=0.0.1;q=0.4,"
                       "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1")
PROMETHEUS_2_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                       "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
ALLOW = "GET, HEAD, OPTIONS"


@dataclass
class Target:
    host: str
    port: int
    deadline_s: float  # the server's head deadline (HEAD_DEADLINE_S)

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=30)

    def raw(self, data: bytes, timeout: float = 30) -> bytes:
        """Send ``data`` as is and read until the server closes."""
        with socket.create_connection((self.host, self.port), timeout=timeout) as s:
            s.sendall(data)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            return out


def _get(t: Target, path: str, method: str = "GET", headers: dict[str, str] | None = None,
         body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    c = t.conn()
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


def _families(text: str, openmetrics: bool = False) -> dict[str, object]:
    if openmetrics:
        from prometheus_client.openmetrics.parser import text_string_to_metric_families
    else:
        from prometheus_client.parser import text_string_to_metric_families
    return {f.name: f for f in text_string_to_metric_families(text)}


# ------------------------------------------------------------------ the battery

def kubernetes_probe(t: Target) -> None:
    req = (f"GET /health HTTP/1.1\r\nHost: {t.host}:{t.port}\r\nUser-Agent: kube-probe/1.30\r\n"
           "Accept: */*\r\nConnection: close\r\n\r\n").encode()
    out = t.raw(req)  # returns only once the server closed, as asked
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), out
    assert b"\r\nConnection: close" in head and body == b"ok\n", out


def query_strings(t: Target) -> None:
    for path in ("/health?verbose=1", "/health?", "/health?x=%20y&probe=liveness", "/metrics?debug=1"):
        code, _, _ = _get(t, path)
        assert code == 200, path
    code, _, body = _get(t, "/metrics?name[]=preload_gate_hits_total&name[]=preload_gate_rank_up")
    assert code == 200 and set(_families(body.decode())) == {"preload_gate_hits", "preload_gate_rank_up"}, body


def prometheus_scrapes(t: Target) -> None:
    from prometheus_client.exposition import choose_encoder

    for accept in (PROMETHEUS_3_ACCEPT, PROMETHEUS_2_ACCEPT, "text/plain;version=0.0.4", ""):
        code, h, body = _get(t, "/metrics", headers={"Accept": accept} if accept else {})
        assert code == 200 and h["content-type"] == choose_encoder(accept)[1], (accept, h)
        text = body.decode()
        om = h["content-type"].startswith("application/openmetrics-text")
        assert text.endswith("# EOF\n") == om, accept
        assert "preload_gate_rank_up" in _families(text, om), accept
    code, h, body = _get(t, "/metrics", headers={"Accept": PROMETHEUS_3_ACCEPT, "Accept-Encoding": "gzip"})
    assert code == 200 and h.get("content-encoding") == "gzip"
    assert gzip.decompress(body).decode().endswith("# EOF\n")


def head_like_a_load_balancer(t: Target) -> None:
    c = t.conn()
    try:
        for path in ("/health", "/metrics", "/health?lb=1"):
            c.request("GET", path)
            r = c.getresponse()
            get_headers, get_body = dict(r.getheaders()), r.read()
            c.request("HEAD", path)
            r = c.getresponse()
            head_headers, head_body = dict(r.getheaders()), r.read()
            assert r.status == 200 and head_body == b"", path
            assert head_headers["Content-Type"] == get_headers["Content-Type"], path
            if path.startswith("/health"):
                assert head_headers["Content-Length"] == get_headers["Content-Length"] == str(len(get_body))
        # The HEAD left no body bytes behind: the next answer on the connection parses.
        c.request("GET", "/health")
        r = c.getresponse()
        assert r.status == 200 and r.read() == b"ok\n"
    finally:
        c.close()


def keep_alive(t: Target) -> None:
    c = t.conn()
    try:
        c.request("GET", "/health")
        r = c.getresponse()
        r.read()
        sock = c.sock
        assert sock is not None and r.getheader("Connection") != "close"
        for method, path in (("HEAD", "/health"), ("GET", "/metrics"), ("HEAD", "/metrics"), ("GET", "/health")):
            c.request(method, path)
            r = c.getresponse()
            r.read()
            assert r.status == 200 and c.sock is sock, (method, path)  # one connection throughout
    finally:
        c.close()


def other_methods(t: Target) -> None:
    for method in ("POST", "PUT", "DELETE", "PATCH", "TRACE", "PROPFIND", "BREW"):
        for path in ("/health", "/metrics?x=1"):
            code, h, body = _get(t, path, method)
            assert code == 405 and h["allow"] == ALLOW, (method, path, code, h)
            assert method.encode() in body
    # A body we never read: answered, and the connection closed (it would read as the next request).
    code, h, _ = _get(t, "/health", "POST", {"Content-Type": "application/json"}, b'{"probe": true}')
    assert code == 405 and h["connection"] == "close"
    for path in ("/health", "*"):
        code, h, body = _get(t, path, "OPTIONS")
        assert code == 204 and h["allow"] == ALLOW and body == b"", path


def unknown_paths(t: Target) -> None:
    for path in ("/", "/healthz", "/health/", "/metrics.txt", "/favicon.ico", "/../health"):
        code, _, body = _get(t, path)
        assert code == 404 and b"/health and /metrics" in body, path
    code, _, body = _get(t, "/nope", "HEAD")
    assert code == 404 and body == b""
    code, h, _ = _get(t, "/nope", "DELETE")
    assert code == 404, "an unknown path is 404 whatever the method"


def request_forms(t: Target) -> None:
    out = t.raw(f"GET http://{t.host}:{t.port}/health HTTP/1.1\r\nHost: {t.host}\r\nConnection: close\r\n\r\n".encode())
    assert out.startswith(b"HTTP/1.1 200 ") and out.endswith(b"ok\n"), out
    out = t.raw(b"GET /health HTTP/1.0\r\n\r\n")  # no keep-alive asked: closed after the answer
    assert b" 200 " in out.split(b"\r\n")[0] and out.endswith(b"ok\n"), out
    # Malformed lines get a status line and headers (http.server alone answers them
    # HTTP/0.9-style, a bare HTML page no client or probe can read as a status).
    assert t.raw(b"GARBAGE\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert t.raw(b"GET /health HTTP/2.0\r\n\r\n").startswith(b"HTTP/1.1 505 ")
    # "//x/health" is an origin-form path, not a host: not ours.
    assert t.raw(b"GET //x/health HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n").startswith(b"HTTP/1.1 404 ")
    many = b"".join(b"X-%d: y\r\n" % i for i in range(150))
    assert t.raw(b"GET /health HTTP/1.1\r\n" + many + b"\r\n").startswith(b"HTTP/1.1 431 ")
    assert t.raw(b"GET /health HTTP/3.0\r\n\r\n").startswith(b"HTTP/1.1 505 ")
    assert t.raw(b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 414 ")


def slow_clients(t: Target) -> None:
    """Four clients trickle a request a byte at a time; other requests are
    answered meanwhile, and each trickler is cut at the head deadline."""
    closed: list[float] = []
    start = time.monotonic()

    def trickle() -> None:
        s = socket.create_connection((t.host, t.port), timeout=t.deadline_s + 30)
        try:
            for b in b"GET /health HTTP/1.1\r\nHost: slow\r\nX-Pad: " + b"x" * 10_000:
                s.send(bytes([b]))
                time.sleep(0.1)
        except OSError:
            pass  # cut by the server
        finally:
            try:
                while s.recv(4096):  # a 400 may come before the close
                    pass
            except OSError:
                pass
            closed.append(time.monotonic() - start)
            s.close()

    threads = [threading.Thread(target=trickle) for _ in range(4)]
    for th in threads:
        th.start()
    time.sleep(0.3)
    for _ in range(20):
        assert _get(t, "/health")[0] == 200
    answered = time.monotonic() - start
    assert not closed, "the tricklers were cut before the other requests were answered: no overlap shown"
    for th in threads:
        th.join(t.deadline_s + 60)
    assert len(closed) == 4 and all(c < 10_000 * 0.1 for c in closed), closed  # cut, not served to the end
    assert min(closed) >= t.deadline_s * 0.9 and answered < min(closed), (answered, closed)


def thousand_requests(t: Target) -> None:
    plan = [("GET", "/health", 200), ("HEAD", "/health", 200), ("GET", "/metrics?name[]=preload_gate_rank_up", 200),
            ("HEAD", "/metrics", 200), ("GET", "/nope", 404), ("PUT", "/health", 405)]
    errors: list[str] = []
    done = [0]
    lock = threading.Lock()

    def client(k: int) -> None:
        c = t.conn()
        try:
            for i in range(250):
                method, path, want = plan[(k + i) % len(plan)]
                c.request(method, path)
                r = c.getresponse()
                r.read()
                if r.status != want:
                    errors.append(f"{method} {path}: {r.status}")
                if r.getheader("Connection") == "close":
                    c.close()  # http.client reconnects on the next request
                with lock:
                    done[0] += 1
        except Exception as exc:  # recorded: the assertion below names it
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            c.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    assert errors == [] and done[0] == 1000, (done, errors[:5])


def with_requests(t: Target) -> None:
    requests = pytest.importorskip("requests") if "pytest" in sys.modules else __import__("requests")
    base = f"http://{t.host}:{t.port}"
    with requests.Session() as s:
        assert s.get(base + "/health", params={"probe": "readiness"}, timeout=30).text == "ok\n"
        assert s.head(base + "/health", timeout=30).status_code == 200
        r = s.get(base + "/metrics", params={"name[]": ["preload_gate_hits_total", "preload_gate_rank_up"]},
                  headers={"Accept": PROMETHEUS_3_ACCEPT}, timeout=30)
        assert r.status_code == 200 and set(_families(r.text, True)) == {"preload_gate_hits", "preload_gate_rank_up"}
        r = s.post(base + "/metrics", data=b"x", timeout=30)
        assert r.status_code == 405 and r.headers["Allow"] == ALLOW


BATTERY: list[Callable[[Target], None]] = [
    kubernetes_probe, query_strings, prometheus_scrapes, head_like_a_load_balancer, keep_alive, other_methods,
    unknown_paths, request_forms, slow_clients, thousand_requests, with_requests,
]


@dataclass
class Traffic:
    """An engine attaching to the daemon's socket over and over while the
    battery runs: get_state, attach, report, close."""

    socket: Path
    checkpoint: Path
    digest: str
    answered: int = 0
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Traffic:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        from preload.client import DaemonClient
        from preload.daemon.raw import raw_key

        key = raw_key(self.checkpoint, self.digest, "shm")
        while not self._stop.wait(0.02):
            try:
                c = DaemonClient.connect(self.socket.parent, 0, timeout_s=5, deadline_s=10)
                try:
                    att = c.get_state(key).attach()
                    c.report_attach()
                    att.close()
                finally:
                    c.close()
                self.answered += 1
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


# ------------------------------------------------------------------ pytest

@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Target, Traffic]]:
    from reliability_support import fresh_checkpoint, promoted_daemon

    from preload.daemon import health

    base = tmp_path_factory.mktemp("health")
    with promoted_daemon(fresh_checkpoint(base / "ckpt", seed=8), base / "cache") as d, \
            pytest.MonkeyPatch.context() as mp:
        mp.setattr(health, "HEAD_DEADLINE_S", 1.5)  # the unit tier's trickler waits 1.5 s, not 10
        server = health.HealthServer("127.0.0.1", 0, [str(d.socket)])
        server.start()
        traffic = Traffic(d.socket, d.checkpoint, d.digest).start()
        try:
            yield Target("127.0.0.1", server.port, 1.5), traffic
        finally:
            traffic.stop()
            server.stop()


pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="health_http")]


@pytest.mark.parametrize("check", BATTERY, ids=[f.__name__ for f in BATTERY])
def test_battery(served: tuple[Target, Traffic], check: Callable[[Target], None]) -> None:
    check(served[0])


def test_the_daemon_served_throughout(served: tuple[Target, Traffic]) -> None:
    traffic = served[1]
    time.sleep(0.2)
    assert traffic.errors == [] and traffic.answered > 20, (traffic.answered, traffic.errors[:3])


def test_control_the_old_string_match_fails_the_battery(served: tuple[Target, Traffic]) -> None:
    """The handler before this change (``self.path == "/health"``, GET only)
    fails the rows a probe or scraper meets: a query string, HEAD, 405."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Old(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            code, body = (200, b"ok\n") if self.path == "/health" else (404, b"not found\n")
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Old)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    old = Target("127.0.0.1", httpd.server_address[1], 1.5)
    try:
        for check in (query_strings, head_like_a_load_balancer, other_methods):
            with pytest.raises(AssertionError):
                check(old)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_rank_that_does_not_answer_is_503_to_get_and_head(served: tuple[Target, Traffic], tmp_path: Path) -> None:
    from preload.daemon.health import HealthServer

    t = served[0]
    code, _, _ = _get(t, "/health")
    assert code == 200  # control
    missing = str(tmp_path / "rank9.sock")
    h = HealthServer("127.0.0.1", 0, [missing])
    h.start()
    try:
        other = Target("127.0.0.1", h.port, 1.5)
        assert _get(other, "/health")[0] == 503
        code, _, body = _get(other, "/health", "HEAD")
        assert code == 503 and body == b""
    finally:
        h.stop()


def main(argv: list[str]) -> int:
    """The battery against a running server: ``HOST:PORT SOCKET``."""
    from preload.client import DaemonClient
    from preload.daemon.health import HEAD_DEADLINE_S

    host, port = argv[0].rsplit(":", 1)
    sock = Path(argv[1])
    c = DaemonClient.connect(sock.parent, int(sock.stem.removeprefix("rank")))
    try:
        served = c.stats()  # what it serves: the traffic asks for exactly that
    finally:
        c.close()
    traffic = Traffic(sock, Path(served["checkpoint"]), str(served["digest"])).start()
    t = Target(host, int(port), HEAD_DEADLINE_S)
    failed = 0
    for check in BATTERY:
        t0 = time.monotonic()
        try:
            check(t)
            print(f"ok    {check.__name__} ({time.monotonic() - t0:.1f} s)")
        except Exception as exc:
            failed += 1
            print(f"FAIL  {check.__name__}: {type(exc).__name__}: {exc}")
    traffic.stop()
    print(f"daemon socket during the battery: {traffic.answered} attaches answered, {len(traffic.errors)} errors"
          + (f" (first: {traffic.errors[0]})" if traffic.errors else ""))
    return 1 if failed or traffic.errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
