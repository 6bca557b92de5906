"""Atomic writes: a failed write (a full disk included) leaves the previous
file intact and no temporary file behind.

The full disk is real where we can have one (a 64 KiB tmpfs; we are root in
CI containers); elsewhere that test skips with its reason (a failure under
PRELOAD_GATE_STRICT_SKIPS=1, which CI sets) and the simulated ENOSPC tests
below still run. Every check has a control: the same check run
against a naive ``open(path, "wb")`` writer must fail, or the check proves
nothing.
"""

from __future__ import annotations

import ast
import errno
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from reliability_support import (
    PYTHON,
    REPO,
    fill_disk,
    fresh_checkpoint,
    leftovers,
    skip_privileged,
    small_tmpfs,
)

from pgbase import atomic
from pgbase.errors import PreloadGateError
from preload.identity.manifest import load_manifest, manifest_path
from preload.promote import promote

pytestmark = pytest.mark.unit

OLD = b'{"previous": "intact"}\n'


def _naive_write(path: Path, data: bytes) -> None:
    """What atomic writes replace: truncate in place, then write."""
    with open(path, "wb") as f:
        f.write(data)


def _leaky_write(path: Path, data: bytes) -> None:
    """Temp file + rename, but no cleanup when the write fails."""
    tmp = path.with_name(f".{path.name}.leaky.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _failed_write_outcome(
    directory: Path, write: Callable[[Path, bytes], None], data: bytes
) -> tuple[bool, bytes | None, list[str]]:
    """Write OLD, then ``data`` (which must fail); report (raised, bytes now, leftovers)."""
    target = directory / "report.json"
    atomic.write_bytes(target, OLD)
    raised = False
    try:
        write(target, data)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
        raised = True
    now = target.read_bytes() if target.exists() else None
    return raised, now, leftovers(directory, {"report.json", "filler.bin"})


def test_replace_is_whole_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "golden.json"
    atomic.write_json(target, {"a": 1})
    atomic.write_json(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert leftovers(tmp_path, {"golden.json"}) == []
    assert oct(target.stat().st_mode & 0o777) == oct(0o644)


def test_full_tmpfs_keeps_previous_file(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    with small_tmpfs(disk, "64k") as reason:
        if reason:
            skip_privileged(f"no real full disk here ({reason}); see the simulated ENOSPC tests")
        big = b"x" * (256 << 10)  # four times the disk
        raised, now, left = _failed_write_outcome(disk, atomic.write_bytes, big)
        assert raised, "a write 4x the disk size must fail with ENOSPC"
        assert now == OLD, "the previous file must survive a failed write"
        assert left == [], f"temporary files left behind: {left}"

        # Controls on the same disk: the checks above catch a naive writer
        # (previous file destroyed) and a leaky one (temp file left behind).
        for p in list(disk.iterdir()):
            p.unlink()
        raised, now, _ = _failed_write_outcome(disk, _naive_write, big)
        assert raised and now != OLD, "control: a naive write on a full disk must lose the old file"
        for p in list(disk.iterdir()):
            p.unlink()
        raised, now, left = _failed_write_outcome(disk, _leaky_write, big)
        assert raised and left, "control: a writer without cleanup must leave a temp file"


def test_full_tmpfs_keeps_previous_manifest(tmp_path: Path) -> None:
    """promote on a full cache disk: error, old manifest intact, no temp file."""
    ckpt = fresh_checkpoint(tmp_path / "ckpt", seed=1, shards=1)
    cache = tmp_path / "cache"
    sockets = tmp_path / "sockets"
    with small_tmpfs(cache, "64k") as reason:
        if reason:
            skip_privileged(f"no real full disk here ({reason}); see the simulated ENOSPC tests")
        first = promote(ckpt, socket_root=sockets, cache_dir=cache, progress=False)
        mpath = manifest_path(ckpt, cache)
        before = mpath.read_bytes()
        fill_disk(cache)
        # New content at the same path: the manifest must change, and cannot.
        (ckpt / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:-2] + b"\x01\x02")
        with pytest.raises(OSError) as info:
            promote(ckpt, socket_root=sockets, cache_dir=cache, progress=False)
        assert info.value.errno == errno.ENOSPC
        assert mpath.read_bytes() == before
        loaded = load_manifest(ckpt, cache)
        assert loaded is not None and loaded.digest == first.digest
        assert leftovers(mpath.parent, {mpath.name}) == []

        # The CLI says so in one line and exits non-zero (no traceback).
        env = dict(os.environ, PRELOAD_GATE_CACHE=str(cache))
        proc = subprocess.run(
            [PYTHON, "-m", "preload_gate", "promote", str(ckpt), "--cache-dir", str(cache),
             "--socket-root", str(sockets)],
            capture_output=True, text=True, cwd=REPO, env=env, timeout=120,
        )
        assert proc.returncode != 0
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert "Traceback" not in proc.stderr, proc.stderr
        assert len(lines) == 1 and "No space left on device" in lines[0], proc.stderr
        assert mpath.read_bytes() == before


def test_full_tmpfs_keeps_previous_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate's report set (json, md, xml, html) on a full disk: the CLI's
    one-line error, every previous file intact, no temp file. Renderers are
    stubbed: what is under test is how the files are written."""
    import harness.report as report

    for name in ("render_markdown", "render_junit", "render_html"):
        monkeypatch.setattr(report, name, lambda doc, _n=name: f"{_n}: {doc['run']}\n")
    disk = tmp_path / "disk"
    with small_tmpfs(disk, "64k") as reason:
        if reason:
            skip_privileged(f"no real full disk here ({reason}); see the simulated ENOSPC tests")
        paths = report.write_reports({"run": "old"}, disk)
        before = {k: p.read_bytes() for k, p in paths.items()}
        fill_disk(disk)
        with pytest.raises(PreloadGateError, match="No space left on device"):
            report.write_reports({"run": "new" * 1000}, disk)
        assert {k: p.read_bytes() for k, p in paths.items()} == before
        assert leftovers(disk, {p.name for p in paths.values()} | {"filler.bin"}) == []


@pytest.mark.parametrize("stage", ["write", "fsync", "replace"])
def test_simulated_enospc_keeps_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str) -> None:
    """ENOSPC at each step of the write (NFS reports it as late as fsync)."""
    target = tmp_path / "manifest.json"
    atomic.write_bytes(target, OLD)

    def enospc(*_a: object, **_k: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if stage == "fsync":
        monkeypatch.setattr(atomic.os, "fsync", enospc)
    elif stage == "replace":
        monkeypatch.setattr(atomic.os, "replace", enospc)
    else:
        real_fdopen = os.fdopen

        class HalfWriter:
            """Writes half the bytes, then the disk is full."""

            def __init__(self, fd: int, mode: str) -> None:
                self.f = real_fdopen(fd, mode)

            def __enter__(self) -> HalfWriter:
                return self

            def __exit__(self, *exc: object) -> None:
                self.f.close()

            def write(self, data: bytes) -> int:
                self.f.write(data[: len(data) // 2])
                self.f.flush()
                enospc()
                return 0

        monkeypatch.setattr(atomic.os, "fdopen", HalfWriter)
    with pytest.raises(OSError) as info:
        atomic.write_bytes(target, b"new" * 1000)
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert target.read_bytes() == OLD
    assert leftovers(tmp_path, {"manifest.json"}) == []


def test_write_failure_is_one_named_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed write names the file and is a PreloadGateError (the CLI's one
    line) while staying an OSError (callers that catch OSError still do)."""
    target = tmp_path / "report.json"
    atomic.write_bytes(target, OLD)

    def enospc(*_a: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic.os, "fsync", enospc)
    with pytest.raises(PreloadGateError) as info:
        atomic.write_json(target, {"new": True})
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    assert str(info.value) == (
        f"cannot write {target}: No space left on device: free space (or quota) on the filesystem of {target}; "
        "the previous file is unchanged"
    )


# ------------------------------------------------------------ static scan

# Non-atomic writes that are not results: (file, enclosing function) -> why.
# Live log streams (a subprocess's stdout) are recognised by "log" in the
# path expression and need no entry.
NOT_RESULTS = {
    ("harness/bench/synthetic.py", "_stream_shard"):
        "streams a multi-GiB scratch checkpoint through its own temp file + os.replace",
    ("preload/daemon/proof.py", "_library_torch_form"):
        "a tiny probe file in its own TemporaryDirectory, read back by safetensors, then deleted",
}
SCANNED = ("pgbase", "preload", "harness", "canaries", "fixtures", "preload_gate")


def _non_atomic_writes(source: str, filename: str) -> list[tuple[int, str, str]]:
    """(line, function, call) for each replace-in-place write in ``source``."""
    found: list[tuple[int, str, str]] = []

    class Visitor(ast.NodeVisitor):
        def __init__(self) -> None:
            self.func = "<module>"

        def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
            outer, self.func = self.func, node.name
            self.generic_visit(node)
            self.func = outer

        visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

        def visit_Call(self, node: ast.Call) -> None:
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("write_text", "write_bytes") and not (
                isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "atomic"
            ):
                found.append((node.lineno, self.func, name))
            elif name == "open" and isinstance(f, ast.Name):
                mode = node.args[1] if len(node.args) > 1 else next(
                    (k.value for k in node.keywords if k.arg == "mode"), None
                )
                target = ast.unparse(node.args[0]) if node.args else ""
                if isinstance(mode, ast.Constant) and isinstance(mode.value, str) and (
                    "w" in mode.value or "x" in mode.value
                ) and "log" not in target.lower():
                    found.append((node.lineno, self.func, f"open(..., {mode.value!r})"))
            self.generic_visit(node)

    Visitor().visit(ast.parse(source, filename))
    return found


def test_scan_catches_a_naive_write() -> None:
    """Control for the scan: each naive form is found, atomic and append forms are not."""
    src = (
        "from pathlib import Path\nfrom pgbase import atomic\n"
        "def report(p):\n"
        "    Path(p).write_text('x')\n"
        "    with open(p, 'w') as f: f.write('x')\n"
        "    open(p, mode='wb').close()\n"
        "    atomic.write_text(p, 'x')\n"
        "    open(p, 'a').close()\n"
        "    open(log_path, 'wb').close()\n"
        "    open(p).read()\n"
    )
    assert [c for _, _, c in _non_atomic_writes(src, "x.py")] == [
        "write_text", "open(..., 'w')", "open(..., 'wb')",
    ]


def test_result_files_are_written_atomically() -> None:
    """Reports, manifests, golden files, fixtures: every replace-in-place write
    in the project's packages goes through pgbase.atomic."""
    offenders = []
    for pkg in SCANNED:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel == "pgbase/atomic.py":
                continue
            for line, func, call in _non_atomic_writes(path.read_text(), rel):
                if (rel, func) in NOT_RESULTS or (rel, "*") in NOT_RESULTS:
                    continue
                offenders.append(f"{rel}:{line} in {func}(): {call}")
    assert offenders == [], "non-atomic writes (use pgbase.atomic):\n" + "\n".join(offenders)
