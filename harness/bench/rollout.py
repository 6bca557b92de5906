"""Rollout row: what a replica switch and a rollback cost with both checkpoints resident.

``rollout_switch``: two supervised replicas (real vLLM OpenAI servers) of
the tiny fixture (or ``model=...``) on A, daemons holding A and B. Side by
side in one run, each timed from the stop of the replica to its canary
passing (:func:`harness.rollout.switch.switch`, the rollout's own step):

1. replica 0 onto B with ``--load-format auto`` (weights from disk): the
   anchor of a switch;
2. replica 0 back onto A with ``auto``: the anchor of a rollback (a disk
   reload of A);
3. the whole rollout A -> B of both replicas through
   :class:`harness.rollout.runner.Rollout` (``verified_cache`` from B's
   daemon, ``fallback: false``, load event and canary checked): each
   replica's switch is "ours", and the rollout's wall time is reported;
4. replica 0 onto A, still resident: "ours" of the rollback.

Seven server starts; minutes on two cores. Figures are per-replica switch
seconds (anchor / ours) and rollback seconds (anchor / ours); the whole
rollout's seconds, every timed switch's phases (restart, ready, canary;
the anchors' too) and the machine's load average go in ``details``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.bench import BenchError, BenchOptions, BenchResult, Figure, bench_row, scratch
from harness.bench import params as P

_ENGINE = ["--dtype", "bfloat16", "--max-model-len", "256", "--enforce-eager", "--gpu-memory-utilization", "0.1"]
_MODEL = "tiny, smollm2 or a checkpoint directory"


def _timed(res: Any, what: str) -> float:
    if not res.ok:
        raise BenchError(f"{what} failed: {res.reason}: {res.detail[:400]}")
    return float(res.seconds["switch"])


@bench_row("rollout_switch", "replica switch and rollback: resident checkpoint (hit) vs auto from disk",
           heavy="seven vLLM server starts, two daemons and four golden canaries (10-20 min on 2 cores)",
           params=(P.Param("model", P.model, "tiny", _MODEL),))
def rollout_switch(options: BenchOptions) -> list[BenchResult]:
    from canaries.golden import record
    from fixtures.mutations import by_name
    from harness.bench.daemon import _checkpoint
    from harness.rollout.replicas import Target
    from harness.rollout.residency import DaemonStart, release_daemon, start_daemon
    from harness.rollout.runner import Rollout, RolloutOptions
    from harness.rollout.state import Checkpoint, ReplicaRecord, RolloutState, save_state
    from harness.rollout.supervised import DEFAULT_SERVE, SupervisedDriver
    from harness.rollout.switch import SwitchOptions, switch
    from pgbase.ports import free_port
    from preload.deployment import parse_engine_args
    from preload.promote import promote

    work = scratch(options, "pg-bench-ro-")
    root = Path(tempfile.mkdtemp(prefix="pg-bro-", dir="/tmp"))
    old_cache = os.environ.get("PRELOAD_GATE_CACHE")
    os.environ["PRELOAD_GATE_CACHE"] = str(work / "cache")  # daemons, replicas and the registry agree
    settings = parse_engine_args(_ENGINE)
    daemons, driver, records = [], None, []
    try:
        a = _checkpoint(options, work)
        b = by_name("finetune_noise").apply(a, work / "b")
        seq = []
        for label, ckpt in (("A", a), ("B", b)):
            digest = promote(ckpt, socket_root=root, progress=False).digest
            golden = work / f"golden-{label}.json"
            record(str(ckpt), golden, settings=settings)
            seq.append(Checkpoint(str(ckpt), digest, str(golden)))
        from canaries.golden import load_golden

        goldens = {c.key: load_golden(str(c.golden)) for c in seq}
        for c in seq:
            daemons.append(start_daemon(DaemonStart(c.path, c.key, str(root), settings, work / f"d-{c.key[:8]}.log")))
        records = [ReplicaRecord(i, f"http://127.0.0.1:{free_port()}", str(work / f"r{i}.events.jsonl"))
                   for i in range(2)]
        state = RolloutState.new(seq, records, settings.to_json(), list(_ENGINE), {"kind": "supervised"})
        driver = SupervisedDriver(list(DEFAULT_SERVE), list(_ENGINE), work, state.fleet_id)
        opts = RolloutOptions(socket_root=str(root), state_path=work / "state.json", settings=settings,
                              switch=SwitchOptions(ready_timeout_s=900), keep_from=True)
        ro = Rollout(state, driver, dict(goldens), opts)
        if not ro.bring_up():
            raise BenchError(f"bring-up on A failed: {state.failure}")

        def target(c: Checkpoint, fmt: str) -> Target:
            return Target(c.path, c.key, state.label(c.key), str(root), load_format=fmt)

        def saved() -> None:
            save_state(opts.state_path, state)

        r0 = records[0]
        onto_b = switch(driver, r0, target(seq[1], "auto"), goldens[seq[1].key], opts.switch, saved)
        anchor_switch = _timed(onto_b, "auto switch onto B")
        onto_a = switch(driver, r0, target(seq[0], "auto"), goldens[seq[0].key], opts.switch, saved)
        anchor_rollback = _timed(onto_a, "auto reload of A")
        t0 = time.monotonic()
        if ro.run() != 0:
            raise BenchError(f"the rollout A -> B failed: {state.failure}")
        whole = time.monotonic() - t0
        ours = [float(x["seconds"]["switch"]) for x in state.switches if x["ok"] and not x["rollback"]]
        hit = switch(driver, r0, target(seq[0], "verified_cache"), goldens[seq[0].key], opts.switch, saved)
        ours_rollback = _timed(hit, "rollback onto resident A")
        if not all(e.get("outcome") == "hit" for e in hit.events):
            raise BenchError(f"the rollback onto resident A did not hit: {hit.events}")
        # every timed switch with its phases (restart, ready, canary), named by the figure it makes
        switches = [{"timed": "anchor_switch", **onto_b.to_json()}, {"timed": "anchor_rollback", **onto_a.to_json()},
                    *({"timed": "ours_switch", **x} for x in state.switches), {"timed": "ours_rollback", **hit.to_json()}]
    finally:
        for r in records:
            if driver is not None:
                driver.stop(r)
        for d in daemons:
            release_daemon(d)
        if old_cache is None:
            os.environ.pop("PRELOAD_GATE_CACHE", None)
        else:
            os.environ["PRELOAD_GATE_CACHE"] = old_cache
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    ours_switch = sum(ours) / len(ours)
    details = {"model": options.value("model"), "whole_rollout_s": round(whole, 3), "replicas": 2,
               "ours_switch_s": ours, "anchor_switch_s": anchor_switch, "anchor_rollback_s": anchor_rollback,
               "ours_rollback_s": ours_rollback, "switches": switches, "loadavg_1m": os.getloadavg()[0]}
    note = ("stop to canary pass, one replica, the other serving; whole rollout of 2 replicas "
            f"{whole:.1f} s (load average {os.getloadavg()[0]:.1f})")
    return [
        BenchResult("rollout_switch", "replica switch onto the new checkpoint (stop to canary pass)",
                    Figure("auto from disk", anchor_switch, "s"), Figure("resident B, verified_cache hit", ours_switch, "s"),
                    anchor_switch / ours_switch if ours_switch > 0 else None, "auto / resident", details=details,
                    notes=note),
        BenchResult("rollout_switch", "rollback of one replica onto the old checkpoint (stop to canary pass)",
                    Figure("disk reload of A (auto)", anchor_rollback, "s"),
                    Figure("resident A, verified_cache hit", ours_rollback, "s"),
                    anchor_rollback / ours_rollback if ours_rollback > 0 else None, "auto / resident",
                    details={"whole_rollout_s": round(whole, 3)}, notes=note),
    ]
