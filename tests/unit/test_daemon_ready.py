"""``preload.daemon.ready``: the one wait for a daemon process's ready line.

Stand-in processes (``python -c``) print what a rank or a launcher prints,
so each row of behaviour costs a fraction of a second and no checkpoint.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from preload.daemon.ready import RANK_READY, READY, NotReadyError, ReadyLines, wait_ready

pytestmark = pytest.mark.unit

BOUND_S = 120.0  # a deadline no row below should reach; reaching it fails the row


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)


def test_ready_line_after_logs_and_other_events() -> None:
    proc = _child("import json,time\nprint('INFO vllm says hello')\nprint(json.dumps({'event': 'loading'}))\n"
                  "print(json.dumps({'event': 'ready', 'digest': 'ab'}), flush=True)\ntime.sleep(60)")
    other: list[str] = []
    try:
        assert wait_ready(proc, READY, BOUND_S, other.append) == {"event": "ready", "digest": "ab"}
        assert other == ["INFO vllm says hello"]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(("code", "returncode", "error"), [
    ("import sys; print('no json here'); sys.exit(3)", 3, ""),
    ("import json,sys; print(json.dumps({'event': 'rank_error', 'error': 'shard 2 differs'}), flush=True); "
     "sys.exit(2)", None, "shard 2 differs"),
    # the launcher's line is not a rank's: waiting for rank_ready, it is not ready
    ("import json; print(json.dumps({'event': 'ready'}))", 0, ""),
])
def test_not_ready_names_the_exit_or_the_rank_error(code: str, returncode: int | None, error: str) -> None:
    proc = _child(code)
    with pytest.raises(NotReadyError) as info:
        wait_ready(proc, RANK_READY, BOUND_S)
    proc.wait()
    assert not info.value.timed_out and info.value.error == error
    if returncode is not None:
        assert info.value.returncode == returncode


def test_an_exit_is_seen_while_a_grandchild_holds_the_pipe() -> None:
    # Its stdout never reaches EOF (the sleeper inherited it); the exit status
    # must end the wait, not the deadline (that would be timed_out).
    proc = _child("import subprocess,sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']);"
                  " sys.exit(4)")
    with pytest.raises(NotReadyError) as info:
        wait_ready(proc, READY, BOUND_S)
    assert not info.value.timed_out and info.value.returncode == 4


def test_silent_past_the_deadline_is_timed_out() -> None:
    proc = _child("import time; time.sleep(60)")
    try:
        with pytest.raises(NotReadyError) as info:
            wait_ready(proc, READY, 0.5)
        assert info.value.timed_out and info.value.returncode is None
    finally:
        proc.kill()
        proc.wait()


def test_several_ranks_the_failing_one_is_named() -> None:
    ok = _child("import json,time; print(json.dumps({'event': 'rank_ready', 'rank': 0}), flush=True); "
                "time.sleep(60)")
    bad = _child("import sys; sys.exit(5)")
    try:
        with pytest.raises(NotReadyError) as info:
            ReadyLines({0: ok, 1: bad}).wait(RANK_READY, BOUND_S, poll_s=0.1)
        assert info.value.key == 1 and info.value.returncode == 5
    finally:
        ok.kill()
        ok.wait()


def test_on_idle_may_stop_the_wait() -> None:
    class Stop(Exception):
        pass

    def stop() -> None:
        raise Stop

    proc = _child("import time; time.sleep(60)")
    try:
        with pytest.raises(Stop):
            ReadyLines({0: proc}).wait(READY, BOUND_S, on_idle=stop, poll_s=0.1)
    finally:
        proc.kill()
        proc.wait()


CHATTY = ("import json,sys; print(json.dumps({'event': 'ready'}), flush=True); "
          "sys.stdout.write('x' * (1 << 20) + '\\n'); sys.stdout.flush()")


def test_stdout_is_drained_after_ready() -> None:
    # A process that logs to stdout after its ready line must not block on a full pipe.
    proc = _child(CHATTY)
    wait_ready(proc, READY, BOUND_S)
    assert proc.wait(timeout=BOUND_S) == 0


def test_control_a_reader_that_stops_at_the_ready_line_blocks_the_process() -> None:
    proc = _child(CHATTY)
    assert proc.stdout is not None
    proc.stdout.readline()  # the ready line, and no more reading: the pipe (64 KiB) fills
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=3)
    finally:
        proc.kill()
        proc.wait()
