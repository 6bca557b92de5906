"""The commands ``preload-gate status`` prints to fix what it found.

A fix names the act that mends the record: promote the folder again, start
a daemon as the old one was started (its launcher's argv reparsed by the
``preload`` verb's own parser, every path absolute), stop it, or restart it
on the same digest. :func:`launcher_command` reads the launcher;
:func:`fixes_for` words the four acts. Apart from :mod:`preload.daemon.status`
so that what ``status`` finds and how it says what to run are read apart.
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
from pathlib import Path
from typing import Any, NamedTuple, NoReturn, Protocol

from pgbase.digest_text import short_digest


class DaemonRecord(Protocol):
    """What a fix reads of a :class:`preload.daemon.status.DaemonRecord` (a
    protocol, so this module does not import the one that imports it)."""

    socket_root: str
    digest: str | None
    checkpoint: str | None
    cache_dir: str | None
    launcher_pid: int | None
    command: str | None
    ports_held: list[str]


def launcher_command(r: DaemonRecord) -> tuple[str | None, list[str]]:
    """How to start a daemon as ``r`` was, and the port flags of that command
    ``r`` still holds (``["--health-port 9100"]``: a new daemon would refuse
    them while ``r`` runs, so its fix stops ``r`` first).

    The launcher's argv is reparsed with the ``preload`` verb's own parser
    and written back from what it parsed (:func:`_preload_argv`), so every
    path is absolute, against the launcher's cwd: the command is run from
    another shell. The socket root and cache dir it ran with are added where
    the command line does not name them (they may have come from its
    environment). (None, []) if its launcher cannot be read or parsed."""
    import psutil

    from preload.identity.manifest import default_cache_dir
    from preload.sockets import SOCKET_ROOT_ENV, default_socket_root

    if r.launcher_pid is None or r.launcher_pid <= 1:
        return None, []
    try:
        proc = psutil.Process(r.launcher_pid)
        argv = proc.cmdline()
    except (psutil.Error, OSError):
        return None, []
    if "preload" not in argv[1:]:
        return None, []
    try:
        cwd: str | None = proc.cwd()
    except (psutil.Error, OSError):
        cwd = None
    parsed = _reparse(argv[argv.index("preload", 1) + 1:], cwd)
    if parsed is None:
        return None, []
    parser, args = parsed
    if cwd is None:  # relative paths were made absolute against our cwd: take what the daemon runs with
        if not os.path.isabs(args.checkpoint):
            args.checkpoint = r.checkpoint
        args.socket_root = r.socket_root if args.socket_root else None
        args.cache_dir = r.cache_dir if args.cache_dir else None
    if args.socket_root is None and (SOCKET_ROOT_ENV in os.environ or Path(r.socket_root) != default_socket_root()):
        args.socket_root = r.socket_root
    if args.cache_dir is None and r.cache_dir and Path(r.cache_dir) != default_cache_dir(env=False):
        args.cache_dir = r.cache_dir
    held = [f"{flag} {port}" for flag, port in (("--health-port", args.health_port),
                                                 ("--master-port", args.master_port))
            if port and _listening(proc, port)]
    return "preload-gate preload " + shlex.join(_preload_argv(parser, args)), held


# Flags of the launcher not repeated: a dry run never serves, --take-over is
# what it did to its predecessor (the next daemon starts on its own), and
# --exit-with-parent ties a daemon to the process that started it: run by hand
# from a shell, it would end with that shell.
_NOT_REPEATED = frozenset({"dry_run", "json", "take_over", "exit_with_parent", "help"})


def _reparse(argv: list[str], cwd: str | None) -> tuple[argparse.ArgumentParser, argparse.Namespace] | None:
    """``argv`` (after the verb) parsed by the ``preload`` verb's parser
    (:func:`preload.daemon.preload_args.add_preload`), its path flags resolved against
    ``cwd`` (the launcher's) rather than ours; None where it refuses them
    (a launcher of another release): no usage text, no exit."""
    from preload.daemon.preload_args import add_preload

    parser = add_preload(argparse.ArgumentParser(add_help=False, allow_abbrev=False).add_subparsers())

    def refuse(message: str) -> NoReturn:
        raise ValueError(message)

    parser.error = refuse  # type: ignore[method-assign]
    for action in parser._actions:
        if cwd is not None and action.dest in ("socket_root", "cache_dir") and callable(action.type):
            action.type = functools.partial(_in_dir, cwd, action.type)
    try:
        args = parser.parse_args(argv)
    except (ValueError, SystemExit):
        return None
    if cwd is not None:
        args.checkpoint = os.path.normpath(os.path.join(cwd, args.checkpoint))
    return parser, args


def _in_dir(cwd: str, convert: Any, value: str) -> Any:
    return convert(os.path.join(cwd, value) if value else value)


def _preload_argv(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """``args`` as the argv that parses to them: the positional, then each
    flag not at its default, by its long name, in the parser's order."""
    out: list[str] = []
    for action in parser._actions:
        if action.dest in _NOT_REPEATED:
            continue
        value = getattr(args, action.dest)
        if not action.option_strings:
            out.append(str(value))
        elif value != action.default:
            flag = max(action.option_strings, key=len)
            out += [flag] if action.nargs == 0 else [flag, str(value)]
    return out


def _listening(proc: Any, port: int) -> bool:
    """Whether the launcher or a process below it (its ranks) listens on
    ``port``; True where psutil may not look (the cautious fix: stop first)."""
    import psutil

    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        except psutil.Error:
            return True
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
            return True
    return False


class Fixes(NamedTuple):
    """What to run for a record: ``promote`` (then a daemon for a new
    digest), ``start_new`` (a daemon for the digest the manifest names),
    ``stop`` (this one), ``restart`` (this one stopped, then started again on
    the same digest: config.json changed, the weights did not)."""

    promote: str
    start_new: str
    stop: str
    restart: str


def _moved_cache(r: DaemonRecord) -> Path | None:
    """The writable cache a fix promotes into when ``r``'s own cannot be
    written (:func:`preload.identity.manifest.cache_instead`); else None."""
    from preload.identity.manifest import cache_instead

    instead = cache_instead(r.cache_dir) if r.cache_dir else None
    return instead[1] if instead is not None else None


def _with_cache(command: str, cache: Path) -> str:
    """``command`` (a ``preload`` command :func:`launcher_command` wrote)
    with ``--cache-dir`` set to ``cache``."""
    argv = shlex.split(command)
    if "--cache-dir" in argv:
        argv[argv.index("--cache-dir") + 1] = str(cache)
    else:
        argv += ["--cache-dir", str(cache)]
    return shlex.join(argv)


def fixes_for(r: DaemonRecord) -> Fixes:
    from preload.identity.manifest import promote_command

    moved = _moved_cache(r)
    start = f"as this one was: {r.command}" if r.command else "with this one's settings"
    stop = f"stop this one (kill {r.launcher_pid})" if r.launcher_pid else "stop this one"

    def start_new_as(how: str) -> str:
        if r.ports_held:  # the new daemon would refuse a port this one holds
            return (f"{stop} first (it holds {', '.join(r.ports_held)}, which the new daemon binds), then start "
                    f"a daemon for it ({how})")
        return f"start a daemon for it ({how}) and {stop}"

    start_new = start_new_as(start)
    promote = (f"{promote_command(str(r.checkpoint), r.cache_dir)}; if it prints a digest other than "
               f"{short_digest(str(r.digest))}, {start_new}")
    if moved is not None:
        # The promote writes another cache: the new daemon must read that one (its start
        # would refuse the read-only cache's stale manifest), and this one judges its own
        # stale manifest whatever digest the promote prints: restart either way.
        how = (f"as this one was, reading the cache the promote wrote: {_with_cache(r.command, moved)}"
               if r.command else f"with this one's settings and --cache-dir {shlex.quote(str(moved))}")
        promote = f"{promote_command(str(r.checkpoint), r.cache_dir)}; then {start_new_as(how)}"
    # The same digest: the new daemon needs this one's socket dir and rank lock.
    restart = (f"{stop} first, then start it again ({start}); no promote: the weights' digest is unchanged, "
               "and the new daemon reads config.json as it is now")
    return Fixes(promote, start_new, stop, restart)
