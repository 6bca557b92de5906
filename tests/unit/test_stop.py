"""``preload-gate stop``: bad input, and stop + drop against a fake fd store (issue 26).

The daemons are stand-ins found through a patched ``status.scan`` (real
processes: a "launcher" whose command line holds ``preload`` and that stops
its "rank" child on SIGTERM, as the launcher does); the store is a fake
:class:`~preload.daemon.fdstore.FdStore` put where ``open_store`` is. The
end-to-end test with real daemons and the keeper is the lead's.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from preload.daemon import fdstore, status
from preload.daemon.fdstore import FdStore, StoredArena
from preload.daemon.status import DaemonRecord
from preload_gate.cli import main

pytestmark = pytest.mark.unit

A = hashlib.sha256(b"a").hexdigest()
B = hashlib.sha256(b"b").hexdigest()

LAUNCHER = """
import signal, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "preload.daemon.rank"])
print(rank.pid, flush=True)
def stop(*_):
    rank.terminate(); rank.wait(); sys.exit(0)
signal.signal(signal.SIGTERM, stop)
time.sleep(120)
"""


class FakeStore(FdStore):
    name = "keeper"

    def __init__(self, arenas: list[dict[str, Any]]) -> None:
        self.arenas = arenas
        self.drops: list[tuple[str | None, int | None]] = []
        self.closed = False

    def deposit(self, record: Any, fds: list[int]) -> None:
        raise AssertionError("stop deposits nothing")

    def fetch(self, digest: str, global_rank: int) -> StoredArena | None:
        return None

    def release(self, digest: str, global_rank: int) -> None:
        raise AssertionError("stop releases nothing: it drops")

    def drop(
        self, digest: str | None = None, global_rank: int | None = None
    ) -> list[dict[str, Any]]:
        self.drops.append((digest, global_rank))
        out = [a for a in self.arenas if digest is None or a["digest"] == digest]
        self.arenas = [a for a in self.arenas if a not in out]
        return out

    def list(self) -> list[dict[str, Any]]:
        return list(self.arenas)

    def close(self) -> None:
        self.closed = True


def _arena(digest: str, rank: int, checkpoint: str, held: bool = False) -> dict[str, Any]:
    return {
        "digest": digest,
        "rank": rank,
        "stage": "loaded",
        "transport": "shm",
        "bytes": 4096 * (rank + 1),
        "tensors": 3,
        "daemon_id": "d",
        "pid": 1234,
        "deposited_at": time.time(),
        "origin": "disk",
        "generation": 0,
        "checkpoint": checkpoint,
        "held": held,
    }


class Daemon:
    """A stand-in launcher with one rank child."""

    def __init__(self, argv_mark: str = "preload") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, argv_mark], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.rank_pid = int(self.proc.stdout.readline())

    def record(self, digest: str, checkpoint: str, root: Path) -> DaemonRecord:
        return DaemonRecord(
            socket=str(root / digest[:16] / "rank0.sock"),
            socket_root=str(root),
            serving=True,
            pid=self.rank_pid,
            rank=0,
            digest=digest,
            checkpoint=checkpoint,
            launcher_pid=self.proc.pid,
            resident_bytes=4096,
            uptime_s=0.0,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    ckpt_a, ckpt_b = tmp_path / "ckpt-a", tmp_path / "ckpt-b"
    ckpt_a.mkdir()
    ckpt_b.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(tmp_path / "cache"))
    da, db = Daemon(), Daemon()
    records = [da.record(A, str(ckpt_a), root), db.record(B, str(ckpt_b), root)]
    monkeypatch.setattr(
        status, "scan", lambda r: [x for x in records if Path(x.socket_root) == Path(r)]
    )
    store = FakeStore(
        [_arena(A, 0, str(ckpt_a), held=True), _arena(A, 1, str(ckpt_a)), _arena(B, 0, str(ckpt_b))]
    )
    asked: list[tuple[str | None, bool]] = []

    def open_store(socket_root: str | None, start: bool = True) -> FdStore | None:
        asked.append((socket_root, start))
        return store

    monkeypatch.setattr(fdstore, "open_store", open_store)
    yield {
        "a": da,
        "b": db,
        "store": store,
        "root": root,
        "ckpt_a": ckpt_a,
        "ckpt_b": ckpt_b,
        "asked": asked,
        "records": records,
    }
    da.close()
    db.close()


@pytest.mark.parametrize("how", ["digest", "prefix", "checkpoint"])
def test_stop_stops_that_digests_daemons_and_drops_its_arenas(
    world: dict, how: str, capsys
) -> None:
    target = {"digest": A, "prefix": A[:16], "checkpoint": str(world["ckpt_a"])}[how]
    rc = main(["stop", target, "--socket-root", str(world["root"]), "--timeout", "10"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert not world["a"].alive() and not psutil.pid_exists(world["a"].rank_pid)
    assert world["b"].alive()  # the neighbour: another digest keeps serving
    assert world["asked"] == [(str(world["root"]), False)]  # never starts a keeper
    assert world["store"].drops == [(A, None)] and [a["digest"] for a in world["store"].arenas] == [
        B
    ]
    assert world["store"].closed
    assert (
        f"stopped {A[:16]} rank 0 pid {world['a'].rank_pid} (via its launcher, pid {world['a'].proc.pid})"
        in out
    )
    assert f"dropped {A[:16]} rank 0 loaded/shm 4096 bytes (held, disk gen 0)" in out
    assert f"dropped {A[:16]} rank 1 loaded/shm 8192 bytes (orphan" in out
    assert "1 rank(s) stopped, 2 arena(s) dropped (12288 bytes)" in out


def test_stop_all_drops_everything_and_reports_json(world: dict, capsys) -> None:
    rc = main(["stop", "--all", "--socket-root", str(world["root"]), "--timeout", "10", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert not world["a"].alive() and not world["b"].alive()
    assert world["store"].drops == [(None, None)] and world["store"].arenas == []
    assert report["format"] == "preload-gate-stop/1" and report["store"] == "keeper"
    assert sorted(s["digest"] for s in report["stopped"]) == sorted([A, B]) and all(
        s["stopped"] for s in report["stopped"]
    )
    assert len(report["dropped"]) == 3


def test_an_orphan_without_a_daemon_is_still_dropped(world: dict, capsys) -> None:
    world["records"].clear()  # nothing serves; the store still holds A
    rc = main(["stop", A, "--socket-root", str(world["root"])])
    out = capsys.readouterr().out
    assert rc == 0 and world["store"].drops == [(A, None)]
    assert "0 rank(s) stopped, 2 arena(s) dropped" in out


def test_no_store_and_no_daemon_is_nothing_to_stop(
    world: dict, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setattr(fdstore, "open_store", lambda root, start=True: None)
    world["records"].clear()
    rc = main(["stop", A, "--socket-root", str(world["root"])])
    out = capsys.readouterr().out
    assert rc == 0
    assert (
        f"nothing to stop for {A}: no daemon of it serves under {world['root']} and no fd store runs"
        in out
    )


def test_a_process_that_is_not_ours_is_not_signalled(
    world: dict, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    # Control: the launcher's and the rank's command lines lack our marks (a reused pid, say).
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        rec = world["records"][0]
        world["records"][0] = DaemonRecord(
            **{
                **{f: getattr(rec, f) for f in rec.__struct_fields__},
                "pid": other.pid,
                "launcher_pid": other.pid,
            }
        )
        rc = main(["stop", A, "--socket-root", str(world["root"]), "--timeout", "5"])
        out = capsys.readouterr().out
        assert rc == 1
        assert other.poll() is None  # not signalled
        assert (
            f"not stopped: {A[:16]} rank 0 pid {other.pid}: pid {other.pid} is not a preload-gate daemon"
            in out
        )
    finally:
        other.terminate()
        other.wait(30)


def _run(argv: list[str]) -> int:
    """``main``'s exit code, argparse's own (SystemExit) included."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["stop"], "name what to stop"),
        (["stop", A, "--all"], "not both"),
        (["stop", "nope"], "neither a checkpoint directory nor a digest"),
        (["stop", "abcdef"], "neither a checkpoint directory nor a digest"),  # under 16 hex
        (["stop", "--all", "--timeout", "0"], "--timeout"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv: list[str], says: str, capsys) -> None:
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


def test_a_file_is_not_a_checkpoint(tmp_path: Path, capsys) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    assert _run(["stop", str(f)]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_a_socket_root_that_is_a_file_is_refused(tmp_path: Path, capsys) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    assert _run(["stop", A, "--socket-root", str(f)]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_an_ambiguous_prefix_is_refused(world: dict, capsys) -> None:
    world["records"].clear()
    c = A[:16] + "0" * 48
    world["store"].arenas.append(_arena(c, 0, "/elsewhere"))
    assert main(["stop", A[:16], "--socket-root", str(world["root"])]) == 2
    err = capsys.readouterr().err
    assert "names 2 digests" in err and err.count("\n") == 1
    assert world["store"].drops == []  # nothing dropped on a refusal


@pytest.mark.parametrize("typed", ["absolute", "relative"])
def test_a_renamed_folder_is_stopped_by_the_path_status_shows(
    world: dict, typed: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """The folder a live daemon serves was renamed: the path status shows (the
    recorded checkpoint) still names the daemon (was: "'ckpt-a' is neither a
    checkpoint directory nor a digest", exit 2)."""
    recorded = world["ckpt_a"]
    recorded.rename(recorded.with_name("ckpt-a-moved"))
    monkeypatch.chdir(recorded.parent)
    target = str(recorded) if typed == "absolute" else "./x/../ckpt-a"  # normalized as status shows it
    rc = main(["stop", target, "--socket-root", str(world["root"]), "--timeout", "10"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert not world["a"].alive() and world["b"].alive()
    assert world["store"].drops == [(A, None)]
    assert f"stopped {A[:16]} rank 0 pid {world['a'].rank_pid}" in out


def test_control_a_gone_path_no_daemon_recorded_is_refused_with_what_to_run(world: dict, capsys) -> None:
    """Control: a path that is not there and that no daemon or stored arena
    recorded is still refused, before anything is signalled or dropped, and
    says where to look."""
    gone = world["root"].parent / "never-served"
    assert _run(["stop", str(gone), "--socket-root", str(world["root"])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is neither a checkpoint directory nor a digest" in err, err
    assert f"no daemon's recorded checkpoint is {gone}" in err
    assert "run preload-gate status to see each daemon's digest and checkpoint" in err
    assert world["a"].alive() and world["b"].alive() and world["store"].drops == []


def test_stop_all_says_what_it_will_stop_before_it_stops(world: dict, monkeypatch, capsys) -> None:
    """Issue 39: a destructive verb says what it does first (stderr; --json stays one document),
    and the line is said while every daemon still serves."""
    from preload.daemon import stop as stop_mod

    seen: list[tuple[str, bool, bool]] = []
    real = stop_mod.plan_line

    def plan_line(*a: Any) -> str:
        line = real(*a)
        seen.append((line, world["a"].alive(), world["b"].alive()))
        return line

    monkeypatch.setattr(stop_mod, "plan_line", plan_line)
    rc = main(["stop", "--all", "--socket-root", str(world["root"]), "--timeout", "10", "--json"])
    cap = capsys.readouterr()
    assert rc == 0
    json.loads(cap.out)  # stdout is still one JSON document
    assert seen and seen[0][1] and seen[0][2]  # said before anything was signalled
    named = ", ".join(sorted([A[:16], B[:16]]))
    assert cap.err.splitlines()[0] == (
        f"stop --all: stopping 2 daemon rank(s) and taking 3 stored arena(s) (16384 bytes) out of the fd store "
        f"under {world['root']}, digests: {named}; 0 stale socket(s) to remove")


def test_control_a_named_target_is_not_announced(world: dict, capsys) -> None:
    """The neighbour: stopping one digest stops it without the --all line."""
    assert main(["stop", A, "--socket-root", str(world["root"]), "--timeout", "10"]) == 0
    assert "stop --all" not in capsys.readouterr().err
