"""A hit is an attach the engine reported done, not a get_state reply that left.

One raw daemon; each row is what an engine does after its get_state was
answered ok, and what the daemon's counters must say afterwards (hits,
attach failures by kind, in progress). Control: the counters the old daemon
kept (a hit per ok reply) are ``served``, and they move for every row alike,
so only the report tells a failed attach from a done one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest
from reliability_support import (
    PYTHON,
    REPO,
    RawDaemon,
    fresh_checkpoint,
    isolated_env,
    promoted_daemon,
)

from preload import protocol
from preload.client import DaemonClient
from preload.daemon.health import metric_families
from preload.daemon.raw import raw_key

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="attach_report")]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RawDaemon]:
    base = tmp_path_factory.mktemp("report")
    with promoted_daemon(fresh_checkpoint(base / "ckpt", seed=5), base / "cache") as d:
        yield d


def _counts(d: RawDaemon) -> dict:
    s = d.stats()
    return {"hits": s["hits"], "served": s["served"], "attaching": s["attaching"], **s["attach_failures"]}


def _settled(d: RawDaemon, want: Callable[[dict], bool], timeout: float = 5.0) -> dict:
    """The counters once ``want`` holds (the daemon counts a close when its thread sees it)."""
    end = time.monotonic() + timeout
    while True:
        c = _counts(d)
        if want(c) or time.monotonic() > end:
            return c
        time.sleep(0.02)


def _attach(d: RawDaemon, then: Callable[[DaemonClient], None]) -> None:
    c = DaemonClient.connect(d.socket_dir, 0, client="report-test")
    try:
        att = c.get_state(raw_key(d.checkpoint, d.digest, "shm")).attach()
        then(c)
        att.close()
    finally:
        c.close()


def _delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after) if after.get(k, 0) != before.get(k, 0)}


# what the engine does after the ok reply -> how the counters move
ROWS: dict[str, tuple[Callable[[DaemonClient], None], dict]] = {
    "reports done": (lambda c: c.report_attach(), {"served": 1, "hits": 1}),
    "reports a failed build": (lambda c: c.report_attach(False, "attach", "daemon tensor x has no module"),
                               {"served": 1, "attach": 1}),
    "reports changed resident weights": (lambda c: c.report_attach(False, "verify", "resident checksum mismatch"),
                                         {"served": 1, "verify": 1}),
    "reports another digest": (lambda c: c.report_attach(False, "digest", "daemon serves another digest"),
                               {"served": 1, "digest": 1}),
    "closes without a report": (lambda c: None, {"served": 1, "closed": 1}),
}


def test_every_attach_failure_kind_has_a_row() -> None:
    kinds = {k for _, want in ROWS.values() for k in want} - {"served", "hits"}
    assert kinds == {*protocol.ATTACH_FAILURE_KINDS, protocol.CLOSED_BEFORE_REPORT}


@pytest.mark.parametrize("row", list(ROWS))
def test_counters_follow_the_engine_report(daemon: RawDaemon, row: str) -> None:
    then, want = ROWS[row]
    before = _counts(daemon)
    _attach(daemon, then)
    after = _settled(daemon, lambda c: _delta(before, c) == want)
    assert _delta(before, after) == want, f"{row}: {before} -> {after}"
    assert after["attaching"] == 0
    # Control: what the daemon counted before reports existed moves alike in every row.
    assert after["served"] - before["served"] == 1


def test_a_failure_is_named_with_who_reported_it(daemon: RawDaemon) -> None:
    _attach(daemon, lambda c: c.report_attach(False, "verify", "resident checksum mismatch on lm_head.weight"))
    last = daemon.stats()["last_attach_failure"]
    assert (last["kind"], last["detail"], last["client"], last["pid"]) == (
        "verify", "resident checksum mismatch on lm_head.weight", "report-test", os.getpid())


def test_in_progress_until_the_report(daemon: RawDaemon) -> None:
    c = DaemonClient.connect(daemon.socket_dir, 0)
    try:
        base = _counts(daemon)
        att = c.get_state(raw_key(daemon.checkpoint, daemon.digest, "shm")).attach()
        assert _counts(daemon)["attaching"] == base["attaching"] + 1
        assert _counts(daemon)["hits"] == base["hits"]  # not a hit yet
        c.report_attach()
        after = _settled(daemon, lambda x: x["hits"] == base["hits"] + 1)
        assert after["attaching"] == base["attaching"] and after["hits"] == base["hits"] + 1
        att.close()
    finally:
        c.close()


def test_an_engine_killed_mid_attach_is_a_closed_failure(daemon: RawDaemon) -> None:
    script = ("import sys, time\nfrom preload.client import DaemonClient\nfrom preload.daemon.raw import raw_key\n"
              "c = DaemonClient.connect(sys.argv[1], 0)\n"
              "a = c.get_state(raw_key(sys.argv[2], sys.argv[3], 'shm')).attach()\n"
              "print('mapped', flush=True)\ntime.sleep(600)\n")
    before = _counts(daemon)
    proc = subprocess.Popen([PYTHON, "-c", script, str(daemon.socket_dir), str(daemon.checkpoint), daemon.digest],
                            stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env=isolated_env(daemon.cache_dir, daemon.socket_root))
    assert proc.stdout is not None and proc.stdout.readline().strip() == "mapped"
    assert _counts(daemon)["attaching"] == before["attaching"] + 1
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    proc.stdout.close()
    after = _settled(daemon, lambda c: c.get("closed", 0) == before.get("closed", 0) + 1)
    assert _delta(before, after) == {"served": 1, "closed": 1}


def test_a_report_of_nothing_closes_the_connection_and_counts_nothing(daemon: RawDaemon) -> None:
    before, bad = _counts(daemon), daemon.stats()["bad_frames"]
    c = DaemonClient.connect(daemon.socket_dir, 0)
    try:
        assert c.report_attach()  # sent; the daemon has nothing on this connection to apply it to
        c.sock.settimeout(5)
        assert c.sock.recv(1) == b""  # closed, not answered (an answer would read as the next reply)
    finally:
        c.close()
    assert _counts(daemon) == before
    assert daemon.stats()["bad_frames"] == bad + 1


def test_metrics_count_attach_failures_by_kind(daemon: RawDaemon) -> None:
    stats = daemon.stats()
    families = {f.name: f for f in metric_families([stats], [str(daemon.socket)])}
    got = {s.labels["kind"]: s.value for s in families["preload_gate_attach_failures"].samples}
    assert got == stats["attach_failures"] and got  # the rows above left some
    [hits] = families["preload_gate_hits"].samples
    assert hits.value == stats["hits"]

