"""A slow filesystem the kernel can see: a FUSE mirror of a real directory.

:class:`harness.bench.remote_fs.RemoteFS` patches Python's file functions,
so it sees only stats issued from Python; a stat io_uring issues in the
kernel passes it by, uncharged. ``FuseFS`` is a real filesystem: every
LOOKUP, GETATTR, OPEN, READ... the kernel sends is answered after
``latency_s`` by a server in its own process (:mod:`harness.bench.fuse_server`,
the raw /dev/fuse protocol, no libfuse), with nothing cached by the kernel
(attr_valid = 0: each stat is one GETATTR; names are kept, as an NFS
client keeps its dentries), and concurrent requests
wait together, as on a storage server that serves them concurrently.

Needs root (``mount(2)`` of FUSE without fusermount) and ``/dev/fuse``;
otherwise entering raises :class:`FuseUnavailableError` saying which. A
``with`` block that never ends (its process killed by SIGKILL) leaves
nothing behind: the server sees its control pipe close, unmounts and exits;
and the mount's source names the bench's holder, whose survivor unmounts it
even when the server was killed too (:mod:`pgbase.survivor`).

>>> fs = FuseFS("/models/m", latency_s=0.05)  # doctest: +SKIP
>>> with fs as mnt:  # doctest: +SKIP
...     size = os.stat(mnt / "model-00001-of-00002.safetensors").st_size
...     served = fs.counts()["GETATTR"]  # 1 once the name is known
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from harness.bench.fuse_server import FSTYPE, mounted, umount
from pgbase.survivor import mount_source

_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 1, 2, 4
_SERVER = Path(__file__).with_name("fuse_server.py")


class FuseUnavailableError(RuntimeError):
    """A FUSE filesystem cannot be mounted here; the message says why."""


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    return libc


class FuseFS:
    """Mount a read-only mirror of ``real_dir`` for a ``with`` block; the
    block gets the mount point (a new directory under /tmp). Every request
    is answered ``latency_s`` seconds after it arrives.

    ``counts()`` returns the requests served by FUSE opcode name (``LOOKUP``,
    ``GETATTR``...) plus ``held_peak`` (most replies waiting at once: how
    many requests the kernel had in flight together); ``set_latency`` and
    ``reset`` change the latency and zero the counts for later requests;
    ``release`` answers every waiting request now.
    """

    def __init__(self, real_dir: str | os.PathLike[str], latency_s: float = 0.0) -> None:
        self.real_dir = os.path.realpath(real_dir)
        self.latency_s = latency_s
        self.mount_point: Path | None = None
        self._server: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> Path:
        if os.geteuid() != 0:
            raise FuseUnavailableError("not root: mounting FUSE without fusermount needs CAP_SYS_ADMIN")
        if not os.path.isdir(self.real_dir):
            raise FileNotFoundError(f"{self.real_dir}: no such directory to mirror")
        try:
            fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise FuseUnavailableError(f"cannot open /dev/fuse: {exc.strerror}") from None
        mp = tempfile.mkdtemp(prefix="pg-fuse-")
        try:
            try:
                self._mount(fd, mp)
                # Started after the mount: /dev/fuse refuses reads (EPERM) until then.
                # Its stdin is ours alone (a pipe, not inherited by our other
                # children): if we die, it reads end of file and unmounts.
                self._server = subprocess.Popen(
                    [sys.executable, str(_SERVER), str(fd), self.real_dir, repr(self.latency_s), mp],
                    pass_fds=(fd,), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            finally:
                # The server's copy is then the connection's only one: should it
                # die, requests fail (ENOTCONN) instead of waiting for it forever.
                os.close(fd)
            self._ask(None)  # {"ready": true}
            os.stat(mp)  # waits for INIT and the root's GETATTR: the mount serves
        except BaseException:
            self._teardown(mp)
            raise
        assert self.mount_point is not None
        return self.mount_point

    def _mount(self, fd: int, mp: str) -> None:
        # No default_permissions: with it the kernel refreshes each directory's
        # attributes (a GETATTR, attr_valid being 0) before walking through it,
        # a second round trip in series with every stat's own.
        opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other,max_read=131072"
        # The source names our holder: its survivor unmounts what a kill -9 left (pgbase.survivor).
        if _libc().mount(mount_source("pgbench").encode(), os.fsencode(mp), FSTYPE.encode(), _MS_RDONLY | _MS_NOSUID | _MS_NODEV,
                         opts.encode()) != 0:
            err = ctypes.get_errno()
            raise FuseUnavailableError(f"mount(2) of {FSTYPE} on {mp} refused: {os.strerror(err)}")
        self.mount_point = Path(mp)

    def __exit__(self, *exc: object) -> None:
        self._teardown(os.fspath(self.mount_point) if self.mount_point else None)

    def _teardown(self, mp: str | None) -> None:
        if mp is not None:
            if mounted(mp):
                umount(mp)  # ends the connection: the server's read fails
            try:
                os.rmdir(mp)
            except OSError:
                pass
        server, self._server, self.mount_point = self._server, None, None
        if server is not None:
            if server.stdin is not None:
                server.stdin.close()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            if server.stdout is not None:
                server.stdout.close()

    def _ask(self, command: str | None) -> dict[str, Any]:
        with self._lock:
            server = self._server
            if server is None or server.stdin is None or server.stdout is None:
                raise RuntimeError("FuseFS is not mounted")
            if command is not None:
                server.stdin.write(command + "\n")
                server.stdin.flush()
            line = server.stdout.readline()
        if not line:
            raise RuntimeError(f"the FUSE server exited (status {server.poll()})")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def counts(self) -> dict[str, int]:
        """Requests served since the last ``reset``, by opcode name, and ``held_peak``."""
        answer = self._ask("counts")
        return {**answer["counts"], "held_peak": answer["held_peak"]}

    def server_cpu_s(self) -> float:
        """CPU seconds the server process has used since it started."""
        return float(self._ask("counts")["cpu_s"])

    def set_latency(self, latency_s: float) -> None:
        self._ask(f"latency {latency_s!r}")
        self.latency_s = latency_s

    def reset(self) -> None:
        self._ask("reset")

    def release(self) -> None:
        self._ask("release")


__all__ = ["FSTYPE", "FuseFS", "FuseUnavailableError", "mounted"]
