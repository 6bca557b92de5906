"""A daemon too busy to answer is up, everywhere a rank is asked (issue 25).

A daemon whose listen backlog stays full for the connect timeout (more
engines connecting at once than it has accepted yet) is alive: the client
says so with :class:`pgbase.errors.DaemonBusyError`. Every caller that asks a
rank must keep that apart from "nothing answers":

- the health server: ``/health`` answers 200 (a liveness probe that
  restarted a busy daemon would drop the weights engines are mapping) and
  names the busy socket; ``/metrics`` says ``rank_up 1`` and ``rank_busy 1``;
- ``status``: "busy (not stale; do not start another)", not "not answering";
- the engine's rank lookup on CUDA: a busy daemon may be on this GPU, so
  the miss is ``daemon_busy``, not "no daemon serves this GPU".

A daemon is busy two ways: its listen backlog full (a real AF_UNIX listener,
:class:`daemon_support.FullListener`), and a real raw daemon at its
connection cap, which answers a newcomer's first request ``busy`` (it used to
accept and close it: "dropped the connection", read as gone). The control in
each test is the same socket with nothing listening behind it, or the same
daemon once its connections close, which must read as down, or answer.
"""

from __future__ import annotations

import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from daemon_support import (
    Daemon,
    FullListener,
    bind_private,
    fill_backlog,
    short_dir,
    socket_dir_in_own_root,
)
from prometheus_client.parser import text_string_to_metric_families

from pgbase.errors import DaemonBusyError
from preload.daemon import health

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="busy_is_up")]


@pytest.fixture
def sdir() -> Iterator[Path]:
    """A socket dir ``<digest[:16]>`` under a socket root of its own (``status`` scans the root)."""
    yield from socket_dir_in_own_root("pg-busy-", "ab" * 8)


def _dead(sdir: Path) -> Path:
    """The control: a socket file with nothing listening (ECONNREFUSED)."""
    path = sdir / "rank0.sock"
    bind_private(path).close()
    return path


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _probe(sock: Path) -> tuple[int, str, dict[str, float]]:
    """``/health``'s status and body, and ``/metrics``' rank gauges, from a
    real health server on ``sock``; /health answered within a Kubernetes
    probe's default timeoutSeconds (1 s)."""
    server = health.HealthServer("127.0.0.1", 0, [str(sock)])
    server.start()
    try:
        port = server.port
        t0 = time.monotonic()
        code, body = _get(port, "/health")
        assert time.monotonic() - t0 < 1.0, f"/health took {time.monotonic() - t0:.2f} s"
        _, text = _get(port, "/metrics")
    finally:
        server.stop()
    gauges = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name in (health.PREFIX + "rank_up", health.PREFIX + "rank_busy")}
    return code, body, gauges


def test_ask_rank_tells_busy_from_down(sdir: Path) -> None:
    full = FullListener(sdir / "rank0.sock")
    try:
        reply = health.ask_rank(full.path)
    finally:
        full.close()
    assert reply.stats is None and reply.busy and "listen backlog is full" in reply.busy, reply
    assert reply.up
    dead = health.ask_rank(full.path)  # control: the listener is closed, the file stays
    assert dead.stats is dead.busy is dead.refused is None and not dead.up, dead
    assert dead.down and dead.down.startswith(f"no daemon answers at {full.path}"), dead


def test_the_health_server_reports_a_busy_rank_up(sdir: Path) -> None:
    full = FullListener(sdir / "rank0.sock")
    try:
        code, body, gauges = _probe(full.path)
    finally:
        full.close()
    assert code == 200 and body.startswith("ok: busy: ") and str(full.path) in body, (code, body)
    assert gauges == {health.PREFIX + "rank_up": 1.0, health.PREFIX + "rank_busy": 1.0}, gauges


def test_control_the_health_server_reports_a_dead_rank_down(sdir: Path) -> None:
    dead = _dead(sdir)
    code, body, gauges = _probe(dead)
    assert code == 503 and body.startswith(f"down: rank 0 ({dead}): no daemon answers at {dead}"), (code, body)
    assert gauges == {health.PREFIX + "rank_up": 0.0, health.PREFIX + "rank_busy": 0.0}, gauges


def test_status_says_busy_not_stale(sdir: Path) -> None:
    from preload.daemon import status

    full = FullListener(sdir / "rank0.sock")
    try:
        [busy] = status.scan(sdir.parent)
    finally:
        full.close()
    line = status._not_serving(busy)
    assert busy.busy and "is busy" in line and "not stale" in line and "stale socket" not in line, line
    [dead] = status.scan(sdir.parent)  # control: the same socket, nothing listens now
    line = status._not_serving(dead)
    assert dead.busy is None and "is busy" not in line and "stale socket" in line, line


def test_the_engine_rank_lookup_says_busy_not_no_daemon(sdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from preload.hf_attach.ranks import RankMissError, find_rank
    from preload.transports import cuda

    monkeypatch.setattr(cuda, "device_uuid", lambda index: "GPU-00000000-this-engine")
    device = torch.device("cuda", 0)
    full = FullListener(sdir / "rank0.sock")
    try:
        with pytest.raises(DaemonBusyError) as caught:
            find_rank(sdir, device)
    finally:
        full.close()
    assert "busy" in str(caught.value) and "listen backlog is full" in str(caught.value), caught.value
    with pytest.raises(RankMissError) as missed:  # control: nothing listens: no daemon on this GPU
        find_rank(sdir, device)
    assert not isinstance(missed.value, DaemonBusyError) and "no daemon in" in str(missed.value), missed.value


def test_a_daemon_at_its_connection_cap_is_busy_not_gone(tmp_path: Path) -> None:
    import socket

    from fixtures.tiny import write_tiny
    from preload.budget import MAX_CONNECTIONS
    from preload.client import DaemonClient

    root = short_dir("pg-cap-")
    daemon = Daemon(write_tiny(tmp_path / "ckpt"), root, tmp_path / "cache").start()
    held: list[socket.socket] = []
    try:
        sock = daemon.socket_dir / "rank0.sock"
        for _ in range(MAX_CONNECTIONS):  # accepted, silent: each holds a slot until the first-request deadline
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(sock))
            held.append(s)
        time.sleep(1.0)  # the accept loop has taken them all
        t0 = time.monotonic()
        with pytest.raises(DaemonBusyError) as caught:
            DaemonClient.connect(daemon.socket_dir, 0, timeout_s=0.5).close()
        assert "at its cap of" in str(caught.value) and "busy" in str(caught.value), caught.value
        assert time.monotonic() - t0 < 5
        reply = health.ask_rank(sock, 0.5)
        assert reply.up and reply.busy and reply.stats is None, reply
        code, body, gauges = _probe(sock)
        assert code == 200 and body.startswith("ok: busy: "), (code, body)
        assert gauges[health.PREFIX + "rank_busy"] == 1.0, gauges
        for s in held:  # control: slots free again, the same daemon answers
            s.close()
        held.clear()
        deadline = time.monotonic() + 10
        while (answer := health.ask_rank(sock)).stats is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert answer.stats is not None and answer.busy is None, answer
        assert daemon.proc is not None and daemon.proc.poll() is None
    finally:
        for s in held:
            s.close()
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_a_stopped_rank_with_a_full_backlog_is_down_not_busy(tmp_path: Path) -> None:
    """A SIGSTOPped rank accepts nothing: probes pile up in its backlog until
    connects get EAGAIN, the shape of busy. It is down (its lock holder
    cannot run). The control: the same rank continued answers again."""
    import os
    import signal
    import socket

    from fixtures.tiny import write_tiny

    root = short_dir("pg-stop-")
    daemon = Daemon(write_tiny(tmp_path / "ckpt"), root, tmp_path / "cache").start()
    queued: list[socket.socket] = []
    sock = daemon.socket_dir / "rank0.sock"
    try:
        os.kill(daemon.rank_pid, signal.SIGSTOP)
        queued = fill_backlog(sock)
        reply = health.ask_rank(sock, 0.5)
        assert not reply.up and reply.busy is None, reply
        code, body, gauges = _probe(sock)
        assert code == 503 and gauges[health.PREFIX + "rank_up"] == 0.0, (code, gauges)
        assert body == f"down: rank 0 ({sock}): process {daemon.rank_pid}, which holds its lock, is stopped " \
                       "(its listen backlog is full)\n", body
    finally:
        os.kill(daemon.rank_pid, signal.SIGCONT)
        for s in queued:
            s.close()
    deadline = time.monotonic() + 20  # control: running again, it drains its backlog and answers
    while (answer := health.ask_rank(sock)).stats is None and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        assert answer.stats is not None, answer
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
