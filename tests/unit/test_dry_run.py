"""``preload --dry-run`` beside a daemon that already holds a planned rank.

A dry run asks what a start would do. A TP=1 daemon on rank 0 does not make
a TP=2 plan wrong; it makes a start refuse. So the dry run prints the plan
with the holder of each held rank (pid, TP, stage, since when) and says that
a start would refuse, exit 0; the start itself still refuses (control;
what a start refuses for any other reason the dry run refuses too:
test_cli_bad_input.py). A dead
holder (kill -9: the socket file stays, the lock is free) holds nothing.

Raw stage, no vLLM: seconds.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from reliability_support import (
    RawDaemon,
    cli,
    fresh_checkpoint,
    isolated_env,
    promote_checkpoint,
    short_tempdir,
)

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="reliability_faults")]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, Path, str]]:
    """(checkpoint, socket root, cache dir, digest), promoted."""
    ckpt = fresh_checkpoint(tmp_path_factory.mktemp("dry") / "ckpt", seed=9)
    sockets, cache = short_tempdir(), tmp_path_factory.mktemp("dry-cache")
    digest = promote_checkpoint(ckpt, sockets, cache)
    yield ckpt, sockets, cache, digest
    shutil.rmtree(sockets, ignore_errors=True)


def _dry(world: tuple[Path, Path, Path, str], *args: str, root: Path | None = None) -> tuple[int, str, str]:
    ckpt, sockets, cache, _ = world
    root = root or sockets
    p = cli("preload", str(ckpt), "--stage", "raw", "--socket-root", str(root), "--dry-run", *args,
            env=isolated_env(cache, root))
    return p.returncode, p.stdout, p.stderr


def test_a_held_rank_is_reported_beside_the_plan(world: tuple[Path, Path, Path, str]) -> None:
    ckpt, sockets, cache, digest = world
    daemon = RawDaemon(ckpt, sockets, cache).start()
    try:
        before = daemon.hello()
        pid = daemon.serving_pid
        rc, out, err = _dry(world, "-tp", "2", "--json")
        assert rc == 0, err
        plan = json.loads(out)
        assert [r["global_rank"] for r in plan["ranks"]] == [0, 1]
        assert [(h["global_rank"], h["pid"], h["tp_size"], h["stage"], h["digest"]) for h in plan["held"]] == \
            [(0, pid, 1, "raw", digest)]
        assert plan["held"][0]["since"] and plan["held"][0]["checkpoint"] == str(ckpt.resolve())
        rc, out, err = _dry(world, "-tp", "2")
        assert rc == 0 and "Traceback" not in err, err
        lines = out.splitlines()
        assert f"held by pid {pid} (TP=1 PP=1, stage raw" in next(ln for ln in lines if "global 0" in ln)
        assert "held" not in next(ln for ln in lines if "global 1" in ln)
        assert lines[-1].startswith(f"a start now would refuse: rank 0 of {daemon.socket_dir} is served by "
                                    f"pid {pid}; stop that daemon first")
        # Control: the start itself still refuses, naming the holder; the daemon serves on.
        start = cli("preload", str(ckpt), "--stage", "raw", "--socket-root", str(sockets),
                    env=isolated_env(cache, sockets))
        assert start.returncode != 0 and f"another daemon (pid {pid}) already serves rank 0" in start.stderr
        assert daemon.hello()["daemon_id"] == before["daemon_id"]
    finally:
        daemon.stop()


def test_control_nothing_held_when_free_or_the_holder_is_dead(world: tuple[Path, Path, Path, str]) -> None:
    ckpt, sockets, cache, _ = world
    rc, out, err = _dry(world, "--json", root=short_tempdir())  # no daemon under this root
    assert rc == 0 and json.loads(out)["held"] == [], err
    dead = RawDaemon(ckpt, sockets, cache).start()  # the rank process itself
    dead.kill()
    assert dead.socket.is_socket(), "a kill -9 leaves the socket file behind"
    rc, out, err = _dry(world, "--json")
    assert rc == 0 and json.loads(out)["held"] == [], err
    rc, out, _ = _dry(world)
    assert "held" not in out and "would refuse" not in out
