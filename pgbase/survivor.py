"""What a verb starts ends with it, ``kill -9`` included: the survivor.

``preload-gate bench``, ``gate``, ``demo``, ``canary record`` and the pytest
plugin's fixtures (:mod:`harness.pytest_plugin`) start
processes (daemons, engines, vLLM servers and their engine cores, replicas,
``sha256sum``...) and mount FUSE filesystems; a verb killed with SIGKILL
runs none of its clean-up. Each calls :func:`hold` before its work: that
starts one small process, the survivor, in a session of its own (a Ctrl-C
or a signal to the verb's process group does not reach it), waiting on the
verb's pidfd, and puts a token in the verb's environment
(``$PRELOAD_GATE_OWNERS``). Every process the verb starts from then on
inherits the token, and so does every process those start, whatever session
they move to and whoever reparents them. When the verb has exited, however
it ended, the survivor (:func:`sweep`):

1. unmounts every mount whose source names the token (:func:`mount_source`:
   the bench's FUSE mirror), lazily (``MNT_DETACH``), and removes its mount
   point: a FUSE server stopped by SIGTERM leaves a dead mount otherwise;
2. SIGTERMs every process whose environment holds the token (its own clean
   stop: a daemon removes its sockets), waits up to ``TERM_S``, SIGKILLs
   what is left, and waits ``KILL_S`` more;
3. removes the scratch directories registered with :func:`register_scratch`
   (the bench's checkpoints and mirrors, gigabytes), once their users are
   stopped, our own and no symlink only;
4. says on stderr what it stopped, and exits.

After a verb's normal exit there is nothing left to stop, and it exits at once.

Why the environment and not the process tree: ranks, engine cores and
replicas lead sessions of their own and are reparented when their parent
dies, so neither the verb's process group nor ``psutil``'s ``children()``
reaches them all, while the environment is fixed at exec and inherited.
A child started with an environment not built from ``os.environ`` would
escape: tests/unit/test_survivor.py finds every such spawner and kills it
with ``kill -9`` under a holder. Why not PR_SET_PDEATHSIG: see
:mod:`preload.daemon.parent` (it follows the thread that forked, and is
lost across a set-uid exec); a cgroup needs systemd's delegation.

Holders nest (a held bench that runs the gate in a child): the variable is
a colon-separated list of tokens, one per holder, and each survivor stops
what names its own. A survivor's own environment names none, so no holder's
survivor stops another's.

Only ``rollout`` holds nothing: its replicas and daemons are the host's
and outlive it on purpose (docs/rollout.md); started by a held verb (the
``rollout_switch`` bench row), they end with that verb.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

#: Tokens of the holders a process was started under, colon-separated.
OWNERS_ENV = "PRELOAD_GATE_OWNERS"
TERM_S, KILL_S = 10.0, 5.0
_POLL_S = 0.1
_MNT_DETACH = 2
_held: str | None = None
_survivor: subprocess.Popen[bytes] | None = None  # kept referenced: never waited for, it outlives us


def tokens(value: str | None) -> list[str]:
    """The holder tokens in a ``$PRELOAD_GATE_OWNERS`` value."""
    return [t for t in (value or "").split(":") if t]


def hold(what: str) -> str:
    """Make everything this process starts from now on end with it; returns
    the token. ``what`` names the verb in the survivor's message. Idempotent:
    a second call returns the same token and starts nothing."""
    global _held, _survivor
    if _held is not None:
        return _held
    token = secrets.token_hex(8)
    with contextlib.suppress(OSError):  # the scratch list (register_scratch); none: scratch is not swept
        os.close(os.open(_scratch_list(token), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600))
    env = {k: v for k, v in os.environ.items() if k != OWNERS_ENV}
    # stdin and stdout closed, stderr ours: what it stopped is said where our errors go.
    _survivor = subprocess.Popen([sys.executable, "-m", "pgbase.survivor", str(os.getpid()), token, what],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env,
                                 start_new_session=True)
    os.environ[OWNERS_ENV] = ":".join([*tokens(os.environ.get(OWNERS_ENV)), token])
    _held = token
    return token


def _scratch_list(token: str) -> Path:
    """The file listing ``token``'s scratch directories (the token is secret: 16 random hex digits)."""
    return Path(tempfile.gettempdir()) / f"pg-scratch-{os.getuid()}-{token}.list"


def register_scratch(path: str | os.PathLike[str]) -> None:
    """Have every holder's survivor remove ``path`` (a directory this process
    made) if it is still there when the verb has gone, ``kill -9`` included."""
    for token in tokens(os.environ.get(OWNERS_ENV)):
        try:
            fd = os.open(_scratch_list(token), os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # a token with no list: its holder made none (not a holder of this release)
        try:
            if os.fstat(fd).st_uid == os.getuid():
                os.write(fd, os.fsencode(os.path.abspath(path)) + b"\n")
        finally:
            os.close(fd)


def remove_scratch(token: str) -> list[str]:
    """Remove the directories registered for ``token`` that are still there
    (ours, not a symlink), and the list; returns those removed."""
    listed = _scratch_list(token)
    try:
        st = os.lstat(listed)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return []
        paths = listed.read_bytes().splitlines()
    except OSError:
        return []
    removed = []
    for raw in dict.fromkeys(paths):
        try:
            st = os.lstat(raw)
        except OSError:
            continue  # the verb removed it
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            shutil.rmtree(raw, ignore_errors=True)
            removed.append(os.fsdecode(raw))
    with contextlib.suppress(OSError):
        listed.unlink()
    return removed


def mount_source(default: str) -> str:
    """The source to give a mount this process makes: ``default``, tagged
    with every holder's token (``pgbench:T1:T2``), so that the survivor of
    each unmounts it."""
    return ":".join([default, *tokens(os.environ.get(OWNERS_ENV))])


def _environ_tokens(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rpartition(b")")[2].split()[:1] == [b"Z"]:
                return []  # exited; only its parent's wait holds the pid
    except OSError:  # gone meanwhile, or another user's
        return []
    key = OWNERS_ENV.encode() + b"="
    for entry in env.split(b"\0"):
        if entry.startswith(key):
            return tokens(entry[len(key):].decode("ascii", "replace"))
    return []


def owned(token: str) -> list[int]:
    """Pids of the live processes whose environment names ``token`` (zombies
    excluded), this one excepted."""
    me = os.getpid()
    pids = (int(n) for n in os.listdir("/proc") if n.isdigit())
    return sorted(p for p in pids if p != me and token in _environ_tokens(p))


def _unescape(field: str) -> str:
    """A mountinfo field: spaces, tabs, newlines and backslashes come as ``\\ooo``."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts_of(token: str) -> list[str]:
    """Mount points whose source names ``token`` (:func:`mount_source`), from
    /proc/self/mountinfo (field 5 the mount point; after ``-``: type, source)."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            rest = fields[fields.index("-") + 1:] if "-" in fields else []
            if len(rest) > 1 and token in _unescape(rest[1]).split(":")[1:]:
                out.append(_unescape(fields[4]))
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()[:120]
    except OSError:
        return "?"


def _signal(pid: int, token: str, sig: int) -> None:
    """``sig`` to ``pid`` through a pidfd, once the pidfd's process is seen
    to still name ``token``: a pid reused since the scan is not signalled."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if token in _environ_tokens(pid):
            signal.pidfd_send_signal(fd, sig)
    except OSError:
        pass
    finally:
        os.close(fd)


def sweep(token: str, what: str = "", owner: int | None = None, *, term_s: float = TERM_S,
          kill_s: float = KILL_S) -> list[int]:
    """Unmount ``token``'s mounts, stop its processes (SIGTERM, ``term_s``,
    SIGKILL, ``kill_s``); returns the pids still alive after both waits (a
    process stuck in the kernel), having named each on stderr."""
    libc = ctypes.CDLL(None, use_errno=True)
    points = mounts_of(token)
    for mp in points:
        libc.umount2(os.fsencode(mp), _MNT_DETACH)
        with contextlib.suppress(OSError):
            os.rmdir(mp)
    pids = owned(token)
    if not pids and not points:
        _say_removed(remove_scratch(token), what, owner, token)
        return []
    who = f"preload-gate {what} (pid {owner})" if owner else f"the holder of {token}"
    named = "; ".join(f"{p} {_cmdline(p)}" for p in pids)
    print(f"{who} is gone; its survivor stops {len(pids)} process(es) it started"
          + (f" ({named})" if pids else "") + (f", unmounting {', '.join(points)}" if points else ""),
          file=sys.stderr, flush=True)
    for sig, wait_s in ((signal.SIGTERM, term_s), (signal.SIGKILL, kill_s)):
        deadline = time.monotonic() + wait_s
        signalled: set[int] = set()
        while pids and time.monotonic() < deadline:
            for p in set(pids) - signalled:  # the newly started too: a dying launcher's last child
                _signal(p, token, sig)
                signalled.add(p)
            time.sleep(_POLL_S)
            pids = owned(token)
        if not pids:
            _say_removed(remove_scratch(token), what, owner, token)
            return []
    print(f"preload-gate: still running after SIGKILL: {'; '.join(f'{p} {_cmdline(p)}' for p in pids)}",
          file=sys.stderr, flush=True)
    return pids


def _say_removed(removed: list[str], what: str, owner: int | None, token: str) -> None:
    if removed:
        who = f"preload-gate {what} (pid {owner})" if owner else f"the holder of {token}"
        print(f"{who} is gone; its survivor removes its scratch: {', '.join(removed)}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _pidfd(pid: int) -> Iterator[int | None]:
    try:
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = None
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def main(argv: list[str]) -> int:
    owner, token, what = int(argv[0]), argv[1], argv[2]
    with _pidfd(owner) as fd:
        # The pidfd is the holder's only if it is still our parent: one that
        # died before we looked has made us init's (or a subreaper's).
        if fd is not None and os.getppid() == owner:
            select.select([fd], [], [])  # readable once it has exited
    return 1 if sweep(token, what, owner) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
