"""Bad checkpoints on the daemon side: ``preload-gate preload`` on a shard
that lies about itself exits non-zero with one line naming the shard and the
problem; no daemon serves, no socket is created, no manifest is written or
changed.

The corruptions are the rows of ``reliability_support.BAD_CHECKPOINTS``
(truncated shard and header, header length beyond the file, overlapping and
out-of-range offsets, non-UTF-8 and non-JSON headers, dtype/shape not
matching the byte range). Every row runs through the rank's serve path
in-process, with no manifest (the daemon would serve what the bytes hash
to) and after a promotion of the good checkpoint (the daemon is asked to
prove a digest and takes its rank lock first); three rows also run through
the shipped ``preload-gate preload`` command.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from reliability_support import (
    BAD_CHECKPOINTS,
    BAD_SHARD,
    BadCheckpoint,
    cli,
    fresh_checkpoint,
    isolated_env,
    promote_checkpoint,
    short_tempdir,
)

from pgbase.errors import PreloadGateError
from preload.identity.manifest import manifest_path

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="reliability_badckpt")]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir()) if root.exists() else []


def _preload(ckpt: Path, sockets: Path, cache: Path) -> tuple[int, str, str]:
    proc = cli("preload", str(ckpt), "--stage", "raw", "--socket-root", str(sockets),
               env=isolated_env(cache, sockets), timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def _assert_refused(rc: int, out: str, err: str, bad: BadCheckpoint) -> None:
    assert rc != 0, f"{bad.name}: the daemon started on a bad checkpoint"
    assert '"ready"' not in out, out
    assert "Traceback" not in err, err
    errors = [ln for ln in err.splitlines() if ln.startswith("preload-gate preload: error:")]
    assert len(errors) == 1, f"{bad.name}: want one error line, got:\n{err}"
    assert BAD_SHARD in errors[0] and re.search(bad.problem, errors[0]), f"{bad.name}: {errors[0]}"


def _serve_rank(ckpt: Path, sockets: Path, expected_digest: str | None) -> str:
    """The rank process's own entry, in-process: it must raise before serving."""
    import threading

    from preload.daemon.rank import serve_rank
    from preload.daemon.stage import RankConfig

    cfg = RankConfig(checkpoint=str(ckpt), stage="raw", socket_root=str(sockets), expected_digest=expected_digest)
    announced: list[dict] = []
    with pytest.raises(PreloadGateError) as info:
        serve_rank(cfg, threading.Event(), announced.append)
    assert announced == [], "a rank announced ready on a bad checkpoint"
    return str(info.value)


@pytest.mark.parametrize("bad", BAD_CHECKPOINTS, ids=lambda b: b.name)
def test_bad_checkpoint_rank_refuses(bad: BadCheckpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row, through the rank's serve path (no manifest: it would serve
    whatever the bytes hash to)."""
    ckpt = fresh_checkpoint(tmp_path / "ckpt", seed=11)
    shard = ckpt / BAD_SHARD
    shard.write_bytes(bad.corrupt(shard.read_bytes()))
    sockets, cache = short_tempdir(), tmp_path / "cache"
    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(cache))
    try:
        err = _serve_rank(ckpt, sockets, None)
        assert BAD_SHARD in err and re.search(bad.problem, err), f"{bad.name}: {err}"
        assert not list(sockets.rglob("*.sock")), "a socket was created for a bad checkpoint"
        assert _files(cache) == [], f"files written for a bad checkpoint: {_files(cache)}"
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


@pytest.mark.parametrize("bad", BAD_CHECKPOINTS, ids=lambda b: b.name)
def test_bad_checkpoint_rank_refuses_after_promotion(
    bad: BadCheckpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Promoted while good, corrupted after: the rank takes its lock, refuses,
    lets the lock go, and the manifest is untouched."""
    ckpt = fresh_checkpoint(tmp_path / "ckpt", seed=12)
    sockets, cache = short_tempdir(), tmp_path / "cache"
    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(cache))
    try:
        digest = promote_checkpoint(ckpt, sockets, cache)
        mpath = manifest_path(ckpt, cache)
        before = mpath.read_bytes()
        shard = ckpt / BAD_SHARD
        shard.write_bytes(bad.corrupt(shard.read_bytes()))
        err = _serve_rank(ckpt, sockets, digest)
        assert BAD_SHARD in err and re.search(bad.problem, err), f"{bad.name}: {err}"
        assert not list(sockets.rglob("*.sock")), "a socket was created for a bad checkpoint"
        assert not list(sockets.rglob("*.lock")), "a refused daemon left its lock file"
        assert mpath.read_bytes() == before, "the promotion manifest was changed"
        assert [f for f in _files(cache) if f.endswith(".json")] == [str(mpath.relative_to(cache))]
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


# Through the shipped command (two interpreters per run, so three rows: data,
# offsets, header); the rows above cover the rest through the same code.
CLI_ROWS = [b for b in BAD_CHECKPOINTS if b.name in ("truncated_shard", "overlapping_offsets", "non_json_header")]


@pytest.mark.parametrize("bad", CLI_ROWS, ids=lambda b: b.name)
def test_bad_checkpoint_cli_exits_nonzero(bad: BadCheckpoint, tmp_path: Path) -> None:
    ckpt = fresh_checkpoint(tmp_path / "ckpt", seed=11)
    shard = ckpt / BAD_SHARD
    shard.write_bytes(bad.corrupt(shard.read_bytes()))
    sockets, cache = short_tempdir(), tmp_path / "cache"
    try:
        rc, out, err = _preload(ckpt, sockets, cache)
        _assert_refused(rc, out, err, bad)
        assert not list(sockets.rglob("*.sock")), "a socket was created for a bad checkpoint"
        assert _files(cache) == [], f"files written for a bad checkpoint: {_files(cache)}"
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


def test_good_checkpoint_control(tmp_path: Path) -> None:
    """Control for the checks above: the same command on the untouched
    checkpoint serves (so a refusal is the corruption's doing)."""
    from reliability_support import RawDaemon

    ckpt = fresh_checkpoint(tmp_path / "ckpt", seed=11)
    sockets, cache = short_tempdir(), tmp_path / "cache"
    d = RawDaemon(ckpt, sockets, cache, entry="cli").start()
    try:
        assert list(sockets.rglob("*.sock"))
    finally:
        d.stop()
        shutil.rmtree(sockets, ignore_errors=True)
