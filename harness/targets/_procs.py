"""Child processes a target's ``prepare`` runs (a dump, a save, a daemon), with
their output in a log file, their own process group, and a deadline."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pgbase.errors import PreloadGateError
from pgbase.procs import stop_group


class PrepareError(PreloadGateError):
    """A target could not build its cache from the base."""


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra or {})
    return env




def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop a prepare child's whole process group: SIGTERM, then SIGKILL (10 s each)."""
    stop_group(proc, term_s=10.0, kill_s=10.0)


def run_all(cmds: Sequence[Sequence[str]], logs: Sequence[Path], timeout_s: float,
            env: dict[str, str] | None = None) -> None:
    """Run ``cmds`` side by side; all must exit 0 within ``timeout_s``, or
    PrepareError names the first that did not, with its log tail."""
    procs = []
    for cmd, log in zip(cmds, logs, strict=True):
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as f:
            procs.append(subprocess.Popen([sys.executable, *cmd] if cmd[0].startswith("-") else list(cmd),
                                          stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=child_env(env), start_new_session=True))
    deadline = time.monotonic() + timeout_s
    try:
        for proc, log in zip(procs, logs, strict=True):
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as exc:
                raise PrepareError(f"{' '.join(proc.args[:4])} did not finish in {timeout_s:.0f} s; "
                                   f"log {log}:\n{tail(log)}") from exc
            if rc != 0:
                raise PrepareError(f"{' '.join(proc.args[:4])} exited with code {rc}; log {log}:\n{tail(log)}")
    finally:
        for proc in procs:
            kill_group(proc)


def tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-chars:]
    except OSError:
        return ""
