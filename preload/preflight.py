"""Checks that need no weights, run before the first weight byte is read.

A socket path over the AF_UNIX limit, a socket root under a missing
directory, a rank lock another daemon holds, a busy ``--health-port``, a
``--dtype`` vLLM does not take, a ``--tensor-parallel-size`` that does not
divide the model's heads (read from ``config.json``), a manifest cache or
report directory that cannot be written or cannot be trusted: each is known
in milliseconds, so none may cost a user a whole load and then a traceback.
Each check raises :class:`PreflightError`, one line naming the thing and the
fix, and creates nothing (a lock is probed on an existing file only, a port
is bound and released at once).

>>> preflight_daemon(socket_root="/run/user/1000/pg", ranks=[0], health_port=None)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

from pgbase.digest_text import SHORT_CHARS
from pgbase.errors import PreflightError, PreloadGateError
from pgbase.limits import gib
from pgbase.oscause import MEMORY, OPEN_FILES, SYSTEM_FILES, describe, explain
from pgbase.outdir import check_output_dir, check_output_dirs, nearest_existing
from pgbase.shards import not_a_directory, shard_paths
from preload import trust
from preload.preflight_vllm import (
    VLLM_DTYPES,
    check_dtype,
    check_engine_choices,
    check_pipeline_parallel,
    check_tensor_parallel,
    model_heads,
)

# sun_path is 108 bytes on Linux, one of them the terminating NUL.
AF_UNIX_MAX = 107


def socket_path_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be bound or connected as an AF_UNIX socket, or None."""
    n = len(os.fsencode(os.fspath(path)))
    if n > AF_UNIX_MAX:
        return (f"socket path {path} is {n} bytes, over the AF_UNIX limit of {AF_UNIX_MAX}; "
                f"use a shorter --socket-root (or PRELOAD_GATE_SOCKET_ROOT)")
    return None


def check_socket_root(root: str | os.PathLike[str], ranks: Iterable[int] = (0,), probe: bool = False) -> None:
    """The socket paths fit AF_UNIX, the root's parent exists, the root (if it
    exists) is private. The digest directory is ``<root>/<16 hex>``, so its
    length is known before the digest is. ``probe``: a root that does not
    exist yet is proven creatable by making and removing a directory beside it."""
    r = Path(root)
    for rank in ranks:
        problem = socket_path_problem(r / ("0" * SHORT_CHARS) / f"rank{rank}.sock")
        if problem:
            raise PreflightError(problem.replace(f"{r}/{'0' * SHORT_CHARS}", f"{r}/<digest16>"))
    parent = r.parent
    if not parent.is_dir():
        up = nearest_existing(parent)
        if not up.is_dir():  # mkdir -p would fail too: say what is in the way
            raise PreflightError(f"the socket root {r} cannot be made: {up} is not a directory; "
                                 "choose another --socket-root")
        raise PreflightError(f"the socket root's parent directory {parent} does not exist; "
                             f"create it (mkdir -p {parent}) or choose another --socket-root")
    if os.path.lexists(r):
        try:
            trust.verify_private_dir(r, "socket root")
        except trust.UntrustedPathError as exc:
            raise PreflightError(str(exc)) from exc
    elif not os.access(parent, os.W_OK | os.X_OK):
        raise PreflightError(f"cannot create the socket root {r}: {parent} is not writable; "
                             f"choose another --socket-root")
    elif probe:
        # os.access says yes to root on /proc or a read-only mount: make and
        # remove one directory, so a rank process does not find out later.
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".preload-gate-probe-", dir=parent))
        except OSError as exc:
            raise PreflightError(f"cannot create the socket root {r}: making a directory in {parent} failed "
                                 f"({describe(exc, parent)}); choose a writable --socket-root") from None


def rank_lock_holders(socket_dir: str | os.PathLike[str], ranks: Iterable[int]) -> dict[int, str]:
    """Rank -> the pid written in its lock file, for each rank whose lock a
    live process holds in ``socket_dir`` (probed on an existing lock file
    only; nothing is created). A lock path that is not a private regular
    file is refused (:class:`PreflightError`), as a start refuses it."""
    from pgbase.lockfile import LockFileError, open_lock_file
    from preload.daemon.lock import lock_path

    held: dict[int, str] = {}
    for rank in ranks:
        path = lock_path(socket_dir, rank)
        try:
            fd = open_lock_file(path, f"rank {rank} lock", create=False)
        except FileNotFoundError:
            continue
        except LockFileError as exc:
            raise PreflightError(str(exc)) from None
        except OSError as exc:
            cause = explain(exc, path)
            # A broken lock file is removed; a limit of this process's is raised instead.
            fix = "" if cause.kind in (OPEN_FILES, SYSTEM_FILES, MEMORY) else "; remove it"
            raise PreflightError(f"cannot open the rank lock {path}: {cause.text}{fix}") from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held[rank] = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    return held


def check_rank_locks(socket_dir: str | os.PathLike[str], ranks: Iterable[int]) -> None:
    """No other daemon holds a rank's lock in ``socket_dir``."""
    for rank, holder in rank_lock_holders(socket_dir, ranks).items():
        raise PreflightError(
            f"another daemon (pid {holder}) already serves rank {rank} in {socket_dir}; "
            "stop it first (preload-gate status lists it)")


def check_port(host: str, port: int) -> None:
    """``host:port`` can be bound now (as the health server binds it)."""
    if not 0 <= port <= 65535:
        raise PreflightError(f"--health-port {port} is not a TCP port (0-65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise PreflightError(f"--health-host {host} does not resolve: {exc.strerror}") from exc
    family, _, _, _, addr = infos[0]
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise PreflightError(f"cannot open a socket to probe --health-port {port}: {describe(exc)}") from exc
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server does
        s.bind(addr)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PreflightError(f"--health-port {port} on {host} is already in use; choose another "
                                 f"port or stop what holds it (ss -ltnp 'sport = :{port}')") from exc
        raise PreflightError(f"cannot bind --health-port {port} on {host}: {describe(exc)}") from exc
    finally:
        s.close()


def check_cache_root(cache_dir: str | os.PathLike[str] | None) -> None:
    """The cache dir (``None``: ``$PRELOAD_GATE_CACHE``, else the default one),
    where it exists, is ours, not writable by others (:func:`trust.verify_cache_root`)
    and readable by us: an unreadable one would look empty, so ``preload``
    would serve with no manifest and ``status`` miss its registry. ``preload``,
    ``status`` and ``promote`` ask this before anything else reads it."""
    from preload.identity.manifest import default_cache_dir

    base = Path(cache_dir) if cache_dir else default_cache_dir()
    if not os.path.lexists(base):
        return
    try:
        trust.verify_cache_root(base)
    except trust.UntrustedPathError as exc:
        raise PreflightError(str(exc)) from exc
    if not os.access(base, os.R_OK | os.X_OK):
        raise PreflightError(f"cache dir {base} is not readable (mode {stat.S_IMODE(os.lstat(base).st_mode):04o}); "
                             f"run: chmod u+rwx {base}")


def check_cache_dir(cache_dir: str | os.PathLike[str] | None, checkpoint: str | os.PathLike[str] | None = None,
                    write: bool = True) -> None:
    """The cache dir is trusted (:func:`check_cache_root`), the manifest
    directory can be written (or created) and, where it or the checkpoint's
    manifest exists, is trusted."""
    from preload.identity.manifest import cache_unwritable, default_cache_dir, manifest_path

    check_cache_root(cache_dir)
    base = Path(cache_dir) if cache_dir else default_cache_dir()
    mdir = base / "manifests"
    try:
        if os.path.lexists(mdir) and not (write and _own_real_dir(mdir)):
            # (our own loose directory is tightened by the write: identity.manifest)
            trust.verify_private_dir(mdir, "manifest directory")
        if checkpoint is not None:
            mpath = manifest_path(checkpoint, base)
            if os.path.lexists(mpath):
                trust.verify_private_file(mpath, "manifest")
    except trust.UntrustedPathError as exc:
        raise PreflightError(str(exc)) from exc
    if not write:
        return
    unwritable = cache_unwritable(base)
    if unwritable is not None:
        raise PreflightError(f"the manifest cache {mdir} {unwritable}; set --cache-dir or PRELOAD_GATE_CACHE to a "
                             "writable directory")
    # The checks above answer for an ordinary user; root passes os.access
    # everywhere (even under /proc), so the directory is made here, 0700, as
    # the write would make it: a cache that cannot exist fails before hashing.
    # What this made is removed again (a refusal later leaves nothing behind).
    made = [d for d in (mdir, *mdir.parents) if not os.path.lexists(d)]
    try:
        trust.prepare_manifest_dir(mdir)
        for d in made:  # deepest first; only the empty levels this call made
            with contextlib.suppress(OSError):
                os.rmdir(d)
    except (PreloadGateError, OSError) as exc:
        why = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
        why_text = describe(why, mdir) if isinstance(why, OSError) else str(why)
        raise PreflightError(f"the manifest cache {mdir} cannot be created: {why_text}; set --cache-dir "
                             f"or PRELOAD_GATE_CACHE to a writable directory") from exc


def check_cuda(transport: str) -> None:
    """``--transport cuda`` has a CUDA device to put weights on."""
    if transport != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise PreflightError("--transport cuda needs a CUDA device and none is visible (torch.cuda.is_available() "
                             "is False: no GPU, no driver, a CPU-only torch or CUDA_VISIBLE_DEVICES hides them); "
                             "use --transport shm")


def _own_real_dir(path: Path) -> bool:
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def check_checkpoint(checkpoint: str | os.PathLike[str]) -> None:
    p = Path(checkpoint)
    if not p.is_dir():
        raise PreflightError(not_a_directory(p))
    if not os.access(p, os.R_OK | os.X_OK):
        raise PreflightError(f"checkpoint directory {p} is not readable")


def check_raw_memory(checkpoint: str | os.PathLike[str], local_ranks: int, tp_size: int = 1) -> None:
    """The raw stage's ranks on this host fit the memory budget together
    (:func:`preload.budget.check_memory`), from the shards' sizes: one stat
    each, nothing read. Each rank holds its tensor-parallel share of every
    tensor (replicated ones whole), so the ranks here hold at least
    ``local_ranks / tp_size`` copies of the shards' bytes (headers, a few KiB,
    counted in). Each rank checks its own arena again, exactly, after the
    headers and before the first tensor."""
    from preload.budget import check_memory

    paths = shard_paths(checkpoint, prefer_vllm=False)  # the raw stage's own selection
    size = sum(p.stat().st_size for p in paths)
    copies = local_ranks / tp_size
    what = (f"{local_ranks} raw-stage rank{'s' if local_ranks > 1 else ''} of {checkpoint} "
            f"({len(paths)} shards, {gib(size)}{f' x {copies:g}' if copies != 1 else ''})")
    check_memory([(what, int(size * copies))])


def check_rank_open_files(checkpoint: str | os.PathLike[str], stage: str | None) -> None:
    """The open-file limit the ranks will inherit leaves a rank what it needs
    to load and serve one engine (:func:`preload.budget.rank_open_files`,
    what each rank reserves again before its first shard), counted beside
    what this process holds: a dry run says what the start would."""
    from preload.budget import MAX_CONNECTIONS, check_open_file_limit, rank_open_files

    need, want = rank_open_files(MAX_CONNECTIONS, stage if stage in ("raw", "loaded", "processed") else "raw")
    check_open_file_limit(need, f"a rank of {checkpoint} ({stage or 'default'} stage, shards read one at a time)",
                          want)


def preflight_daemon(checkpoint: str | os.PathLike[str], socket_root: str | os.PathLike[str] | None,
                     ranks: Iterable[int], digest: str | None, health_host: str = "127.0.0.1",
                     health_port: int | None = None, dtype: str = "auto", tp_size: int = 1,
                     pp_size: int = 1, transport: str = "shm", engine: dict[str, object] | None = None,
                     refuse_held: bool = True, stage: str | None = None) -> dict[int, str]:
    """Everything ``preload`` (and its ``--dry-run``) can check before it reads a weight byte.

    Returns the ranks another daemon holds (rank -> its pid); with
    ``refuse_held`` (a start) the first of them is refused instead. A dry
    run reports them beside its plan."""
    from preload.sockets import default_socket_root, socket_dir

    ranks = list(ranks)
    check_checkpoint(checkpoint)
    check_dtype(dtype)
    check_engine_choices(engine or {})
    check_tensor_parallel(checkpoint, tp_size)
    check_pipeline_parallel(checkpoint, pp_size)
    root = Path(socket_root) if socket_root else default_socket_root()
    check_socket_root(root, ranks, probe=True)
    held: dict[int, str] = {}
    if digest is not None:
        sdir = socket_dir(digest, root)
        if os.path.lexists(sdir):
            try:
                trust.verify_private_dir(sdir, "socket directory")
            except trust.UntrustedPathError as exc:
                raise PreflightError(str(exc)) from exc
            if refuse_held:
                check_rank_locks(sdir, ranks)
            else:
                held = rank_lock_holders(sdir, ranks)
    if health_port is not None:
        check_port(health_host, health_port)
    check_cuda(transport)
    check_rank_open_files(checkpoint, stage)
    if stage == "raw" and transport == "shm":
        # (The loaded stage's size depends on vLLM's dtype and layout: its ranks
        # check their arenas once the model is built, before the first tensor.)
        check_raw_memory(checkpoint, len(ranks), tp_size)
    return held


def preflight_promote(checkpoint: str | os.PathLike[str], socket_root: str | os.PathLike[str] | None,
                      cache_dir: str | os.PathLike[str] | None) -> None:
    """Everything ``promote`` can check before it hashes a byte."""
    from preload.sockets import default_socket_root

    check_checkpoint(checkpoint)
    check_socket_root(Path(socket_root) if socket_root else default_socket_root())
    check_cache_dir(cache_dir, checkpoint)


__all__ = [
    "AF_UNIX_MAX", "VLLM_DTYPES", "PreflightError", "check_cache_dir", "check_cache_root", "check_checkpoint",
    "check_cuda", "check_dtype", "check_rank_open_files", "check_raw_memory", "check_engine_choices", "check_output_dir", "check_output_dirs",
    "check_pipeline_parallel", "check_port", "check_rank_locks", "check_socket_root", "rank_lock_holders",
    "check_tensor_parallel", "model_heads", "preflight_daemon",
    "preflight_promote", "socket_path_problem",
]
