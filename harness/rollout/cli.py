"""``preload-gate rollout``: the verb's flags and its run, end to end.

Order of a run, each step before the next can cost anything:

1. every check that reads no weights (:mod:`harness.rollout.plan`), the
   host lock, the state file;
2. each checkpoint promoted (hashed once; its digest is computed here, the
   one every binding below is checked against);
3. each target's evidence: the gate report given (``--gate-report``) is
   verified (:mod:`harness.rollout.evidence`), or the gate is run here, or
   with ``--no-gate`` nothing is required (the golden is then given or
   recorded: the canary still runs);
4. the rotation (:class:`harness.rollout.runner.Rollout`), the load
   generator beside it (``--load-gen``), the report and the metrics.

Exit: 0 every replica serves the last checkpoint; 1 a replica failed (the
report names it, why, and whether the fleet is back), or the gate BLOCKED;
2 refused before any replica was touched.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pgbase.cliargs import nonnegative_float, nonnegative_int, port, positive_float, positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rollout", help="rotate this host's replicas onto a new checkpoint, one at a time, "
                                       "behind canaries, with instant rollback",
                       description="Both checkpoints resident; each replica restarted onto the new one, "
                                   "checked by its load event and its canary, rolled back as a cache hit on any "
                                   "failure. Engine arguments of the deployment go after --.")
    p.add_argument("--from", dest="from_ckpt", default=None, help="the checkpoint the replicas serve now")
    p.add_argument("--to", action="append", default=None, metavar="CKPT",
                   help="the checkpoint to roll onto; repeat for a sequence (B, then C, ...: at most two resident)")
    r = p.add_argument_group("replicas (supervised here by default; --restart-command for others')")
    r.add_argument("--replicas", type=positive_int, default=None, help="how many replicas on this host")
    r.add_argument("--port", type=port, default=None, help="with --replicas: the first replica's port (then +1, ...)")
    r.add_argument("--host", default="127.0.0.1", help="with --replicas: the address replicas bind (default loopback)")
    r.add_argument("--replica-url", action="append", default=None, dest="replica_urls",
                   help="a replica's base URL (repeat, in order); with --restart-command, replicas others supervise")
    r.add_argument("--serve-command", default=None,
                   help="supervised replicas: the command before the checkpoint (default: this Python's "
                        "'-m vllm.entrypoints.openai.api_server --model')")
    r.add_argument("--restart-command", default=None,
                   help="restart replica {i} onto {checkpoint} (placeholders: see docs/rollout.md), e.g. "
                        "'systemctl restart vllm@{i}'")
    g = p.add_argument_group("evidence")
    g.add_argument("--gate-report", action="append", default=None, metavar="DIR",
                   help="a passing promotion gate report of each --to, in order (default: run the gate here)")
    g.add_argument("--no-gate", action="store_true",
                   help="require no gate report (the canary still runs; the golden is --golden or recorded here)")
    g.add_argument("--golden", action="append", default=None, help="the golden of each --to, in order "
                                                                    "(default: the gate report's)")
    g.add_argument("--from-golden", default=None, help="the golden of --from: rollbacks are canaried too")
    o = p.add_argument_group("how it runs")
    o.add_argument("--soak", type=nonnegative_float, default=0.0, help="seconds to watch the fleet on the new "
                                                                       "checkpoint before releasing the old one")
    o.add_argument("--keep-from", action="store_true", help="keep the old checkpoint's daemon at the end")
    o.add_argument("--evict-first", action="store_true",
                   help="when both do not fit: stop the old checkpoint's daemon first (a rollback then reads disk)")
    from harness.bench.params import size

    o.add_argument("--memory-budget", type=size, default=None, metavar="SIZE",
                   help="bytes all resident checkpoints may take (e.g. 64G; default: what the kernel has available)")
    o.add_argument("--max-near-ties", type=nonnegative_int, default=2,
                   help="near-ties one canary may show before the replica fails (default 2)")
    o.add_argument("--ready-timeout", type=positive_float, default=600.0, help="seconds for a replica to serve")
    o.add_argument("--canary-timeout", type=positive_float, default=60.0, help="seconds per canary attempt")
    o.add_argument("--load-gen", action="store_true",
                   help="send requests to every replica throughout; the report counts answered, refused, wrong")
    o.add_argument("--load-rate", type=positive_float, default=2.0,
                   help="with --load-gen: requests a second to each replica (default 2)")
    o.add_argument("--socket-root", default=None, help="the daemons' socket root (default PRELOAD_GATE_SOCKET_ROOT)")
    o.add_argument("--state-dir", default=None,
                   help="state file, replica logs and events (default <cache dir>/rollout; one per fleet)")
    o.add_argument("--report", default=None, metavar="DIR", help="rollout.{json,md,html} (default: the state dir)")
    o.add_argument("--metrics-textfile", default=None, metavar="PATH",
                   help="Prometheus textfile (default <state dir>/rollout.prom; point it into node_exporter's "
                        "textfile directory)")
    o.add_argument("--abort", action="store_true", help="roll an unfinished rollout's replicas back and stop")
    o.add_argument("--stop", action="store_true",
                   help="stop every supervised replica of the state and the daemons it started, then exit")
    o.add_argument("--unsafe-identity", choices=("header_only",), default=None,
                   help="NEGATIVE CONTROL: key the --to checkpoints as vLLM's ipc_cache does (header hash); "
                        "the canary must catch the wrong hit")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("engine_args", nargs=argparse.REMAINDER,
                   help="after --: the deployment's engine arguments (as vllm serve takes them)")
    p.set_defaults(func=run)


def _engine_args(args: argparse.Namespace) -> list[str]:
    rest = list(args.engine_args or [])
    return rest[1:] if rest[:1] == ["--"] else rest


def run(args: argparse.Namespace) -> int:
    from harness.report.terminal import TerminalProgress
    from harness.rollout.flow import Flow, GateBlockedError

    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        # One line per canary request from the HTTP client would bury the progress lines.
        for name in ("httpx", "httpx2", "openai"):
            logging.getLogger(name).setLevel(logging.WARNING)
    progress = TerminalProgress()  # stderr, also with --json (stdout is the report)
    flow = Flow(args, _engine_args(args), progress)
    try:
        code, doc = flow.run()
    except GateBlockedError as exc:  # a verdict, not a refusal: exit 1, as the gate's own
        print(f"preload-gate rollout: BLOCKED: {exc}", file=sys.stderr)
        return 1
    if doc is not None:
        if args.json:
            print(json.dumps(doc, indent=2))
        else:
            from harness.rollout.report import headline

            print(headline(doc))
            if flow.report_paths:
                print(f"report: {flow.report_paths['html']}", file=sys.stderr)
    return code
