"""``preload-gate preload``: start one daemon process per local rank.

Ranks run in their own processes (their own core binding, their own gloo
rank for TP), each started with a JSON config on stdin. The launcher waits
until every rank reports ``rank_ready``, then prints ONE line on stdout::

    {"event": "ready", "digest": ..., "socket_dir": ..., "ranks": [...], "pid": ...}

and stays up until SIGTERM/SIGINT, when it stops every rank (sockets,
locks and the emptied socket directory removed). If any rank fails, the
others are stopped and the first rank's error is raised. With
``exit_with_parent`` (``preload --exit-with-parent``, what the gate asks
for) it also stops when the process that started it dies, however it died
(:mod:`preload.daemon.parent`). While it serves, its socket root is listed
in the user's daemon registry (:mod:`preload.daemon.registry`), so a plain
``preload-gate status`` finds it under any ``--socket-root``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pgbase.digest_text import parse_digest
from pgbase.errors import ManifestError, PreloadGateError
from pgbase.ports import free_port
from preload.daemon.parent import INTERVAL_S as PARENT_POLL_S
from preload.daemon.parent import ParentWatch
from preload.daemon.placement import Parallelism, Placement, plan_local_ranks
from preload.daemon.ready import RANK_READY, NotReadyError, ReadyLines, start_rank
from preload.daemon.settings import DaemonSettings
from preload.identity.manifest import check_fresh, load_manifest
from preload.sockets import socket_dir
from preload.trust import require_unsafe_controls

if TYPE_CHECKING:
    from preload.daemon.fdstore_systemd import Inherited
    from preload.daemon.stage import RankConfig

log = logging.getLogger("preload.daemon")

READY_TIMEOUT_S = 900.0
POLL_S = PARENT_POLL_S  # how often the launcher looks at its ranks, its signals and its parent


class RankFailedError(PreloadGateError):
    """A rank process failed before it served."""


class StartInterruptedError(PreloadGateError):
    """Told to stop (a signal, or the parent died) before every rank served."""


@dataclass
class PreloadOptions(DaemonSettings):
    """The ``preload`` verb's options: what every rank gets (the daemon
    settings) and what the launcher itself uses."""

    parallel: Parallelism = field(default_factory=Parallelism)
    identity: str = "stat"
    expect_digest: str | None = None
    health_port: int | None = None
    health_host: str = "127.0.0.1"
    master_port: int | None = None
    exit_with_parent: bool = False


def expected_digest(opts: PreloadOptions) -> tuple[str | None, str]:
    """What the daemon is asked to serve, and where that came from."""
    if opts.expect_digest is not None:
        return parse_digest(opts.expect_digest, "--expect-digest"), "--expect-digest"
    if opts.identity == "pinned":
        raise ManifestError("--identity pinned needs --expect-digest (the digest printed by promote)")
    if opts.identity == "stat":
        manifest = load_manifest(opts.checkpoint)
        if manifest is not None:
            if opts.unsafe_identity is None:  # (the negative control serves under vLLM's hash instead)
                # The engine's own stat check, before a rank reads a byte: engines
                # would miss on a stale manifest, so the daemon refuses to start on
                # one with the line they would log. It proves every byte it serves,
                # so on tmpfs (stat-blind) it still compares the stats.
                check_fresh(opts.checkpoint, manifest, stat_blind_ok=True)
            return manifest.digest, "manifest"
    return None, "none"


def plan(opts: PreloadOptions) -> dict[str, Any]:
    placements = plan_local_ranks(opts.parallel)
    digest, source = expected_digest(opts)
    return {
        "checkpoint": os.path.realpath(opts.checkpoint),
        "stage": opts.stage, "transport": opts.transport,
        "expected_digest": digest, "digest_source": source,
        "socket_dir": str(socket_dir(digest, opts.socket_root)) if digest else None,
        "world_size": opts.parallel.world_size,
        "ranks": [p.to_json() for p in placements],
    }




def _cpu_slices(n: int) -> list[list[int] | None]:
    """Split this process's CPUs into ``n`` disjoint slices (None when too few)."""
    cpus = sorted(os.sched_getaffinity(0))
    if n <= 1 or len(cpus) < n:
        return [None] * n
    per = len(cpus) // n
    return [cpus[i * per : (i + 1) * per] for i in range(n)]


def rank_orders(opts: PreloadOptions) -> list[tuple[Placement, RankConfig]]:
    """Each local rank's placement and orders: the verb's daemon settings as
    they are (the engine's with the tp/pp/dp sizes added), the rank's place,
    the digest to prove, the group's rendezvous and the rank's CPUs."""
    # Imported here, not at the top: the preflight before a start must not
    # pay for torch (a refusal is meant to take milliseconds).
    from preload.daemon.stage import RankConfig

    placements = plan_local_ranks(opts.parallel)
    digest, _source = expected_digest(opts)
    port = opts.master_port or free_port()
    slices = _cpu_slices(len(placements)) if opts.stage != "raw" else [None] * len(placements)
    engine = {
        **opts.engine, "tp_size": opts.parallel.tp_size, "pp_size": opts.parallel.pp_size,
        "dp_size": opts.parallel.dp_size,
    }
    return [
        (p, RankConfig(**opts.daemon_settings(engine=engine), global_rank=p.global_rank,
                       local_rank=p.local_rank, tp_rank=p.tp_rank, pp_rank=p.pp_rank, dp_rank=p.dp_rank,
                       expected_digest=digest, distributed_init_method=f"tcp://127.0.0.1:{port}", cpus=cpus))
        for p, cpus in zip(placements, slices, strict=True)
    ]


class Launcher:
    def __init__(self, opts: PreloadOptions, inherited: Inherited | None = None) -> None:
        self.opts = opts
        # The fds systemd's store passed this process (the unit's main one): every rank gets them.
        self.inherited = inherited
        self.procs: list[tuple[Placement, subprocess.Popen[bytes]]] = []

    def start(self, interrupted: Callable[[], str | None] = lambda: None) -> dict[str, Any]:
        """Start every rank and wait for all of them; returns the ready event.

        ``interrupted`` is asked twice a second while waiting: a reason
        (a signal, the parent gone) stops the ranks and raises
        :class:`StartInterruptedError`; a model load can take minutes.
        """
        opts = self.opts

        def check_interrupted() -> None:
            reason = interrupted()
            if reason:
                raise StartInterruptedError(f"stopped before every rank served: {reason}")

        try:
            # Inside the try: a rank that cannot be started (no descriptor
            # left for its pipes) stops the ones already started.
            for p, cfg in rank_orders(opts):
                env = dict(os.environ)
                if cfg.cpus:
                    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cfg.cpus))
                fds: list[int] = []
                if self.inherited is not None:
                    env.update(self.inherited.child_env())
                    fds = self.inherited.all_fds()
                self.procs.append((p, start_rank(cfg.to_json(), env=env, pass_fds=fds)))
            lines = ReadyLines({p.global_rank: proc for p, proc in self.procs},
                               other=lambda line: print(line, file=sys.stderr))
            try:
                ready = lines.wait(RANK_READY, READY_TIMEOUT_S, on_idle=check_interrupted, poll_s=POLL_S)
            except NotReadyError as exc:
                if exc.timed_out:
                    raise RankFailedError(f"ranks not ready after {READY_TIMEOUT_S:g} s") from None
                if exc.error:
                    raise RankFailedError(f"rank {exc.key}: {exc.error}") from None
                raise RankFailedError(f"rank {exc.key} exited with code {exc.returncode} before serving "
                                      "(its log is above)") from None
        except BaseException:
            self.stop()
            raise
        ranks = [ready[p.global_rank] for p, _ in self.procs]
        digests = {r["digest"] for r in ranks}
        if len(digests) != 1:
            self.stop()
            raise RankFailedError(f"ranks serve different digests: {sorted(digests)}")
        return {
            "event": "ready", "digest": ranks[0]["digest"], "socket_dir": ranks[0]["socket_dir"],
            "ranks": ranks, "pid": os.getpid(), "stage": opts.stage, "transport": opts.transport,
        }

    def alive(self) -> bool:
        return all(proc.poll() is None for _, proc in self.procs)

    def handed_over(self) -> tuple[bool, bool]:
        """(every exited rank handed its arena over to a successor, every rank
        exited): ranks that hand over (``--take-over``) exit on their own."""
        from preload.daemon.settings import HANDED_OVER_EXIT

        codes = [proc.poll() for _, proc in self.procs]
        gone = [c for c in codes if c is not None]
        return all(c == HANDED_OVER_EXIT for c in gone), len(gone) == len(codes)

    def died(self) -> str:
        """The ranks that exited other than by handing over: ``rank N (pid P,
        exit code C | killed by SIGKILL)``, comma-separated."""
        from preload.daemon.settings import HANDED_OVER_EXIT

        out = []
        for p, proc in self.procs:
            code = proc.poll()
            if code is None or code == HANDED_OVER_EXIT:
                continue
            how = f"exit code {code}"
            if code < 0:
                try:
                    how = f"killed by {signal.Signals(-code).name}"
                except ValueError:
                    how = f"killed by signal {-code}"
            out.append(f"rank {p.global_rank} (pid {proc.pid}, {how})")
        return ", ".join(out) or "a rank"

    def stop(self, timeout_s: float = 15.0) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout_s
        for _, proc in self.procs:
            try:
                proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def preflight(opts: PreloadOptions, refuse_held: bool = True) -> dict[int, str]:
    """Every check that needs no weights, before a rank reads a byte
    (:mod:`preload.preflight`): the unsafe-control switch, the cache dir's
    trust, the manifest's freshness (the restart stat check), the checkpoint,
    ``--dtype``, the tensor-parallel size against the model's heads, the
    socket root and path lengths, the rank locks, the health port.
    ``preload --dry-run`` runs the same checks, and where another daemon
    holds a rank it gets the held ranks (rank -> pid) instead of a refusal."""
    from preload.preflight import check_cache_root, preflight_daemon

    if opts.unsafe_identity is not None:
        require_unsafe_controls("--unsafe-identity")
    check_cache_root(None)  # before a manifest is looked for in it
    digest, _source = expected_digest(opts)
    ranks = [p.global_rank for p in plan_local_ranks(opts.parallel)]
    return preflight_daemon(opts.checkpoint, opts.socket_root, ranks, digest, opts.health_host, opts.health_port,
                            dtype=str(opts.engine.get("dtype") or "auto"), tp_size=opts.parallel.tp_size,
                            pp_size=opts.parallel.pp_size, transport=opts.transport, engine=opts.engine,
                            refuse_held=refuse_held, stage=opts.stage)


def run(opts: PreloadOptions, out: Any = None) -> int:
    """Start, announce, serve until SIGTERM/SIGINT (or, with
    ``exit_with_parent``, until the starter dies); the ``preload`` verb."""
    from preload.daemon import registry

    # First: a parent that dies while we check or load is seen too.
    parent = ParentWatch.from_env() if opts.exit_with_parent else None
    out = out or sys.stdout
    # --take-over: a daemon holding these ranks is the one asked to hand over (rank.py).
    preflight(opts, refuse_held=not opts.take_over)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}

    def interrupted() -> str | None:
        if stop.is_set():
            return "SIGTERM/SIGINT"
        if parent is not None and parent.gone():
            return f"the process that started this daemon (pid {parent.parent}) is gone"
        return None

    from preload.daemon import fdstore_systemd

    # Under a unit that keeps fds, they come to this process (LISTEN_PID is
    # ours) and go on to the ranks, which adopt them (preload.daemon.rank).
    inherited = (fdstore_systemd.take_listen_fds()
                 if os.environ.get(fdstore_systemd.STORE_ENV) == "systemd" else None)
    launcher = Launcher(opts, inherited)
    health = None
    entry = None
    try:
        ready = launcher.start(interrupted)
        if opts.health_port is not None:
            from preload.daemon.health import HealthServer

            health = HealthServer(opts.health_host, opts.health_port, [r["socket"] for r in ready["ranks"]])
            health.start()
            ready["health"] = f"http://{opts.health_host}:{health.port}"
        entry = registry.register(os.path.dirname(ready["socket_dir"]), ready["digest"])
        out.write(json.dumps(ready) + "\n")
        out.flush()
        if inherited is not None:  # the ranks hold theirs now; systemd keeps its own copies
            inherited.close()
        fdstore_systemd.notify_ready(f"serving {ready['digest']}")  # Type=notify units: started
        while not stop.wait(POLL_S):
            if not launcher.alive():
                handed, every = launcher.handed_over()
                if handed and every:
                    log.warning("every rank handed its arena over to a successor (--take-over); exiting")
                    return 0
                if not handed:
                    # Named, with its pid and how it ended (issue 39): its log is the next place to look.
                    log.error("%s died; stopping the others", launcher.died())
                    return 1
                # Some ranks handed over: their peers' successors ask them next.
            reason = interrupted()
            if reason:  # the parent gone (a signal also ends the wait)
                log.error("stopping: %s", reason)
                return 1
        return 0
    finally:
        if os.environ.get("NOTIFY_SOCKET"):
            try:
                fdstore_systemd.sd_notify("STOPPING=1")
            except PreloadGateError as exc:
                log.warning("could not tell systemd the daemon is stopping: %s", exc)
        if inherited is not None:
            inherited.close()
        registry.unregister(entry)
        if health is not None:
            health.stop()
        launcher.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
