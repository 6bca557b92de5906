"""A daemon the gate starts does not outlive the gate (new-user trial C5).

The gate starts ``preload-gate preload --exit-with-parent`` through
``harness.daemon_process.DaemonProcess``. Killed with SIGKILL, the gate runs
no clean-up at all: the daemon must notice (preload.daemon.parent, the same
check that stops orphaned ranks) and stop, removing its sockets, its lock
files, its socket directory and its registry entry. Told SIGTERM, the gate
unwinds: its engines and daemon stop and its temporary directories go.

Every wait is a generous bound on a poll, not a timing claim.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from daemon_support import REPO, process_gone, repo_pythonpath, short_dir, starter_line, wait_for

from preload.daemon.lock import socket_answers
from preload.promote import promote

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="daemon_raw")]

BOUND_S = 60.0

# A starter that keeps its daemon and then gets killed: the gate, reduced to that.
STARTER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from harness.daemon_process import DaemonProcess
    ckpt, root, log, flag = sys.argv[1:5]
    d = DaemonProcess(ckpt, root, Path(log), ["--stage", "raw"], exit_with_parent=flag == "1").start()
    print(json.dumps(d.ready), flush=True)
    time.sleep(3600)
""")


def _read_line(proc: subprocess.Popen, bound: float = BOUND_S) -> dict:
    return json.loads(starter_line(proc, bound))


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "PRELOAD_GATE_CACHE": str(cache), "PYTHONPATH": repo_pythonpath()}


def _start(ckpt: Path, root: Path, tmp_path: Path, exit_with_parent: bool) -> tuple[subprocess.Popen, dict]:
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(ckpt), str(root), str(tmp_path / "daemon.log"),
         "1" if exit_with_parent else "0"],
        stdout=subprocess.PIPE, text=True, env=_env(tmp_path / "cache"), cwd=REPO)
    return starter, _read_line(starter)


@pytest.fixture
def promoted(tiny_ckpt: Path, tmp_path: Path) -> tuple[Path, Path]:
    root = short_dir()
    promote(tiny_ckpt, socket_root=root, cache_dir=tmp_path / "cache", progress=False)
    return tiny_ckpt, root


def test_daemon_stops_and_cleans_up_when_its_starter_is_killed(promoted, tmp_path: Path) -> None:
    ckpt, root = promoted
    starter, ready = _start(ckpt, root, tmp_path, exit_with_parent=True)
    pids = [int(ready["pid"]), int(ready["ranks"][0]["pid"])]
    sdir = Path(ready["socket_dir"])
    registry = tmp_path / "cache" / "daemons"
    try:
        assert socket_answers(sdir / "rank0.sock")
        assert [p.name for p in registry.iterdir()] == [f"{ready['pid']}.json"]
        starter.kill()  # SIGKILL: the starter runs no clean-up of its own
        starter.wait()
        assert wait_for(lambda: all(process_gone(p) for p in pids), BOUND_S), \
            "the daemon is still running after the process that started it was killed"
        assert wait_for(lambda: not sdir.exists(), BOUND_S), f"{sdir} was left behind: {list(sdir.iterdir())}"
        assert list(registry.iterdir()) == []
    finally:
        for p in pids:
            if not process_gone(p):
                os.kill(p, signal.SIGKILL)


# The bench's own daemon starter (rows daemon_weight_load, daemon_peak_memory).
BENCH_STARTER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from harness.bench.daemon import _Daemon
    ckpt, root = sys.argv[1:3]
    d = _Daemon(Path(ckpt), Path(root), dict(os.environ), "--stage", "raw")
    print(json.dumps(d.ready), flush=True)
    time.sleep(3600)
""")


def test_a_bench_daemon_stops_when_the_bench_is_killed(promoted, tmp_path: Path) -> None:
    """A SIGKILLed ``preload-gate bench`` left its rows' daemons resident
    (started without --exit-with-parent; new-user F7's sibling). The control
    that the kill alone stops nothing is the test below."""
    ckpt, root = promoted
    starter = subprocess.Popen([sys.executable, "-c", BENCH_STARTER, str(ckpt), str(root)], stdout=subprocess.PIPE,
                               text=True, env=_env(tmp_path / "cache"), cwd=REPO)
    ready = _read_line(starter)
    pids = [int(ready["pid"]), int(ready["ranks"][0]["pid"])]
    try:
        starter.kill()
        starter.wait()
        assert wait_for(lambda: all(process_gone(p) for p in pids), BOUND_S), \
            "the bench's daemon is still running after the bench was killed"
        assert wait_for(lambda: not Path(ready["socket_dir"]).exists(), BOUND_S)
    finally:
        for p in pids:
            if not process_gone(p):
                os.kill(p, signal.SIGKILL)


def test_control_a_daemon_without_the_flag_outlives_its_starter(promoted, tmp_path: Path) -> None:
    """Control: the same kill without --exit-with-parent leaves the daemon
    serving, so the test above sees the flag's work and not something else
    (a broken pipe, the starter's process group). It is also the behaviour
    an operator relies on with ``setsid preload-gate preload ... &``."""
    ckpt, root = promoted
    starter, ready = _start(ckpt, root, tmp_path, exit_with_parent=False)
    launcher = int(ready["pid"])
    sdir = Path(ready["socket_dir"])
    try:
        starter.kill()
        starter.wait()
        # Four of the launcher's parent polls; a daemon that stops would stop within one.
        time.sleep(4 * 0.5)
        assert not process_gone(launcher)
        assert socket_answers(sdir / "rank0.sock")
    finally:
        os.kill(launcher, signal.SIGTERM)
        assert wait_for(lambda: process_gone(launcher), BOUND_S)
    # Stopped by SIGTERM, it leaves nothing behind either.
    assert wait_for(lambda: not sdir.exists(), BOUND_S)


# ------------------------------------------------------------------ SIGTERM of the gate

# The real gate (self-test, one case), with a raw-stage daemon and engines
# that never finish (stand-ins for vLLM engines, each with a child process as
# vLLM's engine core is), so that SIGTERM lands while an engine runs.
GATE = textwrap.dedent("""
    import sys
    import harness.engine as E
    import harness.gate as G
    import harness.gate.fingerprints as F
    import harness.gate.schedule as S
    import harness.targets.verified_cache as V
    ckpt, workdir, refs, unwind = sys.argv[1:5]
    F.HEADER_IMPL = "reimpl"

    class RawDaemon(V.DaemonProcess):
        # Not __post_init__: DaemonProcess's dataclass __init__ was generated
        # without one, so a subclass's is never called (the loaded stage, which
        # needs vLLM, ran instead, and the unit tier without vLLM failed here).
        def start(self, *args, **kwargs):
            self.args = [*self.args, "--stage", "raw"]
            return super().start(*args, **kwargs)

    V.DaemonProcess = RawDaemon
    S.run_engine = lambda spec, wd, timeout_s, worker=None: E.run_engine(spec, wd, timeout_s=timeout_s, worker="sleepy_engine")
    if unwind == "1":
        E.unwind_on_signals("gate")
    G.run_gate(G.GateOptions(candidate=ckpt, mutations="identical_copy", workdir=workdir, reference_cache=refs))
""")

SLEEPY_ENGINE = textwrap.dedent("""
    import os, subprocess, sys, time
    from pathlib import Path
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    Path(sys.argv[1]).with_name("pids").write_text(f"{os.getpid()} {child.pid}")
    time.sleep(3600)
""")


def _gate_until_an_engine_runs(tiny_ckpt: Path, tmp_path: Path, unwind: bool) -> tuple[subprocess.Popen, dict]:
    mods, tmp = tmp_path / "mods", short_dir("pg-t-")
    mods.mkdir()
    (mods / "sleepy_engine.py").write_text(SLEEPY_ENGINE)
    env = {**_env(tmp_path / "cache"), "PYTHONPATH": f"{REPO}:{mods}", "TMPDIR": str(tmp)}
    gate = subprocess.Popen([sys.executable, "-c", GATE, str(tiny_ckpt), str(tmp_path / "work"),
                             str(tmp_path / "refs"), "1" if unwind else "0"],
                            stderr=open(tmp_path / "gate.log", "wb"), env=env, cwd=REPO)
    work = tmp_path / "work"
    assert wait_for(lambda: any(work.rglob("pids")) or gate.poll() is not None, 3 * BOUND_S), "no engine started"
    assert gate.poll() is None, (tmp_path / "gate.log").read_text()[-3000:]
    (entry,) = (tmp_path / "cache" / "daemons").iterdir()
    engines = [int(p) for f in work.rglob("pids") for p in f.read_text().split()]
    return gate, {"tmp": tmp, "engines": engines, "daemon": json.loads(entry.read_text())["pid"]}


def test_sigterm_of_the_gate_stops_engines_and_daemon_and_cleans_up(tiny_ckpt: Path, tmp_path: Path) -> None:
    gate, seen = _gate_until_an_engine_runs(tiny_ckpt, tmp_path, unwind=True)
    try:
        gate.send_signal(signal.SIGTERM)
        assert gate.wait(BOUND_S) == 128 + signal.SIGTERM
        assert all(process_gone(p) for p in seen["engines"]), "an engine outlived the gate"
        assert wait_for(lambda: process_gone(seen["daemon"]), BOUND_S), "the daemon outlived the gate"
        # (torch may leave its compile cache in TMPDIR: not the gate's.)
        assert list(seen["tmp"].glob("pg-sock-*")) == [], "the gate's temporary socket root was left behind"
        # The queued engine (the second of two) was never started.
        assert len(list((tmp_path / "work").rglob("pids"))) == 1
        assert "SIGTERM: stopping its engines and daemon" in (tmp_path / "gate.log").read_text()
    finally:
        gate.kill()
        for p in [*seen["engines"], seen["daemon"]]:
            if not process_gone(p):
                os.kill(p, signal.SIGKILL)


def test_control_sigterm_without_unwinding_leaves_the_engines(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Control: without unwind_on_signals a SIGTERM ends the gate on the spot
    and its engines (own sessions) run on: what the test above catches."""
    gate, seen = _gate_until_an_engine_runs(tiny_ckpt, tmp_path, unwind=False)
    try:
        gate.send_signal(signal.SIGTERM)
        assert gate.wait(BOUND_S) == -signal.SIGTERM
        assert not any(process_gone(p) for p in seen["engines"])
        assert list(seen["tmp"].glob("pg-sock-*")) != []
        # The daemon still stops: it watches its parent (the first test of this file).
        assert wait_for(lambda: process_gone(seen["daemon"]), BOUND_S)
    finally:
        for p in seen["engines"]:
            if not process_gone(p):
                os.kill(p, signal.SIGKILL)


# ------------------------------------------------------------------ SIGKILL of the gate: its engines

ENGINE_STARTER = textwrap.dedent("""
    import sys
    from harness.engine import EngineSpec, run_engine
    ckpt, wd, worker = sys.argv[1:4]
    run_engine(EngineSpec(checkpoint=ckpt), wd, timeout_s=3600, worker=worker)
""")


def _worker_pids(marker: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker in (d / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


@pytest.mark.parametrize("worker", ["harness.engine_worker", "sleepy_engine"])
def test_engines_end_when_the_gate_is_killed(tiny_ckpt: Path, tmp_path: Path, worker: str) -> None:
    """The real engine worker ends (its whole group) once its harness is
    SIGKILLed, even while it is still importing vLLM. Control: a worker
    without that watch (``sleepy_engine``) runs on."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "sleepy_engine.py").write_text(SLEEPY_ENGINE)
    wd = tmp_path / "engine"
    starter = subprocess.Popen([sys.executable, "-c", ENGINE_STARTER, str(tiny_ckpt), str(wd), worker],
                               env={**_env(tmp_path / "cache"), "PYTHONPATH": f"{REPO}:{mods}"}, cwd=REPO)
    marker = str(wd / "spec.json")
    assert wait_for(lambda: _worker_pids(marker) != [], BOUND_S), "the engine worker did not start"
    pids = _worker_pids(marker)
    try:
        starter.kill()
        starter.wait()
        if worker == "harness.engine_worker":
            assert wait_for(lambda: all(process_gone(p) for p in pids), BOUND_S), "the engine outlived the gate"
        else:
            time.sleep(4 * 0.5)  # as long as the real worker's watch needs four times over
            assert not any(process_gone(p) for p in pids)
    finally:
        for p in pids:
            if not process_gone(p):
                os.killpg(p, signal.SIGKILL)
