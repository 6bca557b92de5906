"""Who may have written a path this process is about to believe.

A socket decides which daemon an engine talks to; a manifest decides (in
``stat`` mode) which digest, hence which daemon, an engine attaches to; the
gate's reference cache decides what "right" output is. Whoever can write any
of them can point engines at other weights, so all three get one rule:
owned by this user, no group or world access (directories 0700, files
0600), and no symlink anywhere we are asked to trust. The error names the
path and the command that fixes it.

>>> verify_private_dir("/run/user/1000/preload-gate")  # doctest: +SKIP
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

from pgbase.errors import InsecureSocketError, WriteError

# Test-only switch for the negative controls (``unsafe_identity``,
# ``unsafe_silent_fallback``, ``preload --unsafe-identity``): without it they
# are a configuration error, so no production config can turn them on. The
# gate sets it for its own child processes only.
UNSAFE_CONTROLS_ENV = "PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS"
# What ``unsafe_identity`` / ``--unsafe-identity`` may name: vLLM's
# header-only hash, the unsafe anchor the gate must see fail.
UNSAFE_IDENTITIES = ("header_only",)


class UntrustedPathError(InsecureSocketError):
    """A directory or file failed the owner, mode or symlink rule."""


def unsafe_controls_allowed() -> bool:
    return os.environ.get(UNSAFE_CONTROLS_ENV) == "1"


def require_unsafe_controls(what: str) -> None:
    """Raise a one-line configuration error unless the test-only switch is set."""
    if not unsafe_controls_allowed():
        from pgbase.errors import PreloadGateError

        raise PreloadGateError(
            f"{what} is a negative control for tests only; it is refused unless "
            f"{UNSAFE_CONTROLS_ENV}=1 is set in the environment (never set it in production)"
        )


# Where a refused path belongs to a cache, the other way out: a cache of
# one's own, by the names verbs and engines read it under (engines take no
# flag, only the environment). Keyed by the ``what`` the callers pass.
CACHE_ELSEWHERE = "use a cache of your own: --cache-dir DIR, or PRELOAD_GATE_CACHE=DIR (which engines read too)"
_ELSEWHERE = {
    **dict.fromkeys(("cache dir", "manifest", "manifest directory", "daemon registry", "daemon registry entry"),
                    CACHE_ELSEWHERE),
    **dict.fromkeys(("reference cache file", "reference cache directory"),
                    "use a reference cache of your own: gate --reference-cache DIR, or PRELOAD_GATE_CACHE=DIR"),
}


def _elsewhere(what: str) -> str | None:
    """The cache's other way out for ``what`` (or for the file whose directory it is), else None."""
    return _ELSEWHERE.get(what) or _ELSEWHERE.get(what.removesuffix(" directory"))


def _symlinked(path: Path, what: str, want_dir: bool) -> UntrustedPathError:
    out = f"refusing symlinked {what} {path}; replace it with a real {'directory' if want_dir else 'file'}"
    other = _elsewhere(what)
    return UntrustedPathError(out + (f", or {other}" if other else ""))


def _not_regular(path: Path, what: str) -> UntrustedPathError:
    return UntrustedPathError(f"{what} {path} is not a regular file")


def _check(path: Path, info: os.stat_result, what: str, want_dir: bool, mask: int = 0o077) -> None:
    if stat.S_ISLNK(info.st_mode):
        raise _symlinked(path, what, want_dir)
    if want_dir and not stat.S_ISDIR(info.st_mode):
        other = _elsewhere(what)
        raise UntrustedPathError(f"{what} {path} is not a directory" + (f"; {other}" if other else ""))
    if not want_dir and not stat.S_ISREG(info.st_mode) and not stat.S_ISSOCK(info.st_mode):
        raise _not_regular(path, what)
    if info.st_uid != os.getuid():
        raise UntrustedPathError(
            f"{what} {path} is owned by uid {info.st_uid}, not {os.getuid()}; remove it or "
            f"{_elsewhere(what) or 'use a directory of your own'}"
        )
    if info.st_mode & mask:
        want = ("700" if want_dir else "600") if mask == 0o077 else "go-w"
        kind = "accessible" if mask == 0o077 else "writable"
        raise UntrustedPathError(
            f"{what} {path} is group/world {kind} (mode {stat.S_IMODE(info.st_mode):04o}); "
            f"run: chmod {want} {path}"
        )


def verify_private_dir(directory: str | os.PathLike[str], what: str = "directory") -> None:
    """A real directory, owned by us, with no group or world access."""
    p = Path(directory)
    try:
        info = os.lstat(p)
    except FileNotFoundError as exc:
        raise UntrustedPathError(f"{what} {p} does not exist") from exc
    _check(p, info, what, want_dir=True)


def verify_cache_root(directory: str | os.PathLike[str], what: str = "cache dir") -> None:
    """The cache dir (``manifests/`` and ``daemons/`` below it): a real
    directory, owned by us, that no group or other user can write. Unlike the
    private rule it may be readable (0755, as ``promote`` has always made it):
    whoever can write it can rename what is below, while every entry below is
    held to the private rule on its own."""
    p = Path(directory)
    try:
        info = os.lstat(p)
    except FileNotFoundError as exc:
        raise UntrustedPathError(f"{what} {p} does not exist") from exc
    _check(p, info, what, want_dir=True, mask=0o022)


def verify_private_file(path: str | os.PathLike[str], what: str = "file") -> None:
    """A regular file (or socket), owned by us, 0600 at most, in a private directory."""
    p = Path(path)
    verify_private_dir(p.parent, f"{what} directory")
    try:
        info = os.lstat(p)
    except FileNotFoundError as exc:
        raise UntrustedPathError(f"{what} {p} does not exist") from exc
    _check(p, info, what, want_dir=False)


def open_own_file(path: str | os.PathLike[str], flags: int, what: str = "file") -> int:
    """Open ``path`` (``flags``: O_RDONLY, or O_WRONLY|O_APPEND|O_CREAT, ...)
    and return the fd only if what was opened is a regular file owned by us.

    The rule is the one above, held on the open fd rather than on the name,
    so nothing can be swapped in between check and use: O_NOFOLLOW refuses a
    symlink (of any owner: no symlink where we are asked to trust), fstat
    then sees the file itself. O_NONBLOCK makes a FIFO planted at the path a
    refusal instead of an open that waits for a peer forever. A file we
    create is 0600; the mode of an existing one is not checked (files of
    ours that older versions made 0644 stay usable). Raises
    :class:`UntrustedPathError`, or the ``OSError`` of the open itself
    (``FileNotFoundError`` without O_CREAT, ``PermissionError``, ...).
    """
    p = Path(path)
    try:
        fd = os.open(p, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _symlinked(p, what, want_dir=False) from exc
        if exc.errno in (errno.EISDIR, errno.ENXIO):  # a directory; a FIFO nobody reads, a socket, a device
            raise _not_regular(p, what) from exc
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # a directory opened read-only, a FIFO with a reader
            raise _not_regular(p, what)
        _check(p, info, what, want_dir=False, mask=0)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def ensure_private_dir(directory: str | os.PathLike[str], what: str = "directory",
                       parents: int = 0) -> Path:
    """Create ``directory`` 0700 (and up to ``parents`` missing levels above it,
    also 0700), then verify it. An existing parent that is not ours is left
    alone; only the levels we trust are checked."""
    d = Path(directory)
    chain = [d] + list(d.parents)[:parents]
    for p in reversed(chain):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass
    for p in reversed(chain):
        verify_private_dir(p, what)
    return d


def prepare_manifest_dir(directory: Path) -> None:
    """The manifests directory exists, is ours and is 0700: manifests decide
    which daemon an engine trusts. Made before ``promote`` hashes (its
    preflight) and again when it writes; :class:`WriteError` when it cannot be."""
    try:
        directory.parent.mkdir(0o700, parents=True, exist_ok=True)  # cache dir 0700: umask 002 made 0775
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise WriteError(str(directory), exc) from exc
    st = os.lstat(directory)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077:
        # Our own directory from a version that made it 0755: tighten it on
        # the next promote (a foreign or symlinked one is still refused).
        os.chmod(directory, 0o700)
        logging.getLogger("preload.identity").warning(
            "tightened the manifest directory %s to 0700 (it was %04o)", directory, stat.S_IMODE(st.st_mode))
    verify_private_dir(directory, "manifest directory")
