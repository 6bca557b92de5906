"""``status``'s "start a daemon as this one was" command works from anywhere, now.

The command is the launcher's argv reparsed with the ``preload`` verb's own
parser (:func:`preload.daemon.cli.register`) and written back from what it
parsed: every path absolute against the launcher's cwd (a relative one names
another place from the operator's shell), and a port the command binds that
this daemon still holds makes the fix stop this one first (the new daemon
would refuse it). The launcher here is a stand-in process whose command line
and cwd are the real thing's (``python -c CODE preload ...``): status reads
nothing else of it. Each case has its control: the same argv given absolute,
the same port not held.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from daemon_support import REPO, wait_for

from preload.daemon import cli, status_fix
from preload.daemon.status import DaemonRecord

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="status_command")]

# Listens on $PORT when set, then waits for its stdin to close.
STAND_IN = ("import os, socket, sys\n"
            "s = socket.socket()\n"
            "port = os.environ.get('PORT')\n"
            "if port:\n"
            "    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "    s.bind(('127.0.0.1', int(port))); s.listen(1)\n"
            "print('up', flush=True)\n"
            "sys.stdin.read()\n")


@contextmanager
def launcher(argv: list[str], cwd: Path, port: int | None = None) -> Iterator[int]:
    """A process whose command line is ``python -c STAND_IN preload ARGV``, run in ``cwd``."""
    env = {**os.environ, **({"PORT": str(port)} if port else {})}
    env.pop("PORT", None) if port is None else None
    proc = subprocess.Popen([sys.executable, "-c", STAND_IN, "preload", *argv], cwd=cwd, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        yield proc.pid
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tree(tmp: Path) -> Path:
    work = tmp / "work"
    for d in ("ckpt", "sock", "cache"):
        (work / d).mkdir(parents=True)
    return work


def _record(work: Path, pid: int) -> DaemonRecord:
    return DaemonRecord(socket=f"{work}/sock/{'ab' * 8}/rank0.sock", socket_root=str(work / "sock"), serving=True,
                        pid=pid + 1, rank=0, digest="ab" * 32, checkpoint=str(work / "ckpt"),
                        cache_dir=str(work / "cache"), launcher_pid=pid, stage="raw", transport="shm")


def _scanned(rec: DaemonRecord) -> DaemonRecord:
    """What ``scan`` sets from the launcher."""
    rec.command, rec.ports_held = status_fix.launcher_command(rec)
    return rec


def _parse(command: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    return parser.parse_args(shlex.split(command)[1:])


@pytest.mark.parametrize("given", ["relative", "control: absolute"])
def test_paths_are_absolute_against_the_launchers_cwd(tmp_path: Path, given: str) -> None:
    work = _tree(tmp_path)
    where = "" if given == "relative" else f"{work}/"
    argv = [f"{where}ckpt", "--socket-root", f"{where}sock", "--cache-dir", f"{where}cache", "-tp", "1",
            "--stage", "raw"]
    assert Path.cwd() != work  # status runs elsewhere than the launcher did
    with launcher(argv, work) as pid:
        rec = _scanned(_record(work, pid))
    assert rec.command == (f"preload-gate preload {work}/ckpt --socket-root {work}/sock --cache-dir {work}/cache "
                           "--stage raw"), rec.command
    # The verb's own parser reads it back to the daemon's settings, from any directory.
    args = _parse(rec.command)
    assert (args.checkpoint, args.socket_root, args.cache_dir, args.stage) == (
        f"{work}/ckpt", f"{work}/sock", f"{work}/cache", "raw")
    assert rec.ports_held == []


def test_flags_keep_their_values_and_take_over_is_not_repeated(tmp_path: Path) -> None:
    """``-tp 2`` is written as the parser's long flag; ``--take-over`` is what
    this one did to its predecessor, not what the next daemon must do, and
    ``--exit-with-parent`` would end a daemon started by hand with its shell."""
    work = _tree(tmp_path)
    argv = [str(work / "ckpt"), "-tp", "2", "--take-over", "--exit-with-parent", "--dtype", "bfloat16", "--no-fd-store"]
    with launcher(argv, work) as pid:
        rec = _scanned(_record(work, pid))
    assert rec.command is not None and "--take-over" not in rec.command, rec.command
    assert "--exit-with-parent" not in rec.command, rec.command
    args = _parse(rec.command)
    assert (args.tensor_parallel_size, args.dtype, args.no_fd_store, args.take_over) == (2, "bfloat16", True, False)


@pytest.mark.parametrize("flag", ["--health-port", "--master-port"])
@pytest.mark.parametrize("held", [True, False], ids=["held", "control: free"])
def test_a_port_this_one_holds_makes_the_fix_stop_it_first(tmp_path: Path, flag: str, held: bool) -> None:
    work = _tree(tmp_path)
    port = _free_port()
    with launcher([str(work / "ckpt"), flag, str(port), "--stage", "raw"], work, port if held else None) as pid:
        rec = _scanned(_record(work, pid))
        fixes = status_fix.fixes_for(rec)
    assert rec.command is not None and f"{flag} {port}" in rec.command, rec.command
    stop = f"stop this one (kill {pid})"
    if held:
        assert rec.ports_held == [f"{flag} {port}"]
        assert fixes.start_new.startswith(f"{stop} first (it holds {flag} {port}, which the new daemon binds), "
                                          f"then start a daemon for it (as this one was: {rec.command})"), fixes
        assert f"{stop} first" in fixes.promote, fixes.promote
    else:
        assert rec.ports_held == []
        assert fixes.start_new == f"start a daemon for it (as this one was: {rec.command}) and {stop}", fixes


def test_an_argv_the_parser_refuses_gives_no_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A launcher of another release (a flag this one lacks): no command, no
    usage text, no exit; the fix says "with this one's settings"."""
    work = _tree(tmp_path)
    with launcher([str(work / "ckpt"), "--flag-of-a-later-release"], work) as pid:
        rec = _scanned(_record(work, pid))
    assert (rec.command, rec.ports_held) == (None, [])
    assert capsys.readouterr().err == ""
    assert "start a daemon for it (with this one's settings)" in status_fix.fixes_for(rec).start_new


def test_stand_in_listens_only_when_asked() -> None:
    """The control's premise: without PORT the stand-in binds nothing."""
    port = _free_port()
    with launcher(["x"], REPO):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0
    with launcher(["x"], REPO, port):
        assert wait_for(lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0, 5)


@pytest.mark.parametrize("read_only", [True, False], ids=["read-only cache", "control: writable"])
def test_a_read_only_cache_moves_the_fix_to_a_writable_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           read_only: bool) -> None:
    """The fix promotes into a writable cache when the daemon's own is
    read-only (a model store mounted ro): the new daemon must then read that
    cache, or its start refuses the read-only cache's stale manifest and the
    fix loops; and it restarts whatever digest the promote prints (this one
    judges its own stale manifest forever)."""
    from reliability_support import mount_tmpfs, skip_privileged

    work = _tree(tmp_path)
    writable = tmp_path / "mine"
    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(writable))
    if read_only:
        why = mount_tmpfs(work / "cache")
        if why is not None:
            skip_privileged(why)
        subprocess.run(["mount", "-o", "remount,ro", str(work / "cache")], check=True)
    try:
        with launcher([str(work / "ckpt"), "--cache-dir", str(work / "cache"), "--stage", "raw"], work) as pid:
            rec = _scanned(_record(work, pid))
            fixes = status_fix.fixes_for(rec)
    finally:
        if read_only:
            subprocess.run(["umount", "-l", str(work / "cache")], check=False)
    assert rec.command is not None and _parse(rec.command).cache_dir == str(work / "cache"), rec.command
    writable.mkdir()  # the fix's promote makes it before the start runs
    # The start command the promote fix gives (after "...: preload-gate preload ", before ") and stop").
    start = fixes.promote.split(": preload-gate preload ", 1)[1].split(") and stop")[0]
    args = _parse("preload-gate preload " + start)
    if read_only:
        assert args.cache_dir == str(writable), fixes.promote
        assert f"--cache-dir {writable}" in fixes.promote and "read-only" in fixes.promote, fixes.promote
        assert "; then start a daemon for it" in fixes.promote and "if it prints a digest" not in fixes.promote
    else:
        assert args.cache_dir == str(work / "cache"), fixes.promote
        assert "if it prints a digest other than" in fixes.promote, fixes.promote
    # A restart without a promote (config.json edited) keeps the daemon's own cache: its manifest is fresh.
    assert f"start it again (as this one was: {rec.command})" in fixes.restart, fixes.restart
