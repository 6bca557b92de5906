"""Helpers for the GPU tier: run a cuda-transport daemon, run engine processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from preload.daemon.ready import READY, NotReadyError, start_preload, stop_daemon, wait_ready

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("engine_probe.py")


def probe_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@contextmanager
def running_daemon(checkpoint: Path, ready_timeout_s: float = 600.0, args: tuple[str, ...] = (),
                   root: Path | None = None) -> Iterator[dict[str, Any]]:
    """``preload-gate preload CKPT --stage raw --transport cuda`` until the block ends.

    Yields the daemon's ready event plus ``proc`` (the launcher's Popen).
    """
    own_root = root is None
    root = root or Path(tempfile.mkdtemp(prefix="pg-gpu-"))
    os.chmod(root, 0o700)
    proc = start_preload([str(checkpoint), "--stage", "raw", "--transport", "cuda", "--identity", "full",
                          "--socket-root", str(root), *args], env=probe_env(), cwd=str(REPO))
    try:
        try:
            ready = wait_ready(proc, READY, ready_timeout_s)
        except NotReadyError:
            raise RuntimeError(f"daemon for {checkpoint} did not become ready (exit code {proc.poll()})") from None
        ready["proc"] = proc
        yield ready
    finally:
        stop_daemon(proc, 60)
        if own_root:
            shutil.rmtree(root, ignore_errors=True)


def probe(spec: dict[str, Any], timeout_s: float = 600.0, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one engine process; returns its last JSON line (result or error)."""
    out = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(spec)], capture_output=True, text=True,
        timeout=timeout_s, env={**probe_env(), **(env or {})}, cwd=str(REPO),
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise AssertionError(f"probe printed no result (exit {out.returncode}):\n{out.stderr[-4000:]}")
    result = json.loads(lines[-1])
    result["_stderr"] = out.stderr[-4000:]
    return result


def spec_for(ready: dict[str, Any], checkpoint: Path, action: str, **extra: Any) -> dict[str, Any]:
    return {"action": action, "checkpoint": str(checkpoint), "digest": ready["digest"],
            "socket_dir": ready["socket_dir"], **extra}


HOLDER = Path(__file__).with_name("fd_holder.py")


@contextmanager
def fd_holder() -> Iterator[tuple[str, dict[str, Any]]]:
    """A stand-in fd store (``fd_holder.py``: stdlib only, no CUDA) until the
    block ends; yields its socket path and its first line."""
    from fd_holder import request

    where = Path(tempfile.mkdtemp(prefix="pgh-"))  # short: AF_UNIX paths stop at 108 bytes
    os.chmod(where, 0o700)
    path = str(where / "holder.sock")
    proc = subprocess.Popen([sys.executable, str(HOLDER), path], stdout=subprocess.PIPE, text=True, env=probe_env())
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        yield path, first
    finally:
        try:
            request(path, {"cmd": "exit"})
        except OSError:
            pass
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(where, ignore_errors=True)
