"""``/health`` and ``/metrics`` over HTTP, off by default, 127.0.0.1 by default.

Each request asks every rank's socket for ``stats`` (the same path an
engine uses), so 200 means every rank answers on its socket now, not that a
process merely exists. prometheus_client owns the exposition format: a
:class:`RankCollector` in a registry private to the server (never the
process-wide default one) turns the ranks' answers into metric families at
scrape time, and prometheus_client's own WSGI app (``make_wsgi_app``) answers
``/metrics``: content negotiation (``Accept``, OpenMetrics included),
``?name[]=`` filters and gzip are its rules, not ours.

The HTTP side is the standard library's ``http.server`` (HTTP/1.1, so a load
balancer's keep-alive connection stays open), answering the way any web server
does: GET and HEAD (the same headers, no body) with or without a query string,
OPTIONS, 405 with ``Allow`` for every other method, 404 for other paths, and
the library's own 400/414/431/505 for malformed requests. A thread per
connection, at most ``MAX_CONNECTIONS`` at once, and a deadline on each
request's head (``HEAD_DEADLINE_S``), so a client that trickles its request
loses its connection. A connection that has not sent a complete request head
never keeps a probe out: when every slot is taken, the newcomer gets the slot of
the connection that has waited longest for its head (idle after connecting, an
idle keep-alive, a trickler), which is closed; one whose head is complete keeps
its slot while its answer is in time. One whose client has not taken an answer
``ANSWER_S`` after it began (a client that sends and never reads: the handler
is stuck writing to it) is evictable too, once no connection waits for a head.

Every answer comes within a Kubernetes probe's default timeoutSeconds (1 s),
whatever a rank does: every rank is asked at once, and one that has not
answered within ``RANK_ANSWER_S`` (stopped, hung mid-hello or after it) is
down, named in the 503's body with why.

The names and labels are what operators' dashboards read; they stay as they
are even where Prometheus' naming advice would differ (``rank_up`` samples of
a rank that does not answer carry only ``socket``: there is no rank or digest
to report).
"""

from __future__ import annotations

import fcntl
import logging
import socket
import struct
import termios
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import psutil
from prometheus_client import make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from pgbase.errors import DaemonBusyError, PreloadGateError, ProtocolError
from preload.client import DaemonClient

PREFIX = "preload_gate_"
PATHS = ("/health", "/metrics")
ALLOWED_METHODS = ("GET", "HEAD", "OPTIONS")
# The request line and headers must arrive within this from the first wait
# (an idle keep-alive connection is closed after it too); each read or write
# must progress within IO_TIMEOUT_S.
HEAD_DEADLINE_S = 10.0
IO_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64
# An answer whose client has not taken it this long after it began is stuck (the
# ranks are asked within RANK_ANSWER_S; the rest, to a probe's 1 s, is a write's
# allowance): its slot can go to a newcomer when every slot is taken.
WRITE_ALLOWANCE_S = 0.4

log = logging.getLogger("preload.daemon")

# The fd store's counters of a rank (preload.daemon.counters.RankStats, preload.daemon.adopt).
ARENA_COUNTERS = {
    "adopted": "arenas taken over from the fd store, proven, with no checkpoint read",
    "proof_failed": "stored arenas that failed their proof (dropped; the rank read the checkpoint)",
    "loaded_from_disk": "arenas filled by reading the checkpoint",
    "evicted": "arenas dropped from the fd store by a release or a clean stop",
}


class RankReply(NamedTuple):
    """What a rank's socket said to ``stats``: the answer (``stats``), or
    why there is none. ``refused``: a daemon answered and refused us (one
    of another release refuses our protocol version by name). ``busy``: a
    daemon listens but its listen backlog stayed full for the connect
    timeout (:class:`pgbase.errors.DaemonBusyError`): alive, not down.
    ``down``: why nothing answers on the socket (for a person: nothing
    listens, no answer in time, its process is stopped)."""

    stats: dict[str, Any] | None
    refused: str | None = None
    busy: str | None = None
    down: str | None = None

    @property
    def up(self) -> bool:
        """A daemon is there: it answered, or it is too busy to (not down)."""
        return self.stats is not None or self.busy is not None


# /health and /metrics answer within a Kubernetes probe's default timeoutSeconds
# (1 s): every rank is asked at once and given RANK_ANSWER_S in all; the rest is
# for a loaded host to schedule and write the answer (0.2 s was not always enough
# on two busy cores). A busy one is retried for PROBE_CONNECT_S of it, well inside,
# so that its last try (a daemon at its cap answers it `busy`) and the check of its
# lock holder also come in time: busy, not late.
PROBE_CONNECT_S = 0.25
RANK_ANSWER_S = 0.6
# A left-behind ask (a hung rank) ends this long after the bound: its own deadline
# is later than the wait for it, so a late rank reads as late, not as a timed-out
# frame (ProtocolError), and no thread outlives a probe by much.
_ASK_GRACE_S = 0.5
ANSWER_S = RANK_ANSWER_S + WRITE_ALLOWANCE_S


def ask_rank(socket_path: str | Path, connect_timeout_s: float = 2.0, deadline_s: float = 5.0) -> RankReply:
    """A rank's ``stats`` answer, or why there is none (:class:`RankReply`);
    a busy rank is retried for ``connect_timeout_s`` seconds; each frame of the
    exchange (hello, stats) must come within ``deadline_s``. Not bounded as a
    whole: :func:`ask_ranks` is."""
    p = Path(socket_path)
    rank = int(p.stem.removeprefix("rank"))
    try:
        c = DaemonClient.connect(p.parent, rank, timeout_s=connect_timeout_s, deadline_s=deadline_s,
                                 client="preload-gate-health")
    except DaemonBusyError as exc:
        # A full backlog is also what a stopped rank leaves (nothing accepts; closed
        # probes stay queued): busy only while the rank's lock holder can run.
        stopped = _holder_down(p.parent, rank)
        return RankReply(None, down=f"{stopped} (its listen backlog is full)") if stopped else \
            RankReply(None, busy=str(exc))
    except ProtocolError as exc:
        return RankReply(None, refused=str(exc))
    except PreloadGateError as exc:
        return RankReply(None, down=str(exc))
    try:
        return RankReply(c.stats())
    except ProtocolError as exc:
        return RankReply(None, refused=str(exc))
    except PreloadGateError as exc:
        return RankReply(None, down=str(exc))
    finally:
        c.close()


def ask_ranks(sockets: Sequence[str], within_s: float = RANK_ANSWER_S) -> list[RankReply]:
    """Every rank's :func:`ask_rank` reply, in the order of ``sockets``, all
    asked at once and back within ``within_s`` seconds whatever a rank does:
    one that has not answered by then is down ("no answer within 0.6 s",
    with its lock holder's state when that says why). The asks left behind
    end by their own deadlines, shortly after."""
    if not sockets:
        return []
    end = time.monotonic() + within_s
    pool = ThreadPoolExecutor(max_workers=len(sockets), thread_name_prefix="health-ask")
    try:
        asks = [pool.submit(ask_rank, s, min(PROBE_CONNECT_S, within_s), within_s + _ASK_GRACE_S) for s in sockets]
        done, _ = wait(asks, timeout=max(end - time.monotonic(), 0.0))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a hung rank must not hold the answer
    replies = []
    for sock, ask in zip(sockets, asks, strict=True):
        if ask not in done:
            p = Path(sock)
            stopped = _holder_down(p.parent, _rank_of(p))
            replies.append(RankReply(None, down=f"no answer within {within_s:g} s" + (f"; {stopped}" if stopped else "")))
        elif (exc := ask.exception()) is not None:  # no traceback for a probe: say what failed
            replies.append(RankReply(None, down=f"asking it failed: {type(exc).__name__}: {exc}"))
        else:
            replies.append(ask.result())
    return replies


def _rank_of(socket_path: Path) -> int:
    """The global rank a socket serves (``rank3.sock``: 3); -1 for another name."""
    try:
        return int(socket_path.stem.removeprefix("rank"))
    except ValueError:
        return -1


def _holder_down(socket_dir: Path, rank: int) -> str | None:
    """Why the process holding ``rank``'s lock answers no one, busy or not:
    stopped (SIGSTOP, a debugger), a zombie, or gone (psutil's process
    status, from /proc); None when it can run, or no process holds the lock."""
    from preload.daemon.lock import lock_holder

    try:
        holder = lock_holder(socket_dir, rank)
    except OSError:
        return None
    if holder is None or not holder.isdigit():
        return None
    try:
        status = psutil.Process(int(holder)).status()
    except psutil.NoSuchProcess:
        return f"process {holder}, which holds its lock, is gone"
    except psutil.Error:
        return None
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return f"process {holder}, which holds its lock, is {status}"
    return None


def _down_lines(sockets: Sequence[str], replies: Sequence[RankReply]) -> str:
    """A 503's body: a line per rank that is down, naming it and why.

    >>> _down_lines(["/run/pg/ab12/rank0.sock"], [RankReply(None, down="no answer within 0.6 s")])
    'down: rank 0 (/run/pg/ab12/rank0.sock): no answer within 0.6 s\\n'
    """
    return "".join(f"down: rank {_rank_of(Path(s))} ({s}): {r.down or r.refused or 'no answer'}\n"
                   for s, r in zip(sockets, replies, strict=True) if not r.up)


def rank_stats(socket_path: str | Path) -> dict[str, Any] | None:
    """A rank's ``stats`` answer, or None when its socket does not answer it
    (busy included: :func:`ask_rank` tells busy from down)."""
    return ask_rank(socket_path).stats


def metric_families(stats: Sequence[RankReply | dict[str, Any] | None], sockets: Sequence[str]) -> list[Metric]:
    """The daemon's metric families from each rank's reply (:func:`ask_rank`;
    a bare ``stats`` dict is an answer, None: the rank did not answer), in
    the order of ``sockets``.

    ``rank_up`` (gauge, 1/0) per socket: 1 for a rank that answers and for
    one too busy to (``rank_busy`` 1: its listen backlog stayed full; it is
    alive, and a liveness probe must not restart it); per answering rank, labelled
    ``rank`` and ``digest``: ``hits_total``, ``misses_total`` (by ``reason``)
    and ``attach_failures_total`` (by ``kind``) (counters),
    ``attached_engines``, ``resident_bytes`` and ``load_seconds`` (gauges);
    and where the arena came from (issue 26, counters): ``adopted_total``,
    ``proof_failed_total``, ``loaded_from_disk_total``, ``evicted_total``.
    """
    base_labels = ["rank", "digest"]
    up = GaugeMetricFamily(PREFIX + "rank_up", "1 when a daemon is there on the rank's socket (answering, or busy)")
    busy = GaugeMetricFamily(PREFIX + "rank_busy", "1 when the rank's listen backlog stayed full for the connect "
                             "timeout (alive, too busy to answer this scrape)")
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
    arena_counters = {name: CounterMetricFamily(PREFIX + name, help_, labels=base_labels)
                      for name, help_ in ARENA_COUNTERS.items()}
    for sock, reply in zip(sockets, stats, strict=True):
        r = reply if isinstance(reply, RankReply) else RankReply(reply)
        s = r.stats
        if s is None:
            up.add_sample(up.name, {"socket": sock}, int(r.up))
            busy.add_sample(busy.name, {"socket": sock}, int(r.busy is not None))
            continue
        busy.add_sample(busy.name, {"socket": sock}, 0)
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
        for name in ARENA_COUNTERS:
            arena_counters[name].add_metric(base, s.get(name, 0))  # a rank of an older release: 0
    return [up, busy, hits, misses, failures, attached, resident, load, *arena_counters.values()]


class RankCollector(Collector):
    """Asks every rank for ``stats`` when scraped (prometheus_client's custom
    collector shape), so a scrape reports the ranks as they are now."""

    def __init__(self, sockets: Sequence[str]) -> None:
        self.sockets = list(sockets)

    def collect(self) -> Iterator[Metric]:
        yield from metric_families(ask_ranks(self.sockets), self.sockets)

    def describe(self) -> Iterator[Metric]:
        # The families' names without asking a rank: the registry learns them at
        # registration, so ``?name[]=`` filters find this collector.
        yield from metric_families([], [])


def metrics_registry(sockets: Sequence[str]) -> CollectorRegistry:
    """A registry of its own holding only the ranks' collector: the default
    registry would add this process' own metrics and outlive the server."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankCollector(sockets))
    return registry


class _Deadlines:
    """One thread that shuts down connections whose request head is late:
    a socket timeout bounds each read, not a request trickled a byte at a time."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._due: dict[socket.socket, float] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="health-deadlines", daemon=True)
        self._thread.start()

    def arm(self, conn: socket.socket, seconds: float) -> None:
        with self._cv:
            self._due[conn] = time.monotonic() + seconds
            self._cv.notify()

    def disarm(self, conn: socket.socket) -> None:
        with self._cv:
            self._due.pop(conn, None)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(5)

    def _run(self) -> None:
        with self._cv:
            while not self._stopped:
                now = time.monotonic()
                for conn in [c for c, t in self._due.items() if t <= now]:
                    del self._due[conn]
                    try:
                        conn.shutdown(socket.SHUT_RDWR)  # the blocked read returns; the handler closes
                    except OSError:
                        pass
                self._cv.wait(min(self._due.values(), default=now + 3600) - now)


@dataclass
class _Slot:
    """A connection's slot: waiting for a request head since ``since``, or
    answering (``waiting`` False) since ``since``: the start of the oldest
    answer its client has not taken (a pipelined request read while the
    answer before it is still unread keeps the earlier start)."""

    waiting: bool
    since: float
    owed_since: float | None = None  # while waiting: when its last answer began


def _untaken(conn: socket.socket) -> int:
    """Bytes written to ``conn`` that its client has not taken (acknowledged)
    yet: the kernel's send queue (SIOCOUTQ); 0 where it cannot say."""
    try:
        out: int = struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return 0
    return out


class _Connections:
    """The server's connections (:class:`_Slot`), at most ``limit``. When
    full, a newcomer takes the slot of the one that has waited longest for its
    head, so idle or trickling sockets cannot lock a probe out for
    ``HEAD_DEADLINE_S``; failing that, of the one whose client has left an
    answer untaken longest, past ``ANSWER_S`` (a client that sends and never
    reads: its handler is stuck writing for ``IO_TIMEOUT_S``). An answer in
    time, or one its client has taken, keeps its slot."""

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self._limit = limit
        self._slots: dict[socket.socket, _Slot] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    def admit(self, conn: socket.socket) -> bool:
        """Take a slot for ``conn`` (evicting if need be); False when every slot is an answer in time."""
        with self._lock:
            if len(self._slots) >= self._limit:
                oldest = self._evictable()
                if oldest is None:
                    return False
                del self._slots[oldest]
                try:
                    # The read side: its blocked read returns what arrived, then EOF, and a head
                    # that was complete by then is still answered (see _Handler.parse_request).
                    # The write side too where its client leaves what we wrote untaken: its
                    # handler's blocked write fails (EPIPE) now, not after IO_TIMEOUT_S.
                    oldest.shutdown(socket.SHUT_RDWR if _untaken(oldest) > 0 else socket.SHUT_RD)
                except OSError:
                    pass
            self._slots[conn] = _Slot(waiting=True, since=time.monotonic())
            return True

    def _evictable(self) -> socket.socket | None:
        waiting = [(slot.since, i, c) for i, (c, slot) in enumerate(self._slots.items()) if slot.waiting]
        if waiting:
            return min(waiting)[2]
        late = time.monotonic() - ANSWER_S
        stuck = [(slot.since, i, c) for i, (c, slot) in enumerate(self._slots.items())
                 if slot.since <= late and _untaken(c) > 0]
        return min(stuck)[2] if stuck else None

    def waiting(self, conn: socket.socket) -> None:
        """``conn`` waits for its next request head (a keep-alive connection between requests)."""
        with self._lock:
            # A fresh connection keeps the stamp admit gave it: its handler thread may start
            # after a newer one's (under load), and eviction must follow arrival, not scheduling.
            slot = self._slots.get(conn)
            if slot is not None and not slot.waiting:
                slot.waiting, slot.owed_since, slot.since = True, slot.since, time.monotonic()

    def answering(self, conn: socket.socket) -> None:
        """``conn``'s head is read: it keeps its slot while its answer is in time
        (an evicted one has none)."""
        with self._lock:
            slot = self._slots.get(conn)
            if slot is not None:
                owed = slot.owed_since if slot.owed_since is not None and _untaken(conn) > 0 else None
                slot.waiting, slot.owed_since = False, None
                slot.since = owed if owed is not None else time.monotonic()

    def release(self, conn: socket.socket) -> None:
        with self._lock:
            self._slots.pop(conn, None)


class _HeadLines:
    """The handler's reader while it parses a request head: notes the blank
    line that ends the head (a read cut short by EOF ends it without one)."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader
        self.complete = False

    def readline(self, limit: int = -1) -> bytes:
        line: bytes = self._reader.readline(limit)
        if line in (b"\r\n", b"\n"):
            self.complete = True
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = MAX_CONNECTIONS

    def __init__(self, address: tuple[str, int], sockets: list[str]) -> None:
        # The family of what the host resolves to (an IPv6 --health-host binds too).
        self.address_family = socket.getaddrinfo(address[0], address[1], type=socket.SOCK_STREAM,
                                                 flags=socket.AI_PASSIVE)[0][0]
        self.sockets = sockets
        self.metrics_app = make_wsgi_app(metrics_registry(sockets))
        self.deadlines = _Deadlines()
        self.connections = _Connections(MAX_CONNECTIONS)
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.connections.admit(request):  # every slot an answer in time: refuse this one, serve the others
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.connections.release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connections.release(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that vanished mid-answer is routine for a probe server: no traceback on stderr.
        log.debug("health: request from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive for load balancers; 1.0 clients are answered as 1.0 wants
    # Before a request's version is read (a malformed line, HTTP/2.0), http.server's
    # default "HTTP/0.9" would answer its error with no status line or headers.
    default_request_version = "HTTP/1.0"
    server_version = "preload-gate-health"
    timeout = IO_TIMEOUT_S
    server: _Server

    def handle_one_request(self) -> None:
        self.server.connections.waiting(self.connection)
        self.server.deadlines.arm(self.connection, HEAD_DEADLINE_S)
        try:
            super().handle_one_request()
        finally:
            self.server.deadlines.disarm(self.connection)

    def parse_request(self) -> bool:
        if not self.raw_requestline.endswith(b"\n"):
            # EOF cut the request line short (an evicted or timed-out connection,
            # or a client that gave up): not a request, so no answer (http.server
            # would answer its fragment with a 400 page, headerless as HTTP/0.9).
            self.close_connection = True
            return False
        reader, head = self.rfile, _HeadLines(self.rfile)
        self.rfile = head  # type: ignore[assignment]  # only readline is asked of it while parsing
        try:
            ok = super().parse_request()  # reads the headers
        finally:
            self.rfile = reader
        self.server.deadlines.disarm(self.connection)  # the answer may take a rank's timeout
        self.server.connections.answering(self.connection)  # complete or not, it no longer waits
        if ok and not head.complete:
            # EOF cut the head short (evicted, past its deadline, or the client gave up):
            # not a request, so no answer and no rank asked.
            self.close_connection = True
            return False
        return ok

    def __getattr__(self, name: str) -> Any:
        # http.server dispatches to do_<METHOD> and answers 501 where there is
        # none; a server answers a method its resource does not allow with 405.
        if name.startswith("do_"):
            return self._not_allowed
        raise AttributeError(name)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self._route()
        if path == "/health":
            # A busy rank is alive (its backlog is full of engines connecting): a
            # liveness probe that restarted it would drop weights engines are mapping.
            socks = self.server.sockets
            replies = ask_ranks(socks)
            ok = all(r.up for r in replies)
            busy = [s for s, r in zip(socks, replies, strict=True) if r.busy]
            body = _down_lines(socks, replies) if not ok else f"ok: busy: {', '.join(busy)}\n" if busy else "ok\n"
            self._send(200 if ok else 503, body.encode(),
                       [("Content-Type", "text/plain; charset=utf-8"), ("Cache-Control", "no-store")])
        elif path == "/metrics":
            self._metrics()

    do_HEAD = do_GET  # the same status and headers; _send leaves the body out

    def do_OPTIONS(self) -> None:  # noqa: N802
        if self.path == "*" or self._route():
            self._send(204, b"", [("Allow", ", ".join(ALLOWED_METHODS))])

    def _not_allowed(self) -> None:
        if self._route():
            self._send(405, f"method {self.command} is not allowed; use GET or HEAD\n".encode(),
                       [("Content-Type", "text/plain; charset=utf-8"), ("Allow", ", ".join(ALLOWED_METHODS))])

    def _route(self) -> str | None:
        """The request's path if it is ours (query string and an absolute
        form's scheme and host set aside); else 404 sent and None."""
        target = self.path  # origin-form ("/health?x", "//x/health" a path too) or absolute-form
        path = target.partition("?")[0] if target.startswith("/") else urlsplit(target).path
        if path in PATHS:
            return path
        self._send(404, f"not found: {path}; this server answers {' and '.join(PATHS)}\n".encode(),
                   [("Content-Type", "text/plain; charset=utf-8")])
        return None

    def _metrics(self) -> None:
        """prometheus_client's own WSGI app, asked as a GET (a HEAD gets its headers)."""
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics", "QUERY_STRING": urlsplit(self.path).query,
                   "HTTP_ACCEPT": self.headers.get("Accept", ""),
                   "HTTP_ACCEPT_ENCODING": self.headers.get("Accept-Encoding", "")}
        answer: dict[str, Any] = {}

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
            answer["code"], answer["headers"] = int(status.split()[0]), headers

        body = b"".join(self.server.metrics_app(environ, start_response))
        self._send(answer["code"], body, answer["headers"])

    def _send(self, code: int, body: bytes, headers: list[tuple[str, str]]) -> None:
        self.send_response(code)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        if self.headers.get("Content-Length", "0").strip() != "0" or "Transfer-Encoding" in self.headers:
            # A request body we never read would be parsed as the next request.
            self.close_connection = True
        if self.close_connection:  # asked for (Connection: close, HTTP/1.0) or ours: said, as HTTP/1.1 wants
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        log.debug("health: " + format, *args)


class HealthServer:
    """``/health`` (200 ``ok`` when every rank answers, else 503) and
    ``/metrics`` on ``host:port`` (port 0: any free port, see ``port``).

    >>> h = HealthServer("127.0.0.1", 0, ["/tmp/pg/ab12/rank0.sock"]); h.start()  # doctest: +SKIP
    >>> urllib.request.urlopen(f"http://127.0.0.1:{h.port}/health").status  # doctest: +SKIP
    200
    """

    def __init__(self, host: str, port: int, sockets: list[str]) -> None:
        self._httpd = _Server((host, port), list(sockets))
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def connections(self) -> int:
        """How many connections hold a slot now (at most ``MAX_CONNECTIONS``)."""
        return len(self._httpd.connections)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._httpd.deadlines.stop()
