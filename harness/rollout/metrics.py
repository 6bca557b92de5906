"""Prometheus metrics of a rollout, as a textfile.

Why a textfile and not an HTTP endpoint: a rollout is a batch job that
ends, and what alerting needs most is its last word (failed, rolled back,
replica 1 down), which an endpoint takes with it when the process exits;
a rollout killed with ``kill -9`` would leave a scrape target that is
simply gone. node_exporter's textfile collector reads the file on every
scrape (``--collector.textfile.directory``; point ``--metrics-textfile``
into it), and prometheus_client's :func:`write_to_textfile` replaces it
atomically (a temporary file, then a rename), so a scrape never reads half.
The file is rewritten at every state change.

Families (prefix ``preload_gate_rollout_``):

- ``info{rollout,host,from,to}`` 1, ``status{status}`` one-hot
  (running/done/failed), ``step`` and ``steps``;
- ``replica_phase{replica,phase}`` one-hot per replica (serving, switching,
  rolling_back, down) and ``replica_serving{replica,checkpoint,digest}`` 1
  for what each serves;
- ``switches_total{outcome}`` (ok / each failure reason, rollbacks as
  ``rollback_ok``/``rollback_failed``) and ``switch_seconds{phase}``, a
  histogram of the phases of each switch (restart, ready, canary, switch);
- ``requests_total{outcome}`` from the load generator (answered, refused,
  wrong), when one runs;
- ``last_update_timestamp_seconds``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, write_to_textfile

from harness.rollout.state import PHASES, STATUSES, RolloutState

PREFIX = "preload_gate_rollout_"
_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class RolloutMetrics:
    """The rollout's metric families, written to ``path`` by :meth:`write`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.registry = r = CollectorRegistry()
        self.info = Gauge(PREFIX + "info", "the rollout this file describes", ["rollout", "host", "from", "to"],
                          registry=r)
        self.status = Gauge(PREFIX + "status", "1 for the rollout's status", ["status"], registry=r)
        self.step = Gauge(PREFIX + "step", "index of the checkpoint being rolled onto", registry=r)
        self.steps = Gauge(PREFIX + "steps", "checkpoints in the sequence after the first", registry=r)
        self.phase = Gauge(PREFIX + "replica_phase", "1 for each replica's phase", ["replica", "phase"], registry=r)
        self.serving = Gauge(PREFIX + "replica_serving", "1 for the checkpoint each replica serves",
                             ["replica", "checkpoint", "digest"], registry=r)
        self.switches = Counter(PREFIX + "switches", "replica switches by outcome", ["outcome"], registry=r)
        self.seconds = Histogram(PREFIX + "switch_seconds", "seconds of each phase of a switch", ["phase"],
                                 buckets=_BUCKETS, registry=r)
        self.requests = Counter(PREFIX + "requests", "load generator requests by outcome", ["outcome"], registry=r)
        self.updated = Gauge(PREFIX + "last_update_timestamp_seconds", "when this file was written", registry=r)
        self._requests_seen: dict[str, int] = {}

    def record_switch(self, result: dict[str, Any]) -> None:
        outcome = ("rollback_" if result.get("rollback") else "") + ("ok" if result.get("ok") else
                                                                       result.get("reason") or "failed")
        if result.get("rollback") and not result.get("ok"):
            outcome = "rollback_failed"
        self.switches.labels(outcome).inc()
        for phase, s in (result.get("seconds") or {}).items():
            if phase != "total":
                self.seconds.labels(phase).observe(float(s))

    def record_requests(self, counts: dict[str, int]) -> None:
        """Bring ``requests_total`` up to the load generator's running ``counts``."""
        for outcome, n in counts.items():
            delta = n - self._requests_seen.get(outcome, 0)
            if delta > 0:
                self.requests.labels(outcome).inc(delta)
                self._requests_seen[outcome] = n

    def update(self, state: RolloutState) -> None:
        self.info.clear()
        self.info.labels(state.id, state.host, state.sequence[0].digest[:16], state.sequence[-1].digest[:16]).set(1)
        for s in STATUSES:
            self.status.labels(s).set(1 if state.status == s else 0)
        self.step.set(state.step)
        self.steps.set(len(state.sequence) - 1)
        self.serving.clear()
        for rep in state.replicas:
            for p in PHASES:
                self.phase.labels(str(rep.index), p).set(1 if rep.phase == p else 0)
            if rep.serving is not None and rep.phase == "serving":
                self.serving.labels(str(rep.index), state.label(rep.serving), rep.serving[:16]).set(1)
        self.updated.set(time.time())

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_to_textfile(str(self.path), self.registry)
