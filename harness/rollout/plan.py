"""What a rollout is asked to do, checked before anything starts, and the state it continues.

Everything that needs no weights and starts nothing is refused here, one
line each (exit 2): checkpoints that are not directories, engine arguments
the rollout owns (``--port``, ``--host``, ``--load-format``,
``--model-loader-extra-config``), a restart template with an unknown
placeholder, a count of ``--gate-report``/``--golden`` that does not match
``--to``, a golden recorded under other settings or for another
config.json, and a state file that records another rollout.

The state a run continues (:func:`resolve_state`):

- no state file: a new rollout; every replica is new to it and is brought
  up on the first checkpoint (a supervised replica is started there; a
  command-driven one is restarted onto it, so that its load event, not the
  operator's word, says what it serves);
- an unfinished rollout of the same checkpoints and replicas: continued;
  anything else unfinished is refused, naming it (finish it, or ``--abort``);
- a finished one (done or failed) of the same replicas: a new rollout that
  inherits each replica (its process, what it serves) and the daemons still
  resident; a replica that serves neither ``--from`` nor nothing is refused.
  The finished file is kept beside it as ``rollout-<id>.json``.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

from harness.rollout.state import (
    Checkpoint,
    ReplicaRecord,
    RolloutState,
    StateError,
    label_of,
    load_state,
)
from pgbase.errors import PreloadGateError
from preload.deployment import DeploymentSettings, parse_engine_args

# Engine arguments a rollout sets itself, per replica.
OWNED_ARGS = ("--port", "--host", "--load-format", "--model-loader-extra-config", "--model")


class PlanError(PreloadGateError):
    """A rollout asked for something it cannot do."""


@dataclass
class Plan:
    """One run's request, checked."""

    from_ckpt: str
    to: list[str]
    urls: list[str]
    engine_args: list[str]
    settings: DeploymentSettings
    state_dir: Path
    gate_reports: list[str | None] = field(default_factory=list)
    goldens: list[str | None] = field(default_factory=list)
    from_golden: str | None = None
    no_gate: bool = False

    @property
    def state_path(self) -> Path:
        return self.state_dir / "state.json"


def check_engine_args(engine_args: list[str]) -> DeploymentSettings:
    """The deployment settings among ``engine_args``; refuses the arguments the rollout sets."""
    for a in engine_args:
        name = a.split("=", 1)[0]
        if name in OWNED_ARGS:
            raise PlanError(f"engine argument {name} is set by the rollout for each replica (its --replica-url or "
                            "--port, and the verified_cache loader); drop it from the arguments after --")
    return parse_engine_args(engine_args)


def replica_urls(count: int | None, port: int | None, host: str, urls: list[str] | None) -> list[str]:
    """``--replica-url`` as given, or ``--replicas N`` on ``--port P``, ``P+1``, ..."""
    if urls and count:
        raise PlanError("give --replicas N (with --port) or --replica-url URL per replica, not both")
    if urls:
        if len(set(urls)) != len(urls):
            raise PlanError("a --replica-url is given twice")
        return [u.rstrip("/") for u in urls]
    if not count:
        raise PlanError("name the replicas: --replicas N --port P (this host, ports P..P+N-1) or --replica-url URL each")
    if port is None:
        raise PlanError("--replicas needs --port (the first replica's port)")
    if port + count - 1 > 65535:
        raise PlanError(f"--port {port} with {count} replicas runs past port 65535")
    return [f"http://{host}:{port + i}" for i in range(count)]


def check_checkpoints(from_ckpt: str, to: list[str]) -> tuple[str, list[str]]:
    """Real paths; each must be a directory, and no checkpoint follows itself."""
    from preload.preflight import check_checkpoint

    out = []
    for flag, p in [("--from", from_ckpt), *(("--to", t) for t in to)]:
        if not os.path.isdir(p):
            raise PlanError(f"{flag} {p} is not a directory; name the checkpoint directory")
        check_checkpoint(p)
        out.append(os.path.realpath(p))
    for a, b in zip(out, out[1:], strict=False):
        if a == b:
            raise PlanError(f"{b} follows itself in the sequence; each --to must be another checkpoint")
    return out[0], out[1:]


def per_target(values: list[str] | None, n: int, flag: str) -> list[str | None]:
    if not values:
        return [None] * n
    if len(values) != n:
        raise PlanError(f"give one {flag} per --to ({n}), in order, not {len(values)}")
    return list(values)


def check_golden(path: str, digest: str, checkpoint: str, settings: DeploymentSettings, label: str) -> None:
    """A golden must be keyed by the checkpoint's digest, settings and config (canaries.fit)."""
    from canaries.fit import check_fit
    from canaries.golden import load_golden

    g = load_golden(path)
    if g.digest != digest:
        raise PlanError(f"golden {path} is for digest {g.digest[:16]}, {label} ({checkpoint}) is {digest[:16]}")
    check_fit(g, {k: v for k, v in settings.to_json().items()}, checkpoint)


def check_evidence_files(plan: Plan) -> None:
    """Each ``--gate-report`` and golden read and checked as far as it goes
    without the checkpoints' digests, before anything is hashed: a missing
    or malformed file is refused here, not after both checkpoints were
    promoted (raises ReportRefusedError, GoldenError: exit 2)."""
    from canaries.golden import load_golden
    from harness.rollout.evidence import read_gate_report

    for report in plan.gate_reports:
        if report is not None:
            read_gate_report(report)
    for golden in [*plan.goldens, plan.from_golden]:
        if golden is not None:
            load_golden(golden)


def _same_plan(state: RolloutState, sequence: list[Checkpoint], urls: list[str]) -> bool:
    return [c.key for c in state.sequence] == [c.key for c in sequence] and [r.url for r in state.replicas] == urls


def resolve_state(plan: Plan, sequence: list[Checkpoint], driver: dict[str, object],
                  state: RolloutState | None = None) -> RolloutState:
    """The state this run continues or starts (see the module docstring)."""
    state = state if state is not None else load_state(plan.state_path)
    records = [ReplicaRecord(i, u, events_file=str(plan.state_dir / f"replica-{i}.events.jsonl"))
               for i, u in enumerate(plan.urls)]
    if state is None:
        return RolloutState.new(sequence, records, plan.settings.to_json(), plan.engine_args, dict(driver))
    labels = " -> ".join(f"{label_of(i)} {c.path}" for i, c in enumerate(state.sequence))
    if state.status == "running":
        if _same_plan(state, sequence, plan.urls):
            for old, new in zip(state.sequence, sequence, strict=True):
                old.golden = new.golden or old.golden
            return state
        raise PlanError(f"{plan.state_path} records an unfinished rollout ({labels}, replicas "
                        f"{', '.join(r.url for r in state.replicas)}); run it again with the same --from/--to and "
                        "replicas to continue it, or add --abort to roll its replicas back")
    if [r.url for r in state.replicas] != plan.urls:
        raise PlanError(f"{plan.state_path} records replicas {', '.join(r.url for r in state.replicas)}; this run "
                        f"names {', '.join(plan.urls)}: use another --state-dir for another fleet")
    for r in state.replicas:
        if r.serving is not None and r.serving != sequence[0].key:
            raise PlanError(f"replica {r.index} ({r.url}) serves {r.serving[:16]} by {plan.state_path}, not --from "
                            f"{sequence[0].path} ({sequence[0].key[:16]}); roll from what it serves")
    shutil.copy2(plan.state_path, plan.state_dir / f"rollout-{state.id}.json")
    fresh = RolloutState.new(sequence, [replace(r, target=None) for r in state.replicas], plan.settings.to_json(),
                             plan.engine_args, dict(driver))
    fresh.fleet_id = state.fleet_id or state.id
    from preload.daemon.registry import start_ticks

    # The daemons still there (the same process: pid and start time), for the rotation rule.
    fresh.daemons = [d for d in state.daemons if not d.released and start_ticks(d.pid) == d.start_ticks]
    for r in fresh.replicas:
        if r.phase != "serving" or r.serving is None:
            r.phase, r.serving = "down", None  # brought up again on --from
        fresh.timeline.append({"t": fresh.created, "replica": r.index, "phase": r.phase, "serving": r.serving,
                               "target": None, "note": "inherited"})
    return fresh


__all__ = ["OWNED_ARGS", "Plan", "PlanError", "StateError", "check_checkpoints", "check_engine_args",
           "check_evidence_files", "check_golden", "per_target", "replica_urls", "resolve_state"]
