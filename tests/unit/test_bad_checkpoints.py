"""Bad input: one clear line, a non-zero exit, and nothing written.

Each case breaks a copy of the tiny checkpoint in one way and runs both
``promote`` and ``fingerprints`` on it (in process, through the CLI's own
``main``; one case also through a real subprocess). The cache dir and the
socket root must stay empty: no partial manifest, no socket dir.

Header phrases are the safetensors library's own (it decides validity).

Unreadable shards: the suite runs as root, and root reads a chmod-000 file,
so "unreadable" is simulated two ways: a directory named x.safetensors (a
real EISDIR from the kernel) and a patched ``open`` raising EACCES for one
shard (what a non-root user would get from chmod 000).
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.mutations import copy_checkpoint
from pgbase.shards import read_header, shard_paths
from preload_gate.cli import main

pytestmark = pytest.mark.unit


def _shard(ckpt: Path) -> Path:
    return shard_paths(ckpt)[0]


def _rewrite_header(ckpt: Path, edit) -> None:
    p = _shard(ckpt)
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    # Offsets are relative to the data region, so a new header length is fine.
    p.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])


def _tensor_names(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _overlap(header: dict) -> None:
    a, b = _tensor_names(header)[:2]
    start = header[a]["data_offsets"][0]
    size = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
    header[b]["data_offsets"] = [start, start + size]


def _out_of_range(header: dict) -> None:
    last = _tensor_names(header)[-1]
    b, e = header[last]["data_offsets"]
    header[last]["data_offsets"] = [b + 4096, e + 4096]


def _break(kind: str, ckpt: Path) -> str:
    """Break ``ckpt`` and return a phrase the error line must contain."""
    if kind == "missing_dir":
        for p in ckpt.iterdir():
            p.unlink()
        ckpt.rmdir()
        return "does not exist"
    if kind == "empty_dir":
        for p in ckpt.iterdir():
            p.unlink()
        return "Cannot find any model weights"
    if kind == "not_safetensors":
        _shard(ckpt).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\n" * 3)
        return "model.safetensors"
    if kind == "truncated_header":
        _shard(ckpt).write_bytes(b"\x10\x00\x00")
        return "header too small"
    if kind == "header_beyond_file":
        p = _shard(ckpt)
        raw = p.read_bytes()
        p.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
        return "invalid header length"
    if kind == "overlapping_offsets":
        _rewrite_header(ckpt, _overlap)
        return "invalid offset"
    if kind == "out_of_range_offsets":
        _rewrite_header(ckpt, _out_of_range)
        return "invalid offset"
    if kind == "directory_named_shard":
        (ckpt / "model-extra.safetensors").mkdir()
        return "model-extra.safetensors: is a directory, not a regular file"
    # What a shard is, said from lstat/stat, not guessed ("a directory, a
    # broken link or a special file?"): each kind names itself.
    if kind == "broken_link_shard":
        (ckpt / "model-extra.safetensors").symlink_to(ckpt / "gone.safetensors")
        return (f"model-extra.safetensors: {ckpt}/model-extra.safetensors is a symlink to {ckpt}/gone.safetensors, "
                "which does not exist")
    if kind == "fifo_shard":
        os.mkfifo(ckpt / "model-extra.safetensors")
        return "model-extra.safetensors: is a FIFO, not a regular file"
    if kind == "link_to_directory_shard":
        (ckpt / "sub").mkdir()
        (ckpt / "model-extra.safetensors").symlink_to(ckpt / "sub")
        return f"model-extra.safetensors: is a symlink to {ckpt}/sub, which is a directory, not a regular file"
    raise AssertionError(kind)


KINDS = [
    "missing_dir", "empty_dir", "not_safetensors", "truncated_header", "header_beyond_file",
    "overlapping_offsets", "out_of_range_offsets", "directory_named_shard", "broken_link_shard", "fifo_shard",
    "link_to_directory_shard",
]


@pytest.fixture
def broken(request, tiny_ckpt, tmp_path):
    ckpt = copy_checkpoint(tiny_ckpt, tmp_path / "ckpt")
    phrase = _break(request.param, ckpt)
    return ckpt, phrase


def _run(argv, capsys) -> tuple[int, str, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _assert_nothing_written(tmp_path: Path) -> None:
    for d in ("cache", "sockets"):
        p = tmp_path / d
        assert not p.exists() or not any(p.rglob("*")), f"{d} has {list(p.rglob('*'))}"


@pytest.mark.parametrize("broken", KINDS, indirect=True)
def test_promote_rejects(broken, tmp_path, capsys):
    ckpt, phrase = broken
    rc, out, err = _run(
        ["promote", str(ckpt), "--socket-root", str(tmp_path / "sockets"), "--cache-dir", str(tmp_path / "cache")],
        capsys,
    )
    assert rc != 0
    assert out == ""
    assert err.count("\n") == 1 and phrase in err, err
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize("side", ["base", "candidate"])
@pytest.mark.parametrize("broken", KINDS, indirect=True)
def test_fingerprints_rejects(broken, side, tiny_ckpt, tmp_path, capsys):
    ckpt, phrase = broken
    pair = {"base": str(tiny_ckpt), "candidate": str(tiny_ckpt), side: str(ckpt)}
    rc, out, err = _run(
        ["fingerprints", "--base", pair["base"], "--candidate", pair["candidate"], "--json"], capsys
    )
    assert rc != 0 and out == ""
    assert err.count("\n") == 1 and phrase in err, err


def test_control_the_unbroken_copy_passes(tiny_ckpt, tmp_path, capsys):
    """Control: the same commands on an intact copy succeed, so the failures above are the breakage."""
    ckpt = copy_checkpoint(tiny_ckpt, tmp_path / "ckpt")
    rc, out, _ = _run(
        ["promote", str(ckpt), "--socket-root", str(tmp_path / "sockets"), "--cache-dir", str(tmp_path / "cache"), "--json"],
        capsys,
    )
    assert rc == 0 and json.loads(out)["digest"]
    assert any((tmp_path / "cache").rglob("*.json"))
    rc, out, _ = _run(
        ["fingerprints", "--base", str(tiny_ckpt), "--candidate", str(ckpt), "--header-impl", "reimpl", "--json"],
        capsys,
    )
    assert rc == 0 and json.loads(out)["schemes"]["content"]["equal"] is True


def test_unreadable_shard_via_patched_open(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """What chmod 000 gives a non-root user: EACCES from open, for one shard."""
    ckpt = copy_checkpoint(tiny_ckpt, tmp_path / "ckpt")
    target = str(_shard(ckpt))
    real_open = builtins.open

    def guarded(file, *a, **kw):
        if str(file) == target:
            raise PermissionError(errno.EACCES, "Permission denied", target)
        return real_open(file, *a, **kw)

    monkeypatch.setattr(builtins, "open", guarded)
    rc, out, err = _run(
        ["promote", str(ckpt), "--socket-root", str(tmp_path / "sockets"), "--cache-dir", str(tmp_path / "cache")],
        capsys,
    )
    assert rc != 0 and "model.safetensors: cannot read shard: Permission denied" in err
    assert err.count("\n") == 1
    _assert_nothing_written(tmp_path)
    rc, out, err = _run(["fingerprints", "--base", str(tiny_ckpt), "--candidate", str(ckpt)], capsys)
    assert rc != 0 and "Permission denied" in err and err.count("\n") == 1


def test_shard_readable_for_headers_but_not_for_hashing(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """A read error mid-hash (after headers validated) still writes nothing."""
    ckpt = copy_checkpoint(tiny_ckpt, tmp_path / "ckpt")
    target = str(_shard(ckpt))
    read_header(target)
    real_open = builtins.open

    def guarded(file, mode="r", *a, **kw):
        if str(file) == target and kw.get("buffering") == 0:
            raise PermissionError(errno.EIO, "Input/output error", target)
        return real_open(file, mode, *a, **kw)

    monkeypatch.setattr(builtins, "open", guarded)
    rc, _, err = _run(
        ["promote", str(ckpt), "--socket-root", str(tmp_path / "sockets"), "--cache-dir", str(tmp_path / "cache")],
        capsys,
    )
    assert rc != 0 and "Input/output error" in err
    _assert_nothing_written(tmp_path)


def test_exit_code_and_one_line_from_a_real_process(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "preload_gate", "promote", str(tmp_path / "empty"),
         "--socket-root", str(tmp_path / "sockets"), "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=600,  # promote imports vLLM to ask its file selection
    )
    assert proc.returncode == 2
    assert proc.stdout == "" and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("preload-gate promote: error: vLLM cannot pick weight files"), proc.stderr
    assert "Cannot find any model weights" in proc.stderr
    _assert_nothing_written(tmp_path)
