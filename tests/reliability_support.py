"""Machinery shared by the reliability tests (fuzz, faults, hostile peers,
load, bad checkpoints, atomic writes).

It lives here rather than in a conftest so it cannot clash with fixtures
other test areas define, and so a test imports exactly what it uses.

- ``small_tmpfs``: a real full disk (a 64 KiB tmpfs), because a simulated
  ENOSPC only proves what the simulation raises.
- ``BAD_CHECKPOINTS``: one row per way a safetensors shard can lie, each
  naming the shard and the words the error must contain.
- ``RawDaemon``: a raw-stage daemon (no vLLM) in a subprocess, started the
  way an operator starts it (``preload-gate preload --stage raw``), with
  ``kill()`` for crash tests.
- ``run_as``: run a tiny client as another uid, with CAP_DAC_OVERRIDE kept
  so the 0700 directory and 0600 socket do not stop it: whatever rejects it
  is then the daemon's SO_PEERCRED check, and nothing else.
- ``skip_privileged``: how those two skip where root powers are missing,
  and fail instead under ``PRELOAD_GATE_STRICT_SKIPS=1`` (set by CI, which
  runs as root), so they never go unrun quietly where they should run.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import psutil
import pytest

from preload.daemon.ready import (
    RANK_READY,
    READY,
    NotReadyError,
    start_preload,
    start_rank,
    stop_daemon,
    wait_ready,
)

PYTHON = sys.executable
REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534


# Set to 1 where the privileged tests must run (CI: root on a fresh machine).
STRICT_SKIPS = "PRELOAD_GATE_STRICT_SKIPS"


def skip_privileged(reason: str) -> NoReturn:
    """Skip a test that needs a root power this machine lacks (another uid,
    chown, a tmpfs mount), or, with ``PRELOAD_GATE_STRICT_SKIPS=1``, fail it
    naming the reason: there a skip would hide an unrun security or ENOSPC test."""
    if os.environ.get(STRICT_SKIPS) == "1":
        pytest.fail(f"{reason}; {STRICT_SKIPS}=1 says this test must run here", pytrace=False)
    pytest.skip(reason)


# --------------------------------------------------------------- full disks


def mount_tmpfs(directory: Path, size: str = "64k") -> str | None:
    """Mount a tmpfs of ``size`` on ``directory``; None, or why it could not."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("mount") is None:
        return "no mount(8) on this machine"
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(directory)],
        capture_output=True, text=True,
    )
    if proc.returncode != 0:
        return f"mount -t tmpfs refused: {proc.stderr.strip() or proc.returncode}"
    return None


@contextlib.contextmanager
def small_tmpfs(directory: Path, size: str = "64k") -> Iterator[str | None]:
    """Yield None with a tmpfs mounted on ``directory``, or the reason it is not."""
    reason = mount_tmpfs(directory, size)
    try:
        yield reason
    finally:
        if reason is None:
            subprocess.run(["umount", "-l", str(directory)], check=False)


def fill_disk(directory: Path) -> Path:
    """Write one filler file until the filesystem under ``directory`` is full."""
    filler = directory / "filler.bin"
    with open(filler, "wb", buffering=0) as f:
        chunk = b"\0" * 4096
        while True:
            try:
                f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    return filler


def leftovers(directory: Path, keep: set[str]) -> list[str]:
    """Files in ``directory`` other than ``keep`` (temp files left behind)."""
    return sorted(p.name for p in directory.iterdir() if p.name not in keep)


# --------------------------------------------------------- bad checkpoints


def _split_shard(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join_shard(header: dict | bytes, data: bytes) -> bytes:
    blob = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob + data


def _tensor_names(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _truncate_data(raw: bytes) -> bytes:
    return raw[: len(raw) - 700]


def _truncate_header(raw: bytes) -> bytes:
    return raw[:5]


def _header_len_beyond_file(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw) + 4096) + raw[8:]


def _overlap(raw: bytes) -> bytes:
    header, data = _split_shard(raw)
    a, b = _tensor_names(header)[:2]
    # b starts inside a; keep b's length so only the overlap is wrong.
    length = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
    start = header[a]["data_offsets"][0] + 2
    header[b]["data_offsets"] = [start, start + length]
    return _join_shard(header, data)


def _past_end(raw: bytes) -> bytes:
    header, data = _split_shard(raw)
    last = _tensor_names(header)[-1]
    b, e = header[last]["data_offsets"]
    header[last]["data_offsets"] = [b + 1024, e + 1024]
    return _join_shard(header, data)


def _non_utf8(raw: bytes) -> bytes:
    header, data = _split_shard(raw)
    blob = json.dumps(header, separators=(",", ":")).encode()
    return _join_shard(blob[:-1] + b',"\xff\xfe":1}', data)


def _non_json(raw: bytes) -> bytes:
    header, data = _split_shard(raw)
    blob = json.dumps(header, separators=(",", ":")).encode()
    return _join_shard(b"{not json" + blob[9:], data)


def _shape_mismatch(raw: bytes) -> bytes:
    header, data = _split_shard(raw)
    first = _tensor_names(header)[0]
    header[first]["shape"] = [d * 2 for d in header[first]["shape"]] or [2]
    return _join_shard(header, data)


def _dtype_mismatch(raw: bytes) -> bytes:
    header, data = _split_shard(raw)
    first = _tensor_names(header)[0]
    header[first]["dtype"] = "F32" if header[first]["dtype"] != "F32" else "F16"
    return _join_shard(header, data)


@dataclass(frozen=True)
class BadCheckpoint:
    """One way a shard can lie; ``problem`` is a regex the error must match
    (the safetensors library words the header problems, issue 11; the
    daemon's byte proof words the rest; both must say what is wrong)."""

    name: str
    corrupt: Callable[[bytes], bytes]
    problem: str


BAD_CHECKPOINTS = (
    BadCheckpoint("truncated_shard", _truncate_data, r"past the end of the file|ended early|file not fully covered"),
    BadCheckpoint("truncated_header", _truncate_header, r"truncated header|ended early \(5 of 8 bytes|header too small"),
    BadCheckpoint("header_len_beyond_file", _header_len_beyond_file,
                  r"runs past the end of the file|header length \d+ for a \d+-byte file|invalid header length"),
    BadCheckpoint("overlapping_offsets", _overlap, r"overlap|invalid offset for tensor"),
    BadCheckpoint("offsets_past_end", _past_end, r"past the end of the file|invalid offset for tensor"),
    BadCheckpoint("non_utf8_header", _non_utf8, r"not UTF-8|invalid UTF-8"),
    BadCheckpoint("non_json_header", _non_json, r"not (UTF-8 )?JSON|invalid JSON"),
    BadCheckpoint("shape_not_matching_bytes", _shape_mismatch, r"needs \d+ bytes|invalid shape, data type, or offset"),
    BadCheckpoint("dtype_not_matching_bytes", _dtype_mismatch, r"needs \d+ bytes|invalid shape, data type, or offset"),
)

BAD_SHARD = "model-00002-of-00002.safetensors"


def fresh_checkpoint(out: Path, seed: int = 0, shards: int = 2) -> Path:
    """The project's tiny fixture (bf16, ~1.3 MB), written by its own builder."""
    from fixtures.tiny import write_tiny

    return write_tiny(out, arch="llama", shards=shards, seed=seed)


def bad_checkpoint(out: Path, bad: BadCheckpoint, seed: int = 0) -> Path:
    """A two-shard tiny checkpoint whose second shard is corrupted by ``bad``."""
    ckpt = fresh_checkpoint(out, seed=seed)
    shard = ckpt / BAD_SHARD
    shard.write_bytes(bad.corrupt(shard.read_bytes()))
    return ckpt


# ------------------------------------------------------------- raw daemon


def short_tempdir(prefix: str = "pg-rel-") -> Path:
    """A private dir with a short path: AF_UNIX paths are capped at 107 bytes,
    and pytest's tmp_path plus ``<digest16>/rank0.sock`` can exceed it."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    # Outside pytest's tmp_path, so nothing else would ever remove it.
    atexit.register(shutil.rmtree, path, True)
    return path


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``preload-gate ARGS`` in a subprocess, as an operator runs it."""
    return subprocess.run(
        [PYTHON, "-m", "preload_gate", *args],
        capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO,
    )


def isolated_env(cache_dir: Path, socket_root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PRELOAD_GATE_CACHE"] = str(cache_dir)
    env["PRELOAD_GATE_SOCKET_ROOT"] = str(socket_root)
    env.pop("PRELOAD_GATE_EVENTS", None)
    return env


@dataclass
class RawDaemon:
    """A raw-stage daemon subprocess; ``ready`` is its one JSON ready line.

    ``entry="cli"`` runs ``preload-gate preload CKPT --stage raw`` as an
    operator does; ``entry="rank"`` runs the one-rank process
    (``python -m preload.daemon.rank``, config as JSON on stdin), which is
    what serves the socket either way and what a crash test kills.
    """

    checkpoint: Path
    socket_root: Path
    cache_dir: Path
    extra_args: tuple[str, ...] = ()
    entry: str = "rank"
    expected_digest: str | None = None
    proc: subprocess.Popen | None = None
    ready: dict = field(default_factory=dict)
    stderr_path: Path | None = None
    error_text: str = ""

    def start(self, timeout: float = 60) -> RawDaemon:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.stderr_path = self.cache_dir / f"daemon-{time.monotonic_ns()}.stderr"
        env = isolated_env(self.cache_dir, self.socket_root)
        with open(self.stderr_path, "wb") as err:
            if self.entry == "cli":
                self.proc = start_preload([str(self.checkpoint), "--stage", "raw", "--socket-root",
                                           str(self.socket_root), *self.extra_args], env=env, cwd=REPO, stderr=err)
            else:
                cfg = {"checkpoint": str(self.checkpoint), "stage": "raw", "transport": "shm",
                       "socket_root": str(self.socket_root), "expected_digest": self.expected_digest}
                self.proc = start_rank(cfg, env=env, cwd=REPO, stderr=err)
        self.ready = self._wait_ready(timeout)
        return self

    def start_failing(self, timeout: float = 60) -> tuple[int, str]:
        """Start a daemon that must refuse to serve: (exit code, its error text)."""
        try:
            self.start(timeout)
        except RuntimeError:
            assert self.proc is not None
            rc = self.proc.wait(timeout=10)
            return rc, self.error_text
        self.stop()
        raise AssertionError(f"daemon started and served: {self.ready}")

    def _wait_ready(self, timeout: float) -> dict:
        assert self.proc is not None
        other: list[str] = []  # stdout lines that are not JSON, for the failure message
        try:
            return wait_ready(self.proc, READY if self.entry == "cli" else RANK_READY, timeout, other.append)
        except NotReadyError as exc:
            failure, self.error_text = str(exc), exc.error
        if self.error_text and self.proc.poll() is None:
            # A rank exits 2 right after its rank_error line: wait for that, kill only a hang.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        if self.proc.poll() is None:
            self.kill()
        else:
            self.proc.wait()
        if not self.error_text:
            lines = [ln for ln in self.stderr().splitlines() if ln.strip()]
            self.error_text = lines[-1] if lines else ""
        raise RuntimeError(f"daemon did not become ready ({failure}); stdout={other!r} stderr={self.stderr()}")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path and self.stderr_path.exists() else ""

    @property
    def socket_dir(self) -> Path:
        return Path(self.ready["socket_dir"])

    @property
    def socket(self) -> Path:
        return self.socket_dir / "rank0.sock"

    @property
    def serving_pid(self) -> int:
        """The pid that owns the socket (the rank process, under a launcher too)."""
        return int(self.hello()["pid"])

    def hello(self) -> dict:
        from preload.client import DaemonClient

        c = DaemonClient.connect(self.socket_dir, 0, client="reliability-test")
        try:
            return dict(c.hello)
        finally:
            c.close()

    def stats(self) -> dict:
        from preload.client import DaemonClient

        c = DaemonClient.connect(self.socket_dir, 0, client="reliability-test")
        try:
            return c.stats()
        finally:
            c.close()

    @property
    def digest(self) -> str:
        return str(self.ready["digest"])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: a crash, leaving whatever a crash leaves (a stale socket)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10) -> int | None:
        """SIGTERM, the operator's clean shutdown; SIGKILL if it hangs."""
        if self.proc is None:
            return None
        stop_daemon(self.proc, timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode


# --------------------------------------------------------------- raw frames


def frame(obj: object) -> bytes:
    """One wire frame: 4-byte big-endian length, then JSON."""
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


def recv_frame(sock: socket.socket, timeout: float = 10) -> dict | None:
    """Read one frame; None when the peer closed the connection."""
    sock.settimeout(timeout)
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    (n,) = struct.unpack(">I", head)
    body = _recv_exact(sock, n)
    if body is None:
        return None
    return json.loads(body)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, n - len(buf), 16)
        except ConnectionResetError:
            return None
        for fd in fds:
            os.close(fd)
        if not msg:
            return None
        buf += msg
    return bytes(buf)


# ------------------------------------------------------------- other uids

# A client that connects as whoever runs it and reports what the daemon did,
# as one JSON line: {"uid", "connected", "reply" | "closed"} or {"uid", "error"}
# (the connect itself failed).
PEER_CLIENT = r"""
import json, os, socket, struct, sys
path = sys.argv[1]
out = {"uid": os.getuid()}
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    out["connected"] = True
    body = json.dumps({"cmd": "hello", "protocol": int(sys.argv[2]), "client": "peer"}).encode()
    s.sendall(struct.pack(">I", len(body)) + body)
    head = b""
    while len(head) < 4:
        c = s.recv(4 - len(head))
        if not c:
            break
        head += c
    if len(head) < 4:
        out["closed"] = True
    else:
        (n,) = struct.unpack(">I", head)
        body = b""
        while len(body) < n:
            c = s.recv(n - len(body))
            if not c:
                break
            body += c
        out["reply"] = json.loads(body)
except (ConnectionResetError, BrokenPipeError):
    out["closed"] = True  # the daemon hung up with our bytes unread
except OSError as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def run_as(uid: int, argv: list[str], keep_dac_override: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run ``argv`` as ``uid`` (gid the same, no groups).

    ``keep_dac_override`` keeps CAP_DAC_OVERRIDE as an ambient capability, so
    file modes (the 0700 directory, the 0600 socket) do not stop the client
    and the daemon's own peer-uid check is the only thing left to reject it.
    """
    prefix = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    if keep_dac_override:
        prefix += ["--inh-caps=+dac_override", "--ambient-caps=+dac_override"]
    return subprocess.run(prefix + argv, capture_output=True, text=True, timeout=timeout)


def setpriv_reason() -> str | None:
    """None if ``run_as`` works here, else why not (for an explicit skip)."""
    if os.geteuid() != 0:
        return "switching uid needs root"
    if shutil.which("setpriv") is None:
        return "setpriv(1) is not installed"
    probe = run_as(NOBODY, [PYTHON, "-c", "import os; print(os.getuid())"])
    if probe.returncode != 0 or probe.stdout.strip() != str(NOBODY):
        return f"setpriv could not run as uid {NOBODY}: {probe.stderr.strip()}"
    return None


# ------------------------------------------------------------ daemon state


def promote_checkpoint(checkpoint: Path, socket_root: Path, cache_dir: Path) -> str:
    """Promote in-process (the manifest a daemon checks its bytes against)."""
    from preload.promote import promote

    return promote(checkpoint, socket_root=socket_root, cache_dir=cache_dir, progress=False).digest


@contextlib.contextmanager
def promoted_daemon(checkpoint: Path, cache_dir: Path, *, expect_digest: bool = True) -> Iterator[RawDaemon]:
    """A raw daemon serving ``checkpoint``, promoted first into ``cache_dir``
    under a new short socket root (``daemon.socket_root``); stopped, and the
    socket root removed, on exit. ``expect_digest`` gives the daemon the
    promoted digest to check its bytes against; without it the daemon finds
    the manifest itself."""
    sockets = short_tempdir()
    try:
        digest = promote_checkpoint(checkpoint, sockets, cache_dir)
        daemon = RawDaemon(checkpoint, sockets, cache_dir, expected_digest=digest if expect_digest else None).start()
        try:
            yield daemon
        finally:
            daemon.stop()
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


def open_fds(pid: int) -> int:
    return psutil.Process(pid).num_fds()


def thread_count(pid: int) -> int:
    return psutil.Process(pid).num_threads()


def checkpoint_tensor_digests(checkpoint: Path) -> dict[str, str]:
    """SHA-256 of each tensor's bytes as the checkpoint files hold them."""
    import hashlib

    from pgbase.shards import read_header, shard_paths

    out = {}
    for path in shard_paths(checkpoint):
        header = read_header(path)
        with open(path, "rb") as f:
            for t in header.tensors:
                f.seek(t.begin)
                out[t.name] = hashlib.sha256(f.read(t.nbytes)).hexdigest()
    return out


def tensor_digests(tensors: dict) -> dict[str, str]:
    """SHA-256 of each attached tensor's bytes."""
    import hashlib

    import torch

    return {
        name: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, t in tensors.items()
    }


def attach_raw(socket_dir: Path, checkpoint: Path, digest: str, rank: int = 0) -> tuple[object, dict]:
    """The engine-side client path for a raw-stage rank: connect (socket
    checks), hello, get_state with the raw key, attach. Returns (attachment,
    tensors); the caller closes the attachment."""
    from preload.client import DaemonClient
    from preload.daemon.raw import raw_key

    c = DaemonClient.connect(socket_dir, rank, client="reliability-test")
    try:
        state = c.get_state(raw_key(checkpoint, digest, "shm"))
        att = state.attach()
        return att, att.tensors
    finally:
        c.close()


def served_tensor_digests(daemon: RawDaemon) -> dict[str, str]:
    att, tensors = attach_raw(daemon.socket_dir, daemon.checkpoint, daemon.digest)
    try:
        return tensor_digests(tensors)
    finally:
        att.close()  # type: ignore[attr-defined]
