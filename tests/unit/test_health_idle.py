"""Connections that have not sent a complete request head never keep a probe out.

``MAX_CONNECTIONS`` sockets that connect and send nothing (or trickle a
request a byte at a time) fill every slot of the health server; a Kubernetes
probe (timeout 1 s) that comes next must still get its 200 at once, not after
``HEAD_DEADLINE_S``. When the slots are full the server closes the connection
that has waited longest for its head; a connection whose head is complete
(its answer in progress) is never the one closed.

The ranks are a stub of ``health.ask_ranks`` (the HTTP side is what is
under test; test_health_http.py holds the battery against a live daemon).
Controls: the same probe against the server refusing the newcomer instead
(today's behaviour before this change) fails; the sockets closed are the idle
ones (their ``recv`` gets EOF) and a client mid-answer gets its answer.
"""

from __future__ import annotations

import http.client
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from preload.daemon import health

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="health_idle")]

PROBE_TIMEOUT_S = 1.0  # a Kubernetes probe's default timeoutSeconds


@dataclass
class Ranks:
    """``ask_ranks`` for the server's one (fake) rank; ``hold`` keeps an answer
    in progress (longer than a real rank's bound, RANK_ANSWER_S: what is under
    test is that an answer in progress keeps its slot)."""

    hold: threading.Event = field(default_factory=threading.Event)
    entered: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.hold.set()

    def __call__(self, sockets: list[str], within_s: float = health.RANK_ANSWER_S) -> list[health.RankReply]:
        self.entered.set()
        assert self.hold.wait(30)
        return [health.RankReply({"rank": 0, "digest": "ab" * 32, **STATS}) for _ in sockets]


# What a rank's ``stats`` says beyond its rank and digest (what /metrics reads).
STATS = {"hits": 3, "misses": {"key_mismatch": 1}, "attach_failures": {}, "attached": 1,
         "resident_bytes": 1 << 20, "load_seconds": 0.5}


@dataclass
class Served:
    server: health.HealthServer
    ranks: Ranks
    kind: str  # a key of EVICTION: "evicting" is the server as built

    @property
    def as_built(self) -> bool:
        return self.kind == "evicting"

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.server.port)

    def idle(self, n: int) -> list[socket.socket]:
        """``n`` connections that send nothing, accepted by the server (in order) before this returns."""
        want = min(self.server.connections() + n, health.MAX_CONNECTIONS)
        out = [socket.create_connection(self.address, timeout=5) for _ in range(n)]
        _wait_accepted(self, want)
        return out

    def probe(self) -> int:
        c = http.client.HTTPConnection(*self.address, timeout=PROBE_TIMEOUT_S)
        try:
            c.request("GET", "/health", headers={"User-Agent": "kube-probe/1.30", "Connection": "close"})
            r = c.getresponse()
            assert r.read() == b"ok\n"
            return r.status
        finally:
            c.close()


def _wait_accepted(s: Served, n: int) -> None:
    """Until the server holds ``n`` connections (its accept loop is asynchronous to our connect)."""
    _wait_until(lambda: s.server.connections() >= n)


def _wait_until(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def _oldest_of_all(self: health._Connections) -> socket.socket | None:
    """A naive eviction: the oldest connection, whether or not its head is complete."""
    return next(iter(self._slots), None)


# The server as built, and the two bugs its tests must catch.
EVICTION = {
    "evicting": None,
    "refusing": lambda self: None,  # before this change: when full, the newcomer is refused
    "naive": _oldest_of_all,
}


def _serve(kind: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    if EVICTION[kind] is not None:
        monkeypatch.setattr(health._Connections, "_evictable", EVICTION[kind])
    ranks = Ranks()
    monkeypatch.setattr(health, "ask_ranks", ranks)
    server = health.HealthServer("127.0.0.1", 0, ["/nonexistent/ab12/rank0.sock"])
    server.start()
    try:
        yield Served(server, ranks, kind)
    finally:
        ranks.hold.set()
        server.stop()


@pytest.fixture(params=["evicting", "refusing"])
def served(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """The server, and as the control the one that refuses a newcomer when full."""
    yield from _serve(request.param, monkeypatch)


@pytest.fixture(params=["evicting", "naive"])
def served_busy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """The server, and as the control one that evicts the oldest connection even mid-answer."""
    yield from _serve(request.param, monkeypatch)


def _eof(s: socket.socket, within: float) -> bool:
    """True when the server closed ``s`` (EOF or reset) within ``within`` seconds."""
    s.settimeout(within)
    try:
        return s.recv(4096) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _closed_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


def test_idle_connections_do_not_keep_a_probe_out(served: Served) -> None:
    idle = served.idle(health.MAX_CONNECTIONS)
    try:
        t0 = time.monotonic()
        if not served.as_built:
            with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
                served.probe()
            return
        assert served.probe() == 200
        assert time.monotonic() - t0 < PROBE_TIMEOUT_S
        # The probe's slot came from the connection that waited longest; the others stay open.
        assert _eof(idle[0], 2.0), "the oldest idle connection was not the one closed"
        readable, _, _ = select.select(idle[1:], [], [], 0.3)  # a closed socket reads (EOF)
        assert readable == [], "a newer idle connection was closed too"
        # The probe's own slot is free once answered; filled again, each probe takes
        # the slot of the next oldest idle connection.
        for k in range(1, 4):
            # The probe's thread lets its slot go after its answer: wait for that first.
            _wait_until(lambda: served.server.connections() < health.MAX_CONNECTIONS)
            idle += served.idle(1)
            assert served.probe() == 200
            assert _eof(idle[k], 2.0)
    finally:
        _closed_all(idle)


def test_a_complete_head_mid_answer_is_never_evicted(served_busy: Served) -> None:
    """A keep-alive client whose answer is in progress (the rank is slow)
    keeps its connection while more than MAX_CONNECTIONS idle ones come and go."""
    served = served_busy
    served.ranks.hold.clear()
    served.ranks.entered.clear()
    busy = http.client.HTTPConnection(*served.address, timeout=30)
    busy.request("GET", "/health")  # HTTP/1.1 keep-alive
    assert served.ranks.entered.wait(5)
    idle = served.idle(health.MAX_CONNECTIONS - 1)  # every slot taken, the busy one among them
    more = [socket.create_connection(served.address, timeout=5) for _ in range(8)]  # each evicts one
    try:
        closed = [_eof(s, 5.0) for s in idle[:8]]  # the oldest first, whatever the load
        served.ranks.hold.set()
        r = busy.getresponse()
        assert r.status == 200 and r.read() == b"ok\n"  # SHUT_RD: an evicted head is still answered
        assert busy.sock is not None
        if not served.as_built:
            # The busy one went first: its slot is gone, so the server closes it once answered.
            # (Asked again at once, a request can race into its receive queue before the handler's
            # next read sees EOF, and be answered: what marks the eviction is the close.)
            assert _eof(busy.sock, 5.0), "the naive control kept the evicted keep-alive connection open"
            return
        assert all(closed), closed
        assert not _eof(busy.sock, 0.5), "a connection mid-answer was closed after its answer"
        busy.sock.settimeout(30)
        # Still the same connection: it answers the next request too.
        busy.request("GET", "/health")
        r = busy.getresponse()
        assert r.status == 200 and r.read() == b"ok\n"
    finally:
        busy.close()
        _closed_all(idle + more)


def test_slow_loris_of_more_than_max_connections(served: Served) -> None:
    """MAX_CONNECTIONS + 16 clients trickle a request a byte every 0.1 s; every
    probe meanwhile answers 200 within its 1 s timeout and the tricklers are cut."""
    stop = threading.Event()
    cut: list[int] = []
    lock = threading.Lock()

    def trickle(k: int) -> None:
        try:
            s = socket.create_connection(served.address, timeout=30)
        except OSError:
            with lock:
                cut.append(k)
            return
        try:
            for b in b"GET /health HTTP/1.1\r\nHost: slow\r\nX-Pad: " + b"x" * 10_000:
                if stop.is_set():
                    return
                s.send(bytes([b]))
                time.sleep(0.1)
        except OSError:
            with lock:
                cut.append(k)
        finally:
            s.close()

    n = health.MAX_CONNECTIONS + 16
    threads = [threading.Thread(target=trickle, args=(k,), daemon=True) for k in range(n)]
    for th in threads:
        th.start()
        time.sleep(0.005)
    time.sleep(0.5)  # every trickler connected and sending
    try:
        if not served.as_built:
            with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
                served.probe()
            return
        for _ in range(10):
            t0 = time.monotonic()
            assert served.probe() == 200
            assert time.monotonic() - t0 < PROBE_TIMEOUT_S
            time.sleep(0.05)
        time.sleep(0.5)
        with lock:
            assert len(cut) >= 16, f"only {len(cut)} tricklers were cut: the server held more than it has slots"
    finally:
        stop.set()
        for th in threads:
            th.join(5)


@pytest.fixture
def served_as_built(monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    yield from _serve("evicting", monkeypatch)


@pytest.mark.parametrize("fragment", [b"GE", b"GET /health HTTP/1.1\r\nHost: cut"], ids=["line", "headers"])
def test_an_evicted_fragment_gets_no_answer(served_as_built: Served, fragment: bytes) -> None:
    """A connection evicted part-way through its head is closed unanswered:
    http.server would answer the fragment (``GE``: a 400 page with no status
    line, as HTTP/0.9). The control: a whole request sent the same way,
    first in line, is answered before any eviction."""
    served = served_as_built
    whole = socket.create_connection(served.address, timeout=5)
    whole.sendall(b"GET /health HTTP/1.0\r\n\r\n")
    whole.settimeout(5)
    assert whole.recv(64).startswith(b"HTTP/1.1 200 "), "control: a whole request is answered"
    whole.close()
    _wait_until(lambda: served.server.connections() == 0)
    cut = socket.create_connection(served.address, timeout=5)
    cut.sendall(fragment)
    _wait_accepted(served, 1)
    time.sleep(0.2)  # the fragment is read: the connection waits for the rest of its head
    idle = served.idle(health.MAX_CONNECTIONS)  # the last of these evicts the fragment (waited longest)
    try:
        cut.settimeout(3)
        try:
            got = cut.recv(4096)
        except ConnectionResetError:
            got = b""
        assert got == b"", f"an evicted fragment was answered: {got[:80]!r}"
    finally:
        cut.close()
        _closed_all(idle)



def _restamp_always(self: health._Connections, conn: socket.socket) -> None:
    """Before this change: every handler start re-stamped its connection, fresh or not."""
    with self._lock:
        if conn in self._slots:
            self._slots[conn] = health._Slot(waiting=True, since=time.monotonic())


@pytest.mark.parametrize("waiting", [None, _restamp_always], ids=["as_built", "restamp_control"])
def test_eviction_follows_arrival_not_the_order_handler_threads_start(
        waiting: Callable[[health._Connections, socket.socket], None] | None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under load a newer connection's handler thread can run before an older
    one's; the slot a newcomer takes is still the oldest arrival's (CI saw a
    stamp taken at handler start evict the wrong idle socket). A keep-alive
    connection back from an answer waits from then on. Control: re-stamping at
    every handler start evicts the newest arrival instead."""
    if waiting is not None:
        monkeypatch.setattr(health._Connections, "waiting", waiting)
    conns = health._Connections(3)
    pairs = [socket.socketpair() for _ in range(4)]
    first, second, third, newcomer = (p[0] for p in pairs)
    try:
        for c in (first, second, third):
            assert conns.admit(c)
            time.sleep(0.002)  # distinct stamps
        for c in (third, second, first):  # their handler threads start newest first
            conns.waiting(c)
            time.sleep(0.002)
        assert conns.admit(newcomer)
        if waiting is not None:
            assert first in conns._slots and third not in conns._slots
            return
        assert first not in conns._slots, "the oldest arrival kept its slot"
        assert all(c in conns._slots for c in (second, third, newcomer))
        conns.answering(second)  # second is answered, then waits for its next head: newest waiter
        conns.waiting(second)
        conns.release(newcomer)
        assert conns.admit(newcomer)
        assert conns.admit(first)  # full again: third has waited longest now
        assert third not in conns._slots and second in conns._slots
    finally:
        for p in pairs:
            for s in p:
                s.close()


# ------------------------------------------------- clients that never read their answers

def _evictable_before_this_change(self: health._Connections) -> socket.socket | None:
    """Before this change: only a connection waiting for its head gave up its slot."""
    waiting = [(slot.since, i, c) for i, (c, slot) in enumerate(self._slots.items()) if slot.waiting]
    return min(waiting)[2] if waiting else None


def _small_send_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's connections get small send buffers. Loopback gives each
    ~4 MB, room for ~1,400 answers before a write blocks; the reviewer's 70
    sockets blocked under the kernel's memory pressure. 4 KiB blocks a write
    after a few answers, with no 256 MB of kernel memory in a unit test."""
    accept = health._Server.get_request

    def get_request(self: health._Server) -> tuple[socket.socket, object]:
        conn, addr = accept(self)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        return conn, addr

    monkeypatch.setattr(health._Server, "get_request", get_request)


@pytest.fixture(params=["evicting", "waiting_only"])
def served_flooded(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """The server with small send buffers, and as the control the eviction before this change."""
    if request.param == "waiting_only":
        monkeypatch.setattr(health._Connections, "_evictable", _evictable_before_this_change)
    _small_send_buffers(monkeypatch)
    yield from _serve("evicting", monkeypatch)


def _all_stuck(server: health.HealthServer) -> bool:
    """Every slot taken by a connection answering for longer than ANSWER_S."""
    conns = server._httpd.connections
    with conns._lock:
        now = time.monotonic()
        return len(conns._slots) == health.MAX_CONNECTIONS and all(
            not s.waiting and now - s.since > health.ANSWER_S for s in conns._slots.values())


def test_clients_that_never_read_do_not_keep_a_probe_out(served_flooded: Served,
                                                         request: pytest.FixtureRequest) -> None:
    """The reviewer's script: 70 clients send 200 pipelined GET /metrics each
    and never read; every slot is then held by a handler stuck writing (for
    IO_TIMEOUT_S, 10 s). A probe that comes next gets its 200 within its 1 s
    timeout: the connection whose answer has gone untaken longest gives up
    its slot, and only that one. Control: the eviction before this change
    (waiting connections only) closes the probe unanswered."""
    served = served_flooded
    flood: list[socket.socket] = []
    try:
        for _ in range(health.MAX_CONNECTIONS + 6):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            s.settimeout(5)
            s.connect(served.address)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 200)
            flood.append(s)
        deadline = time.monotonic() + 8  # well inside IO_TIMEOUT_S, when the stuck writes give up
        while not _all_stuck(served.server) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _all_stuck(served.server), "precondition: every slot held by an answer its client does not take"
        if request.node.callspec.params["served_flooded"] == "waiting_only":
            with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
                served.probe()
            return
        t0 = time.monotonic()
        assert served.probe() == 200
        assert time.monotonic() - t0 < PROBE_TIMEOUT_S
        # One stuck connection gave up its slot; the probe's is free again once answered.
        _wait_until(lambda: served.server.connections() < health.MAX_CONNECTIONS)
        assert served.server.connections() == health.MAX_CONNECTIONS - 1
    finally:
        _closed_all(flood)


def _restamp_answering(self: health._Connections, conn: socket.socket) -> None:
    """A naive answering(): every head read starts the clock again, pipelined or not."""
    with self._lock:
        if conn in self._slots:
            self._slots[conn] = health._Slot(waiting=False, since=time.monotonic())


@pytest.mark.parametrize("answering", [None, _restamp_answering], ids=["as_built", "restamp_control"])
def test_only_an_answer_its_client_leaves_untaken_past_the_bound_gives_up_its_slot(
        answering: Callable[[health._Connections, socket.socket], None] | None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every slot answering: one whose client has not taken what was written
    (bytes in its send queue) past ANSWER_S is evicted; one in time, or one
    past it with nothing untaken (its answer still being made: a slow rank,
    a starved thread), never is. A pipelined request read while the answer
    before it is still untaken keeps the earlier start. Control: restamping
    at each head read lets a pipelining client that never reads stay in time."""
    if answering is not None:
        monkeypatch.setattr(health._Connections, "answering", answering)
    conns = health._Connections(2)
    pairs = [socket.socketpair() for _ in range(4)]
    making, unread, newcomer, later = (p[0] for p in pairs)
    try:
        for c in (making, unread):
            assert conns.admit(c)
            conns.answering(c)
        unread.sendall(b"x" * 1000)  # its peer never reads
        assert not conns.admit(newcomer), "an answer in time was evicted"
        t0 = conns._slots[unread].since
        conns.waiting(unread)  # answered; its client pipelined the next request
        conns.answering(unread)
        if answering is not None:
            assert conns._slots[unread].since > t0, "control: the clock started again"
            return
        assert conns._slots[unread].since == t0, "a pipelined request restarted an untaken answer's clock"
        monkeypatch.setattr(health, "ANSWER_S", 0.0)  # both past the bound now
        assert conns.admit(newcomer)
        assert unread not in conns._slots and making in conns._slots
        pairs[1][1].settimeout(5)
        assert pairs[1][1].recv(4096) == b"x" * 1000 and pairs[1][1].recv(4096) == b"", "not shut down"
        conns.answering(newcomer)  # its answer being made: nothing written yet
        assert not conns.admit(later), "an answer past the bound with nothing untaken was evicted"
    finally:
        for p in pairs:
            for s in p:
                s.close()
