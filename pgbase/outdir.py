"""A directory a verb will write, checked before the verb runs anything.

Every layer has such a directory (``fixtures OUT``, ``gate --report`` and
``--workdir``, ``bench --out``, ``canary record --out``): a file in the way or
a place mkdir refuses is one line naming the flag, never a traceback after
the work was done.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pgbase.errors import PreflightError
from pgbase.oscause import describe


def nearest_existing(path: str | os.PathLike[str]) -> Path:
    """``path`` itself if something is there (followed or not), else its
    nearest ancestor that exists: what a ``mkdir -p`` of it would start from."""
    up = Path(path)
    while not os.path.lexists(up) and up != up.parent:
        up = up.parent
    return up


def check_output_dir(path: str | os.PathLike[str], flag: str, must_be_empty: bool = False) -> None:
    """``path`` (a directory a verb will write, given as ``flag``) exists as a
    writable directory or can be created, checked before anything runs.

    It is probed by making and removing one temporary directory in ``path`` or
    its nearest existing parent: ``os.access`` answers for permission bits
    only, and says yes to root on /proc, a root-squashed NFS export or a full
    quota. Nothing is left behind, but the probe changes the stat (mtime,
    ctime) of the directory it is made in, and a promoted checkpoint's
    manifest records its directory's stat: so a verb calls this after every
    check that only reads, and the shape checks (a directory, empty when
    ``must_be_empty``) come before the probe (a refusal writes nothing).
    The path is resolved first (``x/../..`` through a missing ``x`` names
    the directory it ends in).

    Raises :class:`PreflightError` naming the directory and the fix."""
    probe = _check_shape(path, flag, must_be_empty)
    _probe(path, probe, flag)


def _check_shape(path: str | os.PathLike[str], flag: str, must_be_empty: bool) -> Path:
    """The read-only half: the nearest existing directory the probe would use."""
    out = Path(os.path.realpath(path))
    probe = nearest_existing(out)
    if not probe.is_dir():
        what = "is not a directory" if probe == out else f"cannot be created: its parent {probe} is not a directory"
        raise PreflightError(f"{flag} {path} {what}; choose a writable {flag} directory")
    if must_be_empty and probe == out and any(out.iterdir()):
        raise PreflightError(f"{flag} {path} exists and is not an empty directory; choose a new or empty {flag}")
    return probe


def _probe(path: str | os.PathLike[str], probe: Path, flag: str) -> None:
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".preload-gate-probe-", dir=probe))
    except OSError as exc:
        raise PreflightError(f"{flag} {path} cannot be written: making a directory in {probe} failed "
                             f"({describe(exc, probe)}); choose a writable {flag} directory") from exc


def check_output_dirs(dirs: dict[str, str | os.PathLike[str] | None]) -> None:
    """:func:`check_output_dir` for each ``{flag: path}`` given (None: not
    asked for), before a verb runs anything: a file in the way or a place
    mkdir refuses is one line naming the flag, never a traceback after the
    engines ran. Every flag's shape is checked before the first probe, so a
    bad later flag refuses with no directory touched."""
    given = {flag: path for flag, path in dirs.items() if path}
    probes = {flag: _check_shape(path, flag, False) for flag, path in given.items()}
    for flag, path in given.items():
        _probe(path, probes[flag], flag)
