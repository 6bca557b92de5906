"""What a failed open, read, mmap or allocation really was, in one line with its fix.

Libraries lose the cause. safetensors 0.8's ``safe_open`` reports EMFILE
(``ulimit -n`` reached) and EACCES alike as ``FileNotFoundError("No such
file or directory: PATH")`` with no errno, a failed mmap as
``MemoryError("Cannot allocate memory (os error 12)")``; Python's own
``strerror`` for EMFILE ("Too many open files") names no limit and no fix.
An operator told a file is missing re-downloads it and fails again. So every
message built from a library's or the OS's failure goes through
:func:`explain`, which checks the claim against the real cause:

1. the errno the exception carries (our own ``open``/``os.*`` calls);
2. else the one Rust's ``io::Error`` prints (``(os error N)``, how safetensors
   words an OS failure it kept), the open-file limit where a C++ library
   printed its strerror (gloo's ``pipe: Too many open files``), or ENOMEM
   for a ``MemoryError`` or torch's allocator failure;
3. else, and for a library's ENOENT, an open of the path made now, whose
   errno is the truth (EMFILE while the caller still holds its files,
   EACCES, ENOENT only if the file really is missing).

>>> explain(FileNotFoundError("No such file or directory: /m/a.safetensors"), "/m/a.safetensors").kind  # doctest: +SKIP
'open_files'
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from pgbase.limits import gib, map_count, memory_limits, nofile_fix, open_files_text
from pgbase.mounts import VIRTUAL_FILESYSTEMS, filesystem_type

OPEN_FILES = "open_files"
SYSTEM_FILES = "system_files"
MEMORY = "memory"
PERMISSION = "permission"
MISSING = "missing"
NOT_A_FILE = "not_a_file"
NO_SPACE = "no_space"
READ_ONLY = "read_only"
IO = "io"
OTHER = "other"
KINDS = (OPEN_FILES, SYSTEM_FILES, MEMORY, PERMISSION, MISSING, NOT_A_FILE, NO_SPACE, READ_ONLY, IO, OTHER)
# A connect to an AF_UNIX socket (:func:`connect_cause`): the same errno means
# something else there (EAGAIN is a full listen backlog, not a busy read).
NO_LISTENER = "no_listener"
BUSY = "busy"
CONNECT_KINDS = (NO_LISTENER, MISSING, BUSY, PERMISSION, OTHER)

# Rust's std::io::Error Display: "<message> (os error <errno>)".
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
# A C/C++ library that words the errno with strerror and keeps no number
# (gloo: "pipe: Too many open files"); the system's own wording, longest first.
_STRERROR = tuple((os.strerror(code), code) for code in (errno.ENFILE, errno.EMFILE))
# torch's CPU allocator: "DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes".
_TORCH_OOM = re.compile(r"can't allocate memory|out of memory", re.IGNORECASE)


@dataclass(frozen=True)
class Cause:
    """The real cause of a failure: ``kind`` (one of :data:`KINDS`), the
    errno it was decided by (None when none was found), and ``text``, the
    one-line reason with the fix (no path prefix: callers name the file)."""

    kind: str
    errno: int | None
    text: str


def explain(exc: BaseException, path: str | os.PathLike[str] | None = None) -> Cause:
    """The real cause of ``exc``, raised while opening, reading or mapping
    ``path`` (None: no file involved, e.g. an allocation or a socket).

    Call it where the failure is caught, before the caller closes what it
    holds: an EMFILE is proven by an open that still fails.
    """
    if path is None:
        path = getattr(exc, "filename", None)  # OSError names the file it was raised for
    code = _errno_of(exc)
    own_errno = isinstance(getattr(exc, "errno", None), int)
    # An OSError without its own errno is a library's claim (safetensors'
    # FileNotFoundError for any failed open): ask the file. A library error
    # that is no OSError (a bad header) is the library's verdict, kept.
    if path is not None and isinstance(exc, OSError) and (
            code is None or (code == errno.ENOENT and not own_errno)):
        code = _probe(path)
        if code is None:
            return Cause(OTHER, None, f"{_said(exc)}, yet the file exists and opens now ({open_files_text()}); "
                         "if it recurs, check the storage and the open-file limit")
    if code is None:
        return Cause(OTHER, None, _said(exc))
    if code == errno.ENOMEM and "CUDA" in str(exc):
        return Cause(MEMORY, code, f"out of GPU memory ({_said(exc)})")
    try:
        return _by_errno(code, path, exc)
    except OSError:  # the facts for the message cannot be read (at the limit itself): the errno alone
        return Cause(OTHER, code, os.strerror(code))


def describe(exc: BaseException, path: str | os.PathLike[str] | None = None) -> str:
    """``explain(exc, path).text``: the reason to put in a message."""
    return explain(exc, path).text


# The errnos of a full descriptor table: this process's (RLIMIT_NOFILE) or the system's.
FILE_LIMIT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE})


def file_limit(exc: BaseException) -> Cause | None:
    """The open-file limit ``exc`` ran into, or None: ``exc`` itself or any
    exception it was raised from or during (``__cause__``, ``__context__``)
    carries EMFILE or ENFILE. Ask it before a handler words a failure some
    other way ("no daemon answers", "module failed to import", a
    traceback): at the limit every open fails, and only the limit is the
    cause.

    >>> file_limit(OSError(errno.EMFILE, "Too many open files")).kind  # doctest: +SKIP
    'open_files'
    """
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if _errno_of(e) in FILE_LIMIT_ERRNOS:
            return explain(e)
        todo.extend(c for c in (e.__cause__, e.__context__) if c is not None)
    return None


def file_limit_now() -> Cause | None:
    """The open-file limit this process is at now (an open fails with EMFILE
    or ENFILE), or None. For a failure whose cause a library dropped (an
    import whose directory listing failed reads as ``ModuleNotFoundError``),
    asked while the caller still holds what it holds."""
    try:
        fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return explain(exc) if exc.errno in FILE_LIMIT_ERRNOS else None
    os.close(fd)
    return None


def reason(exc: BaseException, path: str | os.PathLike[str] | None = None) -> str:
    """For a handler that takes any exception: the real cause where the
    failure was the system's (an errno, a failed allocation), else
    ``Type: message`` (a bug or a library's own verdict keeps its type)."""
    cause = explain(exc, path)
    if cause.errno is not None or isinstance(exc, (OSError, MemoryError)):
        return cause.text
    return f"{type(exc).__name__}: {_said(exc)}"


def connect_cause(exc: BaseException, path: str | os.PathLike[str]) -> Cause:
    """The real cause of a failed ``connect`` to the AF_UNIX socket ``path``.

    Only ECONNREFUSED (a socket file with nothing listening behind it: its
    process is gone) and ENOENT mean that no one is there. A socket with a
    timeout connects non-blocking, and on Linux a non-blocking AF_UNIX
    connect to a listener whose backlog is full fails at once with EAGAIN
    (``net/unix/af_unix.c``: ``unix_wait_for_peer`` only when blocking): the
    listener is alive and has not accepted its earlier callers yet. A socket
    connects only with write permission on it (EACCES).

    >>> connect_cause(ConnectionRefusedError(111, "Connection refused"), "/run/x.sock").kind
    'no_listener'
    """
    code = _errno_of(exc)
    if code in (errno.EAGAIN, errno.EWOULDBLOCK):
        return Cause(BUSY, code, "its listen backlog is full: the process listening is alive but busy, it has not yet "
                     "accepted the connections before this one")
    if isinstance(exc, TimeoutError) or code == errno.ETIMEDOUT:
        return Cause(BUSY, code, "the process listening did not accept the connection in time (alive but busy)")
    if code == errno.ECONNREFUSED:
        return Cause(NO_LISTENER, code, "nothing listens on it (the socket file is left from a process that "
                     "stopped)")
    if code in (errno.ENOENT, errno.ENOTDIR):
        return Cause(MISSING, code, _missing_text(path))
    if code in (errno.EACCES, errno.EPERM):
        if _unsearchable(Path(path)) is not None:
            return Cause(PERMISSION, code, _permission_text(path, os.strerror(code)))
        return Cause(PERMISSION, code, f"{os.strerror(code)}: this process (uid {os.geteuid()}) has no write "
                     f"permission on {path} ({_owner_mode(Path(path))}), which a connect needs; run as its owner")
    return Cause(OTHER, code, os.strerror(code) if code is not None else _said(exc))


def _errno_of(exc: BaseException) -> int | None:
    code = getattr(exc, "errno", None)
    if isinstance(code, int):
        return code
    m = _RUST_OS_ERROR.search(str(exc))
    if m:
        return int(m.group(1))
    for text, by_text in _STRERROR:
        if text in str(exc):
            return by_text
    if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and _TORCH_OOM.search(str(exc))):
        return errno.ENOMEM
    return None


def _probe(path: str | os.PathLike[str]) -> int | None:
    """The errno an open of ``path`` fails with now; None if it opens."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        return exc.errno
    os.close(fd)
    return None


def _said(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _by_errno(code: int, path: str | os.PathLike[str] | None, exc: BaseException) -> Cause:
    if code == errno.EMFILE:
        return Cause(OPEN_FILES, code, f"the open-file limit is reached ({open_files_text()}); {nofile_fix()}")
    if code == errno.ENFILE:
        return Cause(SYSTEM_FILES, code, f"the system-wide open-file table is full ({_file_nr()}); close files "
                     "elsewhere on this host or raise it: sysctl -w fs.file-max=N")
    if code == errno.ENOMEM:
        return Cause(MEMORY, code, _memory_text())
    if code in (errno.EACCES, errno.EPERM):
        return Cause(PERMISSION, code, _permission_text(path, os.strerror(code)))
    if code in (errno.ENOENT, errno.ENOTDIR) and path is not None:
        return Cause(MISSING, code, _missing_text(path))
    if code in (errno.EISDIR, errno.ENODEV, errno.ENXIO, errno.EINVAL) and path is not None and _not_regular(path):
        return Cause(NOT_A_FILE, code, f"{path} is {_not_regular(path)}, not a regular file")
    if code in (errno.ENOSPC, errno.EDQUOT):
        return Cause(NO_SPACE, code, f"{os.strerror(code)}: free space (or quota) on the filesystem"
                     f"{'' if path is None else ' of ' + str(path)}")
    if code == errno.EROFS:
        return Cause(READ_ONLY, code, f"{'the filesystem' if path is None else str(path)} is on a read-only "
                     "filesystem")
    if code == errno.EIO:
        return Cause(IO, code, f"{os.strerror(code)} from the storage (the device or the network filesystem "
                     "failed; the kernel log, dmesg, says more)")
    return Cause(OTHER, code, os.strerror(code) if not str(exc) or isinstance(exc, OSError) else _said(exc))


def _memory_text() -> str:
    """Out of memory, naming the limit that is closest to running out."""
    maps = map_count()
    if maps is not None and maps[0] >= maps[1] - 16:
        return (f"out of memory mappings ({maps[0]} of vm.max_map_count {maps[1]}); raise it: "
                "sysctl -w vm.max_map_count=N")
    limits = memory_limits()
    tight = min(limits, key=lambda m: m.available)
    return (f"out of memory: {gib(tight.available)} left under {tight.name} ({tight.detail}); {tight.fix}")


def _permission_text(path: str | os.PathLike[str] | None, said: str) -> str:
    if path is None:
        return said
    p = Path(path)
    d = _unsearchable(p)
    if d is not None:
        return f"{said}: this process (uid {os.geteuid()}) cannot enter {d} ({_owner_mode(d)})"
    return f"{said}: this process (uid {os.geteuid()}) cannot open {p} ({_owner_mode(p)})"


def _unsearchable(p: Path) -> Path | None:
    """The first directory on the way to ``p`` this process cannot search."""
    effective = os.access in os.supports_effective_ids  # as the kernel checks: by the effective uid
    for d in reversed(p.parents):
        if os.path.isdir(d) and not os.access(d, os.X_OK, effective_ids=effective):
            return d
    return None


def _owner_mode(p: Path) -> str:
    try:
        st = os.stat(p)
    except OSError:
        return "cannot stat it"
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def _missing_text(path: str | os.PathLike[str]) -> str:
    """What is missing on the way to ``path``, found by an lstat of each
    ancestor and of ``path``: the first one that is not there (or a symlink
    to nothing, or a file where a directory should be). Where everything is
    there the OS's ENOENT was no missing file, and that is said: a directory
    on a virtual filesystem (procfs) answers ENOENT to a new entry in it."""
    p = Path(path)
    for q in (*reversed(p.parents), p):
        try:
            st = os.lstat(q)
        except OSError:
            return f"{p} does not exist" if q == p else f"{p} does not exist: its directory {q} does not exist"
        if stat.S_ISLNK(st.st_mode) and not os.path.exists(q):
            link = f"{q} is a symlink to {os.readlink(q)}, which does not exist"
            return link if q == p else f"{p} does not exist: {link}"
        if q != p and not os.path.isdir(q):
            return f"{p} does not exist: {q} is {file_kind(q)}, not a directory"
    return _refused_text(p)


def _refused_text(p: Path) -> str:
    """The OS said ENOENT for ``p``, yet ``p`` and its directories exist."""
    fstype = filesystem_type(p)
    if not os.path.isdir(p):
        return (f"the OS answered 'No such file or directory' for {p}, yet it exists when checked now"
                f"{f' (on {fstype})' if fstype else ''}")
    if fstype in VIRTUAL_FILESYSTEMS:
        return f"{p} exists but refuses new entries (a virtual filesystem: {fstype})"
    return (f"{p} exists but refused a new entry in it with 'No such file or directory'"
            f"{f' (filesystem type {fstype})' if fstype else ''}")


def file_kind(path: str | os.PathLike[str]) -> str:
    """What ``path`` is, from lstat (and stat through a symlink), for a
    message that refuses it: a broken symlink names its target.

    >>> file_kind("/proc")
    'a directory'
    """
    try:
        mode = os.lstat(path).st_mode
    except OSError as exc:
        return f"not there ({explain(exc, path).text})"
    if stat.S_ISLNK(mode):
        if not os.path.exists(path):
            return f"a broken symlink (to {os.readlink(path)}, which does not exist)"
        return f"a symlink to {os.readlink(path)}, which is {_not_regular(path) or 'a regular file'}"
    return _not_regular(path) or "a regular file"


def _not_regular(path: str | os.PathLike[str]) -> str | None:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else f"of file type {stat.S_IFMT(mode):o}")


def _file_nr() -> str:
    try:
        used, _, limit = Path("/proc/sys/fs/file-nr").read_text().split()
    except (OSError, ValueError):
        return "fs.file-nr unreadable"
    return f"{used} of fs.file-max {limit} in use"
