"""``status`` shows each serving rank's origin, generation and took_over_from
(issue 39; docs/daemon.md said so, the record dropped them). The control
puts the old rule back (no origin line): the check fails on it."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from preload.daemon import status, status_text
from preload.daemon.status import DaemonRecord, StatusReport

pytestmark = pytest.mark.unit

D = "cd" * 32


def _record(stats: dict) -> DaemonRecord:
    # As status.scan builds it: the rank's stats answer, converted.
    return msgspec.convert({**stats, "socket": "/r/x/rank0.sock", "socket_root": "/r", "serving": True}, DaemonRecord)


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control_old_rule"])
def test_origin_generation_and_took_over_from_are_shown(monkeypatch, fixed: bool) -> None:
    if not fixed:
        real = status._serving
        monkeypatch.setattr(status, "_serving", lambda r, root: [x for x in real(r, root)
                                                                  if not x.startswith("    origin")])
    r = _record({"pid": 9, "rank": 0, "digest": D, "origin": "adopted", "generation": 2,
                 "took_over_from": {"pid": 7, "daemon_id": "d-7"}})
    lines = status.render(StatusReport("/r", ["/r"], "x", [r], [], []), Path("/r"))
    want = "    origin   adopted, generation 2, took over from pid 7 (daemon d-7)"
    assert (want in lines) is fixed, lines
    assert (r.origin, r.generation, r.took_over_from) == ("adopted", 2, {"pid": 7, "daemon_id": "d-7"})


def test_a_daemon_of_an_older_release_says_so() -> None:
    assert status_text.origin_line(None, 0, None) == "origin   unknown (a daemon of an older release), generation 0"
    assert status_text.origin_line("disk", 0, None) == "origin   disk, generation 0"
