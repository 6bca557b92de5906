"""Every verb under a tight open-file limit: it works, or it says so in one line.

``ulimit -n N`` then a verb: each run either exits 0, or exits 2 with one
stderr line naming the open-file limit (RLIMIT_NOFILE, ``ulimit -n``), no
traceback, nothing new on disk. N sweeps 5..40: low enough that imports,
pipes, sockets and the launcher's own descriptors run out before a rank's
budget check (:mod:`preload.budget`) can speak, high enough for some verbs
to pass. ``status`` and ``preload --dry-run`` run beside a live daemon (so
they connect to it); ``preload`` starts one (raw stage) and is stopped once
ready.

Controls: the same runs at ``ulimit -n 1024`` exit 0; the checker rejects a
raw EMFILE traceback, a two-line refusal and a one-line refusal that names
no limit, so it tells the bug from the fix.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_support import repo_pythonpath
from reliability_support import RawDaemon, promote_checkpoint, short_tempdir

from fixtures.tiny import write_tiny
from preload.daemon.parent import PARENT_PID_ENV

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="open_file_budget")]

REPO = Path(__file__).resolve().parents[2]
LIMITS = (5, 8, 12, 20)
ENOUGH = 1024
READY_S = 60.0


def _tree(*roots: Path) -> set[str]:
    return {str(p) for root in roots if root.exists() for p in root.rglob("*")}


def judge(rc: int, stdout: str, stderr: str) -> str | None:
    """None when a run under a tight limit behaved: exit 0, or exit 2 with one
    stderr line naming the open-file limit and its fix; else what is wrong."""
    if "Traceback" in stdout + stderr:
        return f"a traceback: {stderr[-1500:]}"
    if rc == 0:
        return None
    if rc != 2:
        return f"exit {rc}: {stderr[-1500:]}"
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    if len(lines) != 1:
        return f"{len(lines)} stderr lines: {stderr[-1500:]}"
    missing = [w for w in ("open-file limit", "RLIMIT_NOFILE", "ulimit -n") if w not in lines[0]]
    if missing:
        return f"the line names no {missing}: {lines[0]}"
    return None


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """A promoted tiny checkpoint, a live raw daemon serving it under
    ``sock``, and an empty socket root ``fresh`` for starts."""
    base = tmp_path_factory.mktemp("nofile")
    # A seed of its own: the digest (and so the socket dir) is no other test's.
    ckpt = write_tiny(base / "ckpt", seed=2511)
    sock, fresh, cache = short_tempdir("pg-nf-"), short_tempdir("pg-nf-"), base / "cache"
    cache.mkdir(mode=0o700)
    promote_checkpoint(ckpt, sock, cache)
    daemon = RawDaemon(ckpt, sock, cache, entry="cli", extra_args=("--no-fd-store",)).start()
    try:
        yield {"ckpt": ckpt, "sock": sock, "fresh": fresh, "cache": cache}
    finally:
        daemon.stop()


def _env(world: dict[str, Path], root: Path) -> dict[str, str]:
    env = dict(os.environ, PRELOAD_GATE_CACHE=str(world["cache"]), PRELOAD_GATE_SOCKET_ROOT=str(root),
               PYTHONPATH=repo_pythonpath())
    env.pop("PRELOAD_GATE_EVENTS", None)
    env[PARENT_PID_ENV] = str(os.getpid())  # --exit-with-parent: a start ends with this test
    return env


def _limited(n: int, argv: list[str]) -> list[str]:
    # bash's ulimit -n sets the soft and the hard limit: nothing can raise it back.
    return ["bash", "-c", f'ulimit -n {n} && exec "$0" "$@"', *argv]


def run_verb(world: dict[str, Path], n: int, verb: str) -> tuple[int, str, str]:
    ckpt = str(world["ckpt"])
    argv = {
        "preload --dry-run": ["preload", ckpt, "--stage", "raw", "--dry-run"],
        "status": ["status"],
        "stop": ["stop", ckpt, "--socket-root", str(world["fresh"])],  # nothing there: a no-op that looks
        "promote": ["promote", ckpt],
    }[verb]
    root = world["fresh"] if verb == "stop" else world["sock"]
    p = subprocess.run(_limited(n, [sys.executable, "-m", "preload_gate", *argv]), capture_output=True,
                       text=True, env=_env(world, root), cwd=REPO, timeout=120)
    return p.returncode, p.stdout, p.stderr


def start_preload(world: dict[str, Path], n: int) -> tuple[int, str, str]:
    """``preload CKPT --stage raw`` under the limit: exit 0 once it printed its
    ready line (then stopped), else its exit status and output."""
    errpath = world["cache"].parent / f"start-{n}-{time.monotonic_ns()}.stderr"
    argv = [sys.executable, "-m", "preload_gate", "preload", str(world["ckpt"]), "--stage", "raw",
            "--no-fd-store", "--exit-with-parent"]
    with open(errpath, "w") as err:
        proc = subprocess.Popen(_limited(n, argv), stdout=subprocess.PIPE, stderr=err, text=True,
                                env=_env(world, world["fresh"]), cwd=REPO)
    assert proc.stdout is not None
    out, end = "", time.monotonic() + READY_S
    while time.monotonic() < end and proc.poll() is None and '"ready"' not in out:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            out += proc.stdout.readline()
    ready = '"ready"' in out
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    out += proc.stdout.read()
    stderr = errpath.read_text()
    if ready:
        return 0, out, "" if "Traceback" not in stderr else stderr
    return proc.returncode, out, stderr


VERBS = ("preload --dry-run", "status", "stop", "preload")


@pytest.mark.parametrize("n", LIMITS)
@pytest.mark.parametrize("verb", VERBS)
def test_a_tight_open_file_limit_is_one_line_or_success(world: dict[str, Path], verb: str, n: int) -> None:
    watched = (world["cache"], world["sock"], world["fresh"])
    before = _tree(*watched)
    rc, out, err = start_preload(world, n) if verb == "preload" else run_verb(world, n, verb)
    problem = judge(rc, out, err)
    assert problem is None, f"ulimit -n {n}; preload-gate {verb}: {problem}"
    if rc == 2:
        assert _tree(*watched) == before, f"new on disk: {sorted(_tree(*watched) - before)}"


def test_promote_at_a_tight_limit_is_one_line_and_writes_no_manifest(world: dict[str, Path]) -> None:
    # Its vLLM import (the file selection) opens many files: 5 runs out there.
    before = _tree(world["cache"])
    rc, out, err = run_verb(world, 5, "promote")
    assert judge(rc, out, err) is None, err[-2000:]
    if rc == 2:
        assert _tree(world["cache"]) == before


@pytest.mark.parametrize("verb", VERBS)
def test_control_every_verb_passes_at_a_sufficient_limit(world: dict[str, Path], verb: str) -> None:
    rc, out, err = start_preload(world, ENOUGH) if verb == "preload" else run_verb(world, ENOUGH, verb)
    assert rc == 0 and "Traceback" not in err, err[-2000:]


RAW_EMFILE = "import os\nwhile True:\n    os.open('/dev/null', os.O_RDONLY)\n"


@pytest.mark.parametrize(("stub", "why"), [
    (RAW_EMFILE, "traceback"),
    ("import sys; print('first\\nsecond: ulimit -n RLIMIT_NOFILE open-file limit', file=sys.stderr); "
     "sys.exit(2)", "stderr lines"),
    ("import sys; print('error: too many open files', file=sys.stderr); sys.exit(2)", "names no"),
])
def test_control_the_checker_rejects_a_raw_emfile_and_vague_lines(stub: str, why: str) -> None:
    p = subprocess.run(_limited(12, [sys.executable, "-c", stub]), capture_output=True, text=True, timeout=60)
    problem = judge(p.returncode, p.stdout, p.stderr)
    assert problem is not None and why in problem, problem


# Where a failure used to be worded as something else, at the limit: each
# call runs once with no descriptor free (it must name the limit: raise
# EMFILE, or answer with the limit) and once with room (its ordinary answer,
# the control). One child, all rows: the limit is the kernel's, not a mock.
WRAPS = r"""
import errno, json, os, resource, sys, tempfile
from pgbase.oscause import file_limit
from preload.daemon.lock import lock_holder
from preload.daemon.registry import start_ticks
from preload.extras import import_for
from preload.identity import answer_files, uring
from preload.identity.filestat import filesystem_type_of_dev
empty = tempfile.mkdtemp()
rows = {
    "filesystem_type": lambda: filesystem_type_of_dev(os.stat(sys.argv[1]).st_dev) or "unknown",
    "answer_files": lambda: ",".join(answer_files.select(sys.argv[1])) or "none",
    "lock_holder": lambda: lock_holder(empty, 0),
    "start_ticks": lambda: start_ticks(os.getpid()),
    "import_for": lambda: import_for("harness.verdict").__name__,
    "uring": lambda: uring.unavailable(),
}
out = {}
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
for name, call in rows.items():
    got = {}
    for phase in ("limit", "room"):
        if phase == "limit":
            limit_to(0, hard_extra=None)
        try:
            value = call()
            got[phase] = {"value": value if value is None or isinstance(value, (str, int)) else repr(value)}
        except Exception as exc:
            got[phase] = {"raised": type(exc).__name__, "errno": getattr(exc, "errno", None),
                          "limit": file_limit(exc) is not None, "text": str(exc)}
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    out[name] = got
report(**out)
"""


@pytest.fixture(scope="module")
def wraps(tiny_ckpt: Path) -> dict:
    from fd_limit_support import PRELUDE, run_child

    got, _ = run_child(PRELUDE + WRAPS, tiny_ckpt)
    return got


def _names_the_limit(result: dict) -> bool:
    return result.get("limit") is True and result.get("errno") in (24, 23)


@pytest.mark.parametrize(("row", "room"), [
    ("lock_holder", None),  # no lock file: free; at the limit, never "free"
    ("start_ticks", "int"),  # our own process: alive; at the limit, never "gone"
    ("import_for", "harness.verdict"),  # at the limit, not "failed to import (reinstall)" nor a missing extra
    ("filesystem_type", "KNOWN"),  # at the limit, not "unknown" (a tmpfs would pass as stat-safe)
    ("answer_files", "ANSWERS"),  # at the limit, not "none" (a key without them names other content)
])
def test_a_call_at_the_limit_names_it_and_answers_with_room(wraps: dict, row: str, room: object) -> None:
    assert _names_the_limit(wraps[row]["limit"]), wraps[row]
    got = wraps[row]["room"]
    assert "raised" not in got, got
    if room in ("ANSWERS", "KNOWN"):
        # the tiny checkpoint has a tokenizer and a generation config, on a mounted filesystem
        assert got["value"] not in ("none", "unknown"), got
        return
    assert (isinstance(got["value"], int) if room == "int" else got["value"] == room), got


def test_io_uring_is_not_given_up_for_good_at_the_limit(wraps: dict) -> None:
    # At the limit the pool serves (a reason comes back); with room again the ring is set up.
    assert wraps["uring"]["limit"].get("value"), wraps["uring"]
    if "Too many open files" not in wraps["uring"]["limit"]["value"]:
        pytest.skip(f"io_uring is refused here for another reason: {wraps['uring']['limit']['value']}")
    assert wraps["uring"]["room"] == {"value": None}, wraps["uring"]


def test_file_limit_finds_the_limit_in_a_chain_and_nothing_else() -> None:
    import errno

    from pgbase.oscause import OPEN_FILES, SYSTEM_FILES, file_limit

    def chained(inner: BaseException) -> BaseException:
        try:
            try:
                raise inner
            except OSError as exc:
                raise RuntimeError("a library's wrapper") from exc
        except RuntimeError as outer:
            return outer

    cause = file_limit(chained(OSError(errno.EMFILE, "Too many open files")))
    assert cause is not None and cause.kind == OPEN_FILES
    assert "RLIMIT_NOFILE" in cause.text and "ulimit -n" in cause.text and "LimitNOFILE=" in cause.text
    system = file_limit(chained(OSError(errno.ENFILE, "Too many open files in system")))
    assert system is not None and system.kind == SYSTEM_FILES
    # Rust's io::Error, as safetensors words a failure it kept.
    assert file_limit(RuntimeError("Too many open files (os error 24)")) is not None
    # A C++ library's strerror with no number (gloo, at vLLM's process-group init in a rank).
    gloo = RuntimeError("[enforce fail at gloo/transport/tcp/loop.cc:48] rv != -1. -1 vs -1. pipe: Too many open files")
    assert (file_limit(gloo) or system).kind == OPEN_FILES
    in_system = file_limit(RuntimeError("socket: Too many open files in system"))
    assert in_system is not None and in_system.kind == SYSTEM_FILES
    # Controls: another errno, no errno, and a cycle end in None.
    assert file_limit(chained(OSError(errno.ENOENT, "No such file or directory"))) is None
    assert file_limit(ValueError("bad header")) is None
    loop = ValueError("a")
    loop.__context__ = ValueError("b")
    loop.__context__.__context__ = loop
    assert file_limit(loop) is None


def _rank_main(monkeypatch: pytest.MonkeyPatch, failure: BaseException) -> tuple[int, dict]:
    """The rank process's main, its serving replaced by ``failure``: its exit
    status and its one announced line."""
    import io
    import json

    from preload.daemon import rank

    def serve(*_: object) -> bool:
        raise failure

    monkeypatch.setattr(rank, "serve_rank", serve)
    monkeypatch.setattr(rank.RankConfig, "from_json", staticmethod(lambda obj: obj))
    monkeypatch.setattr(sys, "stdin", io.StringIO("{}\n"))
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # pytest's own handlers stay
    rc = rank.main()
    return rc, json.loads(out.getvalue().strip().splitlines()[-1])


def test_a_rank_at_the_limit_announces_the_line_without_a_traceback(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import errno

    try:
        try:
            raise OSError(errno.EMFILE, "Too many open files")
        except OSError as exc:
            raise RuntimeError("torch: cannot create the shared-memory file") from exc
    except RuntimeError as wrapped:
        failure = wrapped
    rc, line = _rank_main(monkeypatch, failure)
    assert rc == 2 and line["event"] == "rank_error", line
    assert "open-file limit" in line["error"] and "ulimit -n" in line["error"], line
    assert not [r for r in caplog.records if r.exc_info], "a traceback in the rank's log"


def test_control_a_rank_failing_otherwise_keeps_its_traceback(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    rc, line = _rank_main(monkeypatch, RuntimeError("a bug"))
    assert rc == 2 and line["event"] == "rank_error" and "a bug" in line["error"], line
    assert "open-file limit" not in line["error"]
    assert [r for r in caplog.records if r.exc_info], "a bug's traceback belongs in the log"


@pytest.mark.parametrize("n", (12, 20, 64))
def test_the_dry_run_says_what_the_start_does(world: dict[str, Path], n: int) -> None:
    """Under one limit, ``preload --dry-run`` is refused exactly where the
    start is (the rank's open-file need, checked in the launcher's
    preflight against the limit its ranks inherit), with the same line.
    Before this, 12 gave a plan (exit 0) and a start that failed; 20 and 64
    are the controls where both go ahead."""
    argv = [sys.executable, "-m", "preload_gate", "preload", str(world["ckpt"]), "--stage", "raw", "--dry-run"]
    dry = subprocess.run(_limited(n, argv), capture_output=True, text=True, env=_env(world, world["fresh"]),
                         cwd=REPO, timeout=120)
    rc, out, err = start_preload(world, n)
    assert judge(rc, out, err) is None and judge(dry.returncode, dry.stdout, dry.stderr) is None
    assert (dry.returncode, rc) in ((0, 0), (2, 2)), f"ulimit -n {n}: dry run {dry.returncode}, start {rc}: {err}"
    if rc == 2:
        assert dry.stderr.strip().split(": error: ", 1)[-1] == err.strip().split(": error: ", 1)[-1]
    assert (rc == 2) == (n == 12)
