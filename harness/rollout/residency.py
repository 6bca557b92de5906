"""The daemons that hold a rollout's checkpoints, and the memory they must fit in.

A checkpoint is *resident* when a live daemon of ours serves its key under
the rollout's socket root: the daemon registry (:mod:`preload.daemon.registry`)
names the launcher pid, the rank socket answers its ``stats``. A daemon the
rollout starts is ``preload-gate preload CKPT --identity pinned
--expect-digest D`` (:func:`preload.daemon.ready.start_preload`) in a
session of its own and *without* ``--exit-with-parent``: the replicas need
it after the rollout exits, and a rollout killed with ``kill -9`` must not
take the old checkpoint's daemon (the instant rollback) with it. Releasing
one is SIGTERM to its launcher pid, a stop for good (the launcher stops its
ranks and removes their sockets), through :func:`pgbase.procs.stop_pid`,
which checks the start time so a reused pid is never signalled.

The memory check (:func:`check_budget`) runs before the second daemon
starts: the new checkpoint's resident size beside what is resident already
must fit the budget, else one line names the sizes and the two ways out.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.rollout.state import DaemonRecord
from pgbase.errors import PreloadGateError
from preload.deployment import DeploymentSettings

READY_TIMEOUT_S = 600.0
# vLLM's aliases for --dtype (vllm/config/model.py _STR_DTYPE_TO_TORCH_DTYPE).
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


class ResidencyError(PreloadGateError):
    """A daemon could not be started, found or released."""


class BudgetError(PreloadGateError):
    """Both checkpoints would not fit the memory budget."""


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _element_size(dtype: str) -> int | None:
    """Bytes per element of a vLLM ``--dtype`` name, by torch (None: auto or unknown)."""
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name == "auto":
        return None
    import torch

    t = getattr(torch, name, None)
    return int(torch.empty((), dtype=t).element_size()) if isinstance(t, torch.dtype) else None


def resident_estimate(checkpoint: str | os.PathLike[str], settings: DeploymentSettings) -> int:
    """Bytes a daemon of ``checkpoint`` holds, from its shard headers (no weight byte read).

    Floating-point tensors are counted at the deployment's ``--dtype`` (the
    loaded stage holds them converted); ``auto`` and every other tensor as
    stored. An estimate: quantized layouts and processing change it a little.
    """
    from pgbase.shards import read_header, shard_paths

    size = _element_size(settings.dtype)
    total = 0
    for p in shard_paths(checkpoint):
        for t in read_header(p).tensors:
            n = 1
            for d in t.shape:
                n *= d
            floating = t.dtype.startswith(("F", "BF")) and not t.dtype.startswith("F8")
            total += n * size if (size and floating) else t.nbytes
    return total


def check_budget(new_label: str, new_bytes: int, resident: Sequence[tuple[str, int]],
                 budget: int | None) -> str:
    """Refuse (:class:`BudgetError`) a preload of ``new_bytes`` that does not fit.

    With ``budget`` (``--memory-budget``): everything resident plus the new
    checkpoint must fit it. Without: the new checkpoint must fit what the
    kernel has available now (the resident ones are already counted out of
    it), against the least of every memory limit on this process
    (``preload.budget.memory_budget``: MemAvailable, the memory cgroup,
    strict overcommit, RLIMIT_AS), the same budget the daemon checks its
    arenas against. Returns the line that says what was compared, for the report.
    """
    held = sum(b for _, b in resident)
    names = ", ".join(f"{label} {_gib(b)}" for label, b in resident) or "nothing"
    if budget is not None:
        line = f"{new_label} needs {_gib(new_bytes)} beside {names} resident: {_gib(held + new_bytes)} of a " \
               f"{_gib(budget)} --memory-budget"
        ok = held + new_bytes <= budget
    else:
        from preload.budget import memory_budget

        free = memory_budget()
        line = f"{new_label} needs {_gib(new_bytes)} beside {names} resident; the memory budget is {free.describe()}"
        ok = new_bytes <= free.available
    if not ok:
        raise BudgetError(f"cannot hold both checkpoints: {line}; free memory or raise --memory-budget, or pass "
                          "--evict-first (stops the old checkpoint's daemon first: a rollback then reloads it "
                          "from disk)")
    return line


def find_daemon(key: str, socket_root: str | os.PathLike[str],
                fits: Callable[[dict[str, Any]], list[str]] | None = None,
                roots: Sequence[str | os.PathLike[str]] = ()) -> DaemonRecord | None:
    """The live registered daemon serving ``key`` (a digest) under
    ``socket_root`` (or one of ``roots``) whose rank 0 answers, and whose key
    ``fits`` (the fields it names that the replicas' key will not hold, from
    :func:`harness.rollout.identity.key_mismatch`: a daemon of the same
    weights under another config is not this checkpoint), or None."""
    from preload.daemon.health import rank_stats
    from preload.daemon.registry import live_entries
    from preload.sockets import socket_dir, socket_path

    wanted = [os.path.abspath(r) for r in (socket_root, *roots)]
    for e in live_entries().entries:
        root = os.path.abspath(e.socket_root)
        if e.digest != key or root not in wanted:
            continue
        stats = rank_stats(socket_path(socket_dir(key, root), 0))
        if stats is None or (fits is not None and fits(stats.get("key") or {})):
            continue
        return DaemonRecord(digest=key, checkpoint=str(stats.get("checkpoint") or ""), pid=e.pid,
                            start_ticks=e.start_ticks, socket_root=root, started_here=False,
                            resident_bytes=int(stats.get("resident_bytes") or 0))
    return None


@dataclass
class DaemonStart:
    """What starting a daemon needs: the checkpoint, the key it must serve, where it logs."""

    checkpoint: str
    key: str
    socket_root: str
    settings: DeploymentSettings
    log: Path
    unsafe_identity: str | None = None


def start_daemon(req: DaemonStart, timeout_s: float = READY_TIMEOUT_S) -> DaemonRecord:
    """Start a daemon on ``req.checkpoint`` proving ``req.key`` and wait until it serves."""
    from preload.daemon.ready import READY, NotReadyError, start_preload
    from preload.daemon.registry import start_ticks

    args = [req.checkpoint, "--socket-root", req.socket_root, *req.settings.engine_args()]
    if req.unsafe_identity:  # the negative control: keyed as vLLM keys, no byte proof
        args += ["--unsafe-identity", req.unsafe_identity]
    else:
        args += ["--identity", "pinned", "--expect-digest", req.key]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    req.log.parent.mkdir(parents=True, exist_ok=True)
    with open(req.log, "ab") as log:
        proc = start_preload(args, env=env, stderr=log, new_session=True)
    try:
        from preload.daemon.ready import wait_ready

        ready = wait_ready(proc, READY, timeout_s)
    except NotReadyError as exc:
        from pgbase.procs import stop_group

        stop_group(proc, term_s=15.0, kill_s=5.0)
        tail = req.log.read_bytes()[-1500:].decode("utf-8", "replace")
        why = "timed out" if exc.timed_out else f"exited with code {exc.returncode}"
        raise ResidencyError(f"the daemon on {req.checkpoint} {why} before it served; log {req.log}:\n{tail}") from None
    if ready.get("digest") != req.key:
        from pgbase.procs import stop_group

        stop_group(proc, term_s=15.0, kill_s=5.0)
        raise ResidencyError(f"the daemon on {req.checkpoint} serves {ready.get('digest')}, not {req.key}")
    # The launcher outlives us: its stdout pipe closes when we exit, and it
    # writes nothing more there (rank logs go to its stderr, the log file).
    pid = int(ready["pid"])
    return DaemonRecord(digest=req.key, checkpoint=req.checkpoint, pid=pid, start_ticks=start_ticks(pid),
                        socket_root=os.path.abspath(req.socket_root), started_here=True,
                        resident_bytes=sum(int(r.get("bytes") or 0) for r in ready.get("ranks", [])))


def release_daemon(d: DaemonRecord, timeout_s: float = 30.0) -> bool:
    """Stop the daemon for good (SIGTERM to its launcher); True when it is gone.

    A launcher whose start time differs from the record's is another
    process that reused the pid: it is left alone and counts as gone.
    """
    from pgbase.procs import stop_pid
    from preload.daemon.registry import start_ticks

    if d.start_ticks is not None and start_ticks(d.pid) != d.start_ticks:
        return True
    return stop_pid(d.pid, term_s=timeout_s, kill_s=10.0)


def socket_dir_gone(d: DaemonRecord) -> bool:
    """Whether the released daemon's socket directory is gone (nothing left behind)."""
    from preload.sockets import socket_dir

    return not socket_dir(d.digest, d.socket_root).exists()


__all__ = ["BudgetError", "DaemonStart", "ResidencyError", "check_budget", "find_daemon",
           "release_daemon", "resident_estimate", "socket_dir_gone", "start_daemon"]
