"""Gate rows: the full self-test's wall time, cold and with the ``auto`` cache warm.

Both runs happen in one invocation, back to back, on the same machine and
fixture, so their ratio is what the reference cache buys; the absolute
cold figure is checked against the target (< 15 min on two cores).
Params: ``mutations`` (default all), ``jobs`` (engines at once, default 1).
"""

from __future__ import annotations

import os
import shutil
import time
from typing import TYPE_CHECKING, Any

from harness.bench import BenchError, BenchOptions, BenchResult, Figure, bench_row, not_run, scratch
from harness.bench import params as P

if TYPE_CHECKING:
    from harness.results import GateReport


@bench_row("gate_selftest", "gate self-test on the tiny fixture: cold vs auto cache warm",
           heavy="the full self-test twice: dozens of vLLM engine runs, up to 30 min on 2 cores",
           params=(P.Param("mutations", P.MUTATIONS, "all"),
                   P.Param("jobs", P.integer(1, 64, "engines at once"), 1)))
def gate_selftest(options: BenchOptions) -> list[BenchResult]:
    from fixtures.tiny import write_tiny
    from harness.gate import GateOptions, run_gate

    mutations = options.value("mutations")
    jobs = options.value("jobs")
    work = scratch(options, "pg-bench-gate-")
    try:
        ckpt = write_tiny(work / "tiny")
        runs = []
        for label in ("cold", "warm"):
            load_before = os.getloadavg()[0]
            t0 = time.perf_counter()
            report = run_gate(GateOptions(candidate=str(ckpt), mutations=mutations, jobs=jobs,
                                          workdir=str(work / f"gate-{label}"),
                                          reference_cache=str(work / "refcache"), record_golden=False))
            if report.verdict != "PASS":  # a self-test that did not pass is not a time to report
                blocked = ", ".join(c.name for c in report.cases if c.status == "BLOCK")
                raise BenchError(f"gate_selftest: the {label} self-test's verdict is {report.verdict} "
                                 f"(blocked: {blocked or 'none'}); see why with: preload-gate gate TINY "
                                 f"--mutations {mutations} --jobs {jobs} --report DIR")
            runs.append({"label": label, "seconds": time.perf_counter() - t0, "verdict": report.verdict,
                         "counts": report.counts,
                         # cases with equal candidate bytes share one reference run
                         "engines": sum(c.cached is not None for c in report.cases) + len(
                             {id(c.reference) for c in report.cases
                              if c.reference is not None and not c.reference_reused}),
                         "loadavg_1m_before": load_before})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cold, warm = runs
    return [BenchResult(
        row="gate_selftest",
        title=f"gate self-test ({mutations}), tiny fixture, jobs={jobs}",
        anchor=Figure("cold (auto references computed)", cold["seconds"], "s"),
        ours=Figure("rerun (auto references from cache)", warm["seconds"], "s"),
        ratio=cold["seconds"] / warm["seconds"],
        ratio_meaning="cold wall / warm wall",
        target="cold < 900 s on 2 cores",
        details={"runs": runs, "cpu_count": os.cpu_count()},
        notes="engine starts dominate; a shared machine's load (loadavg in details) inflates both",
    )]


@bench_row("gate_ray", "gate self-test on the tiny fixture: local vs a two-node Ray cluster on this machine",
           heavy="the self-test twice (locally, then on two Ray nodes): a daemon per node and every engine twice",
           params=(P.Param("mutations", P.MUTATIONS, "identical_copy,zeroed_norm,single_element"),))
def gate_ray(options: BenchOptions) -> list[BenchResult]:
    """Both runs cold (each its own reference cache), back to back: what Ray
    adds on one machine (no speed-up is expected from two nodes on two
    cores: they share them). Per-engine seconds go to ``details`` for the
    sizing table (scripts/ray_sizing.py)."""
    title = "gate self-test, tiny fixture: local (jobs=1) vs two Ray nodes of one CPU each"
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        return [not_run("gate_ray", title, f"ray is not installed ({exc}): pip install 'preload-gate[ray]'")]
    from fixtures.tiny import write_tiny
    from harness.bench.ray_cluster import LocalCluster
    from harness.gate import GateOptions, run_gate
    from harness.gate.ray_executor import RayExecutor

    mutations = options.value("mutations")
    work = scratch(options, "pg-bench-ray-")
    try:
        ckpt = write_tiny(work / "tiny")
        runs: dict[str, dict[str, Any]] = {}
        for label in ("local", "ray"):
            load_before = os.getloadavg()[0]
            opts = GateOptions(candidate=str(ckpt), mutations=mutations, workdir=str(work / f"gate-{label}"),
                               reference_cache=str(work / f"refs-{label}"), record_golden=False)
            t0 = time.perf_counter()
            if label == "local":
                report = run_gate(opts)
                cluster_s = 0.0
            else:
                with LocalCluster([{"CPU": 1}, {"CPU": 1}], work / "cluster") as cluster:
                    cluster_s = cluster.start_seconds
                    report = run_gate(opts, executor=RayExecutor(cluster.address))
            seconds = time.perf_counter() - t0
            if report.verdict != "PASS":
                raise BenchError(f"gate_ray: the {label} self-test's verdict is {report.verdict}; see why with: "
                                 f"preload-gate gate TINY --mutations {mutations}"
                                 f"{' --ray ADDRESS' if label == 'ray' else ''} --report DIR")
            verdicts = {c.name: (c.status, c.verdict.outcome if c.verdict else None) for c in report.cases}
            if label == "ray" and verdicts != runs["local"]["verdicts"]:
                raise BenchError(f"gate_ray: the cluster's verdicts {verdicts} differ from the local run's "
                                 f"{runs['local']['verdicts']}")
            runs[label] = {"seconds": seconds, "verdicts": verdicts, "cluster_start_seconds": cluster_s, "counts": report.counts,
                           "engines": engine_seconds(report), "daemon_start_seconds": daemon_seconds(report),
                           "loadavg_1m_before": load_before}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    local, on_ray = runs["local"], runs["ray"]
    return [BenchResult(
        row="gate_ray", title=f"{title} ({mutations})",
        anchor=Figure("local", float(local["seconds"]), "s"),
        ours=Figure("two Ray nodes (cluster start included)", float(on_ray["seconds"]), "s"),
        ratio=float(on_ray["seconds"]) / float(local["seconds"]),
        ratio_meaning="ray wall / local wall (the overhead Ray adds on one 2-core machine)",
        details={"runs": runs, "cpu_count": os.cpu_count()},
        notes="two nodes share the same 2 cores: no speed-up is expected; the cluster's start, a daemon per "
              "node and Ray's task dispatch are the overhead",
    )]


def engine_seconds(report: GateReport) -> list[dict[str, Any]]:
    """Wall seconds of every engine the run started (cached and reference;
    a reference shared by cases once), from its report."""
    out: list[dict[str, Any]] = []
    seen: set[int] = set()
    for c in report.cases:
        if c.cached is not None and "wall" in c.cached.timings:
            out.append({"case": c.name, "kind": "cached", "seconds": c.cached.timings["wall"]})
        ref = c.reference
        if ref is not None and not c.reference_reused and id(ref) not in seen and "wall" in ref.timings:
            seen.add(id(ref))
            out.append({"case": c.name, "kind": "reference", "seconds": ref.timings["wall"]})
    return out


def daemon_seconds(report: GateReport) -> float | None:
    got = report.daemon.get("start_seconds")
    return float(got) if got is not None else None
