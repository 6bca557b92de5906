"""One run of ``preload-gate rollout``: checks, lock, digests, evidence, rotation, report.

:mod:`harness.rollout.cli` parses the flags; this module does what they
ask in the order that keeps a refusal cheap (see the cli module's
docstring), and owns the pieces one run ties together: the host lock, the
driver, the goldens, the load generator, the metrics file and the report.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from canaries.golden import Golden, load_golden
from harness.rollout.identity import identity, what_differs
from harness.rollout.plan import (
    Plan,
    PlanError,
    check_checkpoints,
    check_engine_args,
    check_evidence_files,
    check_golden,
    per_target,
    replica_urls,
    resolve_state,
)
from harness.rollout.state import (
    Checkpoint,
    HostLock,
    RolloutState,
    label_of,
    load_state,
    save_state,
)

Progress = Callable[[str, str], None]


class GateBlockedError(Exception):
    """The gate run here blocked a checkpoint (exit 1, not a refusal)."""


def default_state_dir() -> Path:
    from preload.identity.manifest import default_cache_dir

    return default_cache_dir() / "rollout"


def host_lock() -> HostLock:
    """One rollout per host (per user's cache dir), whatever ``--state-dir`` each names."""
    from preload.identity.manifest import default_cache_dir

    return HostLock(default_cache_dir() / "rollout.lock")


class Flow:
    """One run; :meth:`run` returns ``(exit code, report document or None)``."""

    def __init__(self, args: argparse.Namespace, engine_args: list[str], progress: Progress | None) -> None:
        self.args, self.engine_args, self.progress = args, engine_args, progress
        self.report_paths: dict[str, Path] | None = None
        self.evidence: list[dict[str, Any]] = []
        self.state_dir = Path(os.path.abspath(args.state_dir)) if args.state_dir else default_state_dir()

    def note(self, phase: str, message: str) -> None:
        if self.progress is not None:
            self.progress(phase, message)

    # -- checks that read no weights ------------------------------------------

    def plan(self) -> Plan:
        a = self.args
        if not a.from_ckpt or not a.to:
            raise PlanError("name the checkpoints: --from CURRENT --to NEW [--to NEXT ...]")
        settings = check_engine_args(self.engine_args)
        urls = replica_urls(a.replicas, a.port, a.host, a.replica_urls)
        if a.restart_command is None and a.serve_command is not None and not shlex.split(a.serve_command):
            raise PlanError("--serve-command is empty")
        if a.restart_command is not None:
            from harness.rollout.command import check_template

            check_template(a.restart_command)
        if a.no_gate and a.gate_report:
            raise PlanError("--no-gate and --gate-report contradict each other; give one")
        if a.unsafe_identity:
            from preload.trust import require_unsafe_controls

            require_unsafe_controls("--unsafe-identity")
        from_ckpt, to = check_checkpoints(a.from_ckpt, a.to)
        plan = Plan(from_ckpt, to, urls, self.engine_args, settings, self.state_dir,
                    gate_reports=per_target(a.gate_report, len(to), "--gate-report"),
                    goldens=per_target(a.golden, len(to), "--golden"), from_golden=a.from_golden, no_gate=a.no_gate)
        check_evidence_files(plan)
        return plan

    def _prepare_dirs(self) -> None:
        from preload.trust import ensure_private_dir

        self.state_dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        ensure_private_dir(self.state_dir, "rollout state dir")

    # -- digests and evidence (reads weights; may run engines) ----------------

    def _golden_for(self, plan: Plan, i: int, path: str, digest: str, prev: str, key: str) -> str | None:
        label = label_of(i)
        if i == 0:
            if plan.from_golden:
                check_golden(plan.from_golden, digest, path, plan.settings, label)
            return plan.from_golden
        given, report = plan.goldens[i - 1], plan.gate_reports[i - 1]
        if plan.no_gate:
            if given:
                check_golden(given, digest, path, plan.settings, label)
                return given
            return self._record(path, digest, plan, label, key)
        from harness.rollout.evidence import verify_gate_report

        if report is None:
            report = self._gate(path, prev, plan, label, key)
        from preload.identity.config import config_digest

        ev = verify_gate_report(report, digest, plan.settings, golden=given,
                                base_config_differs=config_digest(prev) != config_digest(path))
        # The golden answers for this config and these answer files, not only these weights.
        check_golden(str(ev.golden), digest, path, plan.settings, label)
        self.evidence.append(ev.to_json())
        self.note("evidence", f"{label}: gate report {ev.report} binds to {digest[:16]}, the settings and its golden")
        return str(ev.golden)

    def _record(self, path: str, digest: str, plan: Plan, label: str, key: str) -> str:
        """The golden recorded here for the checkpoint ``key`` (its identity: a
        config-only change gets its own), reused only while it still fits."""
        from canaries.golden import record
        from pgbase.errors import PreloadGateError

        out = self.state_dir / f"golden-{key[:16]}.json"
        if out.exists():
            try:
                check_golden(str(out), digest, path, plan.settings, label)
                return str(out)
            except PreloadGateError:
                pass  # another config, settings or answer files: recorded again
        self.note("golden", f"{label}: recording the golden from an auto engine on {path}")
        record(path, out, settings=plan.settings)
        return str(out)

    def _gate(self, path: str, prev: str, plan: Plan, label: str, key: str) -> str:
        from harness.gate import GateOptions, run_gate
        from harness.report import write_reports

        out = self.state_dir / f"gate-{key[:16]}"
        self.note("gate", f"{label}: no --gate-report; running the promotion gate on {path} (base {prev})")
        report = run_gate(GateOptions(candidate=path, base=prev, settings=plan.settings, report_dir=str(out),
                                      progress=self.progress))
        write_reports(report.to_json(), out)
        if report.exit_code == 1:
            raise GateBlockedError(f"the gate BLOCKED {label} ({path}); nothing was rolled; see {out / 'report.md'}")
        if report.exit_code != 0:
            raise PlanError(f"the gate could not run on {label} ({path}): {report.error or 'see ' + str(out)}")
        return str(out)

    def _digest(self, path: str, label: str, socket_root: str) -> str:
        """The checkpoint's digest: its manifest's when the restart stat check finds
        it fresh (promoted already: "if needed"), else promoted now (hashed)."""
        from pgbase.errors import PreloadGateError
        from preload.identity.manifest import resolve_digest
        from preload.promote import promote

        try:
            digest = resolve_digest(path, "stat").digest
        except PreloadGateError:  # no manifest, a stale one, or a filesystem stat cannot judge
            pass
        else:  # (a daemon makes its socket directory itself)
            self.note("promote", f"{label}: {path} (promoted: {digest[:16]}, manifest fresh)")
            return digest
        self.note("promote", f"{label}: {path}")
        return promote(path, socket_root=socket_root, progress=False).digest

    def sequence(self, plan: Plan, socket_root: str) -> list[Checkpoint]:
        """Each checkpoint with its digest, identity and golden. A step onto the
        same identity (weights, config.json, answer files) is refused before
        any gate, golden or daemon: there is nothing to roll out."""
        from preload.identity.anchors import header_only_digest
        from preload.identity.config import config_digest

        paths = [plan.from_ckpt, *plan.to]
        # Every step's identity first: a step onto its predecessor's is refused
        # before the first gate or golden of any step.
        found: list[tuple[str, str, str, str]] = []  # path, digest, identity, the digest engines ask for
        for i, path in enumerate(paths):
            digest = self._digest(path, label_of(i), socket_root)
            ask = header_only_digest(path) if (self.args.unsafe_identity and i > 0) else digest
            key = identity(ask, path)
            if i and key == found[-1][2]:
                raise PlanError(f"--to {path} is the same checkpoint as {label_of(i - 1)} ({found[-1][0]}): the same "
                                f"weights ({digest[:16]}), config.json and answer files; nothing to roll out, and "
                                "nothing was changed (daemons and replicas are as they were)")
            found.append((path, digest, key, ask))
        out: list[Checkpoint] = []
        for i, (path, digest, key, ask) in enumerate(found):
            if i:
                self.note("identity", f"{label_of(i)} differs from {label_of(i - 1)} in "
                          + (", ".join(what_differs(paths[i - 1], path)) if ask == out[-1].ask else "its weights"))
            # The socket directory is keyed by the digest: a second checkpoint of
            # the same weights (another config) gets a daemon of its own elsewhere.
            root = os.path.join(socket_root, f"id-{key[:12]}") if any(c.ask == ask for c in out) else ""
            golden = self._golden_for(plan, i, path, digest, paths[i - 1] if i else "", key)
            out.append(Checkpoint(path, digest, golden, key, ask=ask, config_digest=config_digest(path),
                                  socket_root=root))
        if self.args.load_gen and out[0].golden is None:
            out[0].golden = self._record(out[0].path, out[0].digest, plan, "A", out[0].key)
        return out

    # -- the run ---------------------------------------------------------------

    def driver(self, state: RolloutState) -> Any:
        a = self.args
        if a.restart_command is not None:
            from harness.rollout.command import CommandDriver

            return CommandDriver(a.restart_command, state.engine_args)
        from harness.rollout.supervised import DEFAULT_SERVE, SupervisedDriver

        serve = shlex.split(a.serve_command) if a.serve_command else list(DEFAULT_SERVE)
        s = state.settings
        ranks = int(s.get("tensor_parallel_size", 1)) * int(s.get("pipeline_parallel_size", 1)) * \
            int(s.get("data_parallel_size", 1))
        return SupervisedDriver(serve, state.engine_args, self.state_dir, state.fleet_id, ranks=ranks)

    def run(self) -> tuple[int, dict[str, Any] | None]:
        from harness.rollout.plan import StateError

        if self.args.stop or self.args.abort:
            if not (self.state_dir / "state.json").is_file():  # refused before any directory or lock is made
                raise StateError(f"--{'stop' if self.args.stop else 'abort'}: no rollout state at "
                                 f"{self.state_dir / 'state.json'}")
            if self.args.stop:
                return self.stop()
        plan = None if self.args.abort else self.plan()
        made = not self.state_dir.exists()
        self._prepare_dirs()
        try:
            return self._run_locked(plan)
        except PlanError:
            if made:  # a refused plan (identical content) leaves no state dir behind
                with contextlib.suppress(OSError):
                    self.state_dir.rmdir()
            raise

    def _run_locked(self, plan: Plan | None) -> tuple[int, dict[str, Any] | None]:
        from harness.rollout.plan import StateError

        with host_lock():
            existing = load_state(self.state_dir / "state.json")
            if self.args.abort:
                if existing is None or existing.status != "running":
                    raise StateError(f"--abort: {self.state_dir / 'state.json'} records no unfinished rollout")
                return self.rotate(existing, abort=True)
            assert plan is not None
            if existing is not None and existing.status == "running" and \
                    [c.path for c in existing.sequence] != [plan.from_ckpt, *plan.to]:
                resolve_state(plan, [Checkpoint(p, "") for p in [plan.from_ckpt, *plan.to]], {}, existing)
            socket_root = self._socket_root()
            seq = self.sequence(plan, socket_root)
            driver_desc = self.driver(RolloutState.new(seq, [], {}, [], {})).describe()
            state = resolve_state(plan, seq, driver_desc, existing)
            return self.rotate(state)

    def _socket_root(self) -> str:
        from preload.sockets import default_socket_root

        return os.path.abspath(self.args.socket_root or default_socket_root())

    def rotate(self, state: RolloutState, abort: bool = False) -> tuple[int, dict[str, Any]]:
        from harness.rollout.loadgen import LoadGenerator
        from harness.rollout.metrics import RolloutMetrics
        from harness.rollout.report import build, write_report
        from harness.rollout.runner import Rollout, RolloutOptions
        from harness.rollout.switch import SwitchOptions
        from preload.deployment import DeploymentSettings

        a = self.args
        goldens: dict[str, Golden | None] = {c.key: load_golden(c.golden) if c.golden else None for c in state.sequence}
        opts = RolloutOptions(
            socket_root=self._socket_root(), state_path=self.state_dir / "state.json",
            settings=DeploymentSettings.from_json(state.settings),
            switch=SwitchOptions(ready_timeout_s=a.ready_timeout, canary_timeout_s=a.canary_timeout,
                                 max_near_ties=a.max_near_ties),
            soak_s=a.soak, keep_from=a.keep_from, evict_first=a.evict_first, memory_budget=a.memory_budget,
            unsafe_identity=a.unsafe_identity, abort=abort)
        metrics = RolloutMetrics(a.metrics_textfile or self.state_dir / "rollout.prom")
        loadgen: list[LoadGenerator] = []

        def start_load() -> None:
            if a.load_gen:
                gs = {state.label(k): g for k, g in goldens.items() if g is not None}
                loadgen.append(LoadGenerator([r.url for r in state.replicas], gs, rate=a.load_rate).start())
                self.note("load", f"load generator on {len(state.replicas)} replicas")

        def on_save(_: RolloutState) -> None:
            if loadgen:
                metrics.record_requests(loadgen[0].snapshot())

        for r in state.replicas:
            if not any(e.get("replica") == r.index for e in state.timeline):
                state.timeline.append({"t": state.created, "replica": r.index, "phase": r.phase,
                                       "serving": r.serving, "target": None, "note": "start"})
        rollout = Rollout(state, self.driver(state), goldens, opts, self.progress, metrics, on_save, start_load)
        try:
            code = rollout.run()
        finally:
            counts = loadgen[0].stop().to_json() if loadgen else None
            if loadgen:
                metrics.record_requests(loadgen[0].snapshot())
                metrics.write()
            doc = build(state, counts, self.evidence)
            self.report_paths = write_report(doc, a.report or self.state_dir)
        return code, doc

    def stop(self) -> tuple[int, dict[str, Any] | None]:
        """``--stop``: every supervised replica of the state stopped, the daemons it started released."""
        from harness.rollout.residency import release_daemon

        path = self.state_dir / "state.json"
        with host_lock():
            state = load_state(path)
            if state is None:  # removed since run() looked
                raise PlanError(f"--stop: no rollout state at {path}")
            driver = self.driver(state)
            for r in state.replicas:
                self.note("stop", f"replica {r.index} ({r.url})")
                driver.stop(r)
                state.mark(r, "down", None, note="--stop")
            for d in state.daemons:
                if d.started_here and not d.released:
                    self.note("stop", f"daemon pid {d.pid} ({d.checkpoint})")
                    d.released = release_daemon(d)
            save_state(path, state)
        return 0, None
