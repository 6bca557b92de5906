"""Atomic file writes: a reader sees the old file or the new one, never half.

Write to a temporary file in the same directory, fsync it, then ``os.replace``.
A failure at any point (a full disk included) removes the temporary file and
leaves the previous file untouched.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from pgbase.errors import WriteError


def write_bytes(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise WriteError(str(target), exc) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        # A full disk or a read-only directory is an operator's problem to
        # fix, not a bug: one line naming the file (the CLI prints it).
        if isinstance(exc, OSError) and not isinstance(exc, WriteError):
            raise WriteError(str(target), exc) from exc
        raise


def write_text(path: str | os.PathLike[str], text: str, mode: int = 0o644) -> None:
    write_bytes(path, text.encode("utf-8"), mode)


def write_json(path: str | os.PathLike[str], obj: Any, mode: int = 0o644) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", mode)
