"""Verbs ``preload`` (start the daemons), ``status`` (ask running ones) and ``stop`` (stop and evict)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from pgbase.cliargs import digest_arg, fixed_port, nonnegative_int, port, positive_int
from pgbase.errors import PreloadGateError
from pgbase.shards import not_a_directory


def register(sub: argparse._SubParsersAction) -> None:
    from preload.identity.key import EXPORT_STAGES
    from preload.identity.manifest import MODES as IDENTITY_MODES
    from preload.sockets import socket_root_arg
    from preload.trust import UNSAFE_IDENTITIES

    p = sub.add_parser(
        "preload",
        help="hold a checkpoint's weights in one daemon per local rank",
        description="Start one daemon per local rank. Prints one JSON 'ready' line when every rank "
        "serves and runs until SIGTERM/SIGINT.",
    )
    p.add_argument("checkpoint")
    eng = p.add_argument_group("engine arguments (as vLLM takes them)")
    eng.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1)
    eng.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, default=1)
    eng.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1)
    eng.add_argument("--data-parallel-size-local", type=nonnegative_int, default=None)
    eng.add_argument("--data-parallel-start-rank", type=nonnegative_int, default=0)
    eng.add_argument("--nnodes", type=positive_int, default=1)
    eng.add_argument("--node-rank", type=nonnegative_int, default=0)
    eng.add_argument("--dtype", default="auto")
    eng.add_argument("--max-model-len", type=positive_int, default=None)
    eng.add_argument("--quantization", default=None)
    eng.add_argument("--kv-cache-dtype", default="auto")
    eng.add_argument("--enable-expert-parallel", action="store_true")
    eng.add_argument("--model-impl", default="auto",
                     help="vLLM's model implementation (auto, vllm, transformers, ...): the engines' own")
    eng.add_argument("--master-port", type=fixed_port, default=None, help="gloo/nccl rendezvous port of the daemon group")
    p.add_argument("--socket-root", default=None, type=socket_root_arg,
                   help="root of the digest-keyed socket dirs (default $PRELOAD_GATE_SOCKET_ROOT, else "
                   "/tmp/preload-gate-<uid>); made absolute")
    p.add_argument("--cache-dir", default=None, type=_cache_dir_arg,
                   help="where manifests live and daemons register (default $PRELOAD_GATE_CACHE, else "
                   "~/.cache/preload-gate): the one promote --cache-dir wrote")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop (sockets removed) when the process that started this one exits, however it "
                   "exits: for supervisors such as the gate; without it the daemon outlives its starter")
    p.add_argument("--stage", choices=EXPORT_STAGES, default=None,
                   help="raw: checkpoint tensors (no vLLM); loaded: vLLM params before processing "
                   "(CPU default); processed: after processing (CUDA)")
    p.add_argument("--transport", choices=("shm", "cuda"), default="shm")
    p.add_argument("--identity", choices=IDENTITY_MODES, default="stat",
                   help="where the digest to prove comes from: the manifest (stat), --expect-digest "
                   "(pinned), or none: serve what the bytes hash to (full)")
    p.add_argument("--expect-digest", default=None, type=digest_arg,
                   help="refuse to serve unless the bytes hash to this (64 hex, as promote prints it)")
    p.add_argument("--no-fd-store", action="store_true",
                   help="keep no arena in the fd store (a daemon's crash loses its weights) and adopt none")
    p.add_argument("--health-port", type=port, default=None, help="serve /health and /metrics (off by default)")
    p.add_argument("--health-host", default="127.0.0.1")
    p.add_argument("--unsafe-identity", choices=UNSAFE_IDENTITIES, default=None,
                   help="UNSAFE negative control for the gate: key by vLLM's header-only hash and skip "
                   "the byte proof")
    p.add_argument("--dry-run", action="store_true",
                   help="run every check that needs no weights, print the placement plan; load nothing")
    p.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON")
    p.set_defaults(func=_preload)

    s = sub.add_parser(
        "status", help="list running preload daemons, their digests and counters",
        description="With no --socket-root: every daemon of this user, under the default socket root and "
        "under every root a live daemon registered in <cache dir>/daemons (the cache dir is "
        "$PRELOAD_GATE_CACHE, else ~/.cache/preload-gate, as for manifests).")
    s.add_argument("--socket-root", default=None, type=socket_root_arg, help="only this socket root")
    s.add_argument("--cache-dir", default=None, type=_cache_dir_arg,
                   help="the cache dir whose daemon registry to follow (default $PRELOAD_GATE_CACHE, else "
                   "~/.cache/preload-gate)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_status)

    t = sub.add_parser(
        "stop", help="stop a digest's daemons for good and drop its arenas from the fd store",
        description="Stop the daemons serving TARGET under the socket root (SIGTERM to their launcher, which "
        "stops every rank) and drop TARGET's arenas from the fd store (keeper or systemd), so no restart "
        "re-adopts them. TARGET is a checkpoint directory or a digest (64 hex, or 16+ leading hex as status "
        "prints it); --all stops and drops everything under the root. Nothing found is not an error.")
    t.add_argument("target", nargs="?", default=None, metavar="DIGEST|CKPT")
    t.add_argument("--all", action="store_true", help="every daemon under the socket root and every stored arena")
    t.add_argument("--socket-root", default=None, type=socket_root_arg,
                   help="the root the daemons were started with (default $PRELOAD_GATE_SOCKET_ROOT, else "
                   "/tmp/preload-gate-<uid>)")
    t.add_argument("--timeout", type=positive_int, default=30,
                   help="seconds to wait for each daemon after SIGTERM before SIGKILL (default 30)")
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=_stop)


def _cache_dir_arg(value: str) -> str:
    """``--cache-dir``: absolute; an existing non-directory is refused here."""
    if not value:
        raise argparse.ArgumentTypeError("is empty; name the directory promote --cache-dir wrote")
    path = os.path.abspath(value)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{value} is not a directory; name the directory promote --cache-dir "
                                         "wrote (it holds manifests/)")
    if not os.path.isdir(path):  # a typo would serve with no manifest: refused, not created
        raise argparse.ArgumentTypeError(f"{value} does not exist; name the directory promote --cache-dir "
                                         "wrote (it holds manifests/)")
    return path


def _use_cache_dir(args: argparse.Namespace) -> None:
    """``--cache-dir DIR`` is ``PRELOAD_GATE_CACHE=DIR`` for this process and
    every rank it starts (manifests, the daemon registry)."""
    if args.cache_dir:
        os.environ["PRELOAD_GATE_CACHE"] = args.cache_dir


def _options(args: argparse.Namespace) -> Any:
    from preload.daemon.launcher import PreloadOptions
    from preload.daemon.placement import Parallelism
    from preload.vllm_key import export_stage_for

    # The stage a vLLM engine on this transport asks for (the loader's rule, one function).
    stage = args.stage or export_stage_for("cpu" if args.transport == "shm" else "cuda")
    if args.transport == "shm" and stage == "processed":
        raise PreloadGateError(
            "--stage processed with --transport shm serves no engine: vLLM's CPU engines attach the loaded "
            "stage (their weight processing moves Linear weights into oneDNN handles that cannot be shared); "
            "use --stage loaded (the default) or raw")
    engine = {"dtype": args.dtype, "max_model_len": args.max_model_len, "quantization": args.quantization,
              "kv_cache_dtype": args.kv_cache_dtype, "enable_expert_parallel": args.enable_expert_parallel,
              "model_impl": args.model_impl}
    return PreloadOptions(
        checkpoint=args.checkpoint,
        parallel=Parallelism(
            tp_size=args.tensor_parallel_size, pp_size=args.pipeline_parallel_size,
            dp_size=args.data_parallel_size, dp_size_local=args.data_parallel_size_local,
            dp_start_rank=args.data_parallel_start_rank, nnodes=args.nnodes, node_rank=args.node_rank,
        ),
        stage=stage, transport=args.transport, identity=args.identity, socket_root=args.socket_root,
        expect_digest=args.expect_digest, unsafe_identity=args.unsafe_identity, engine=engine,
        health_port=args.health_port, health_host=args.health_host, master_port=args.master_port,
        exit_with_parent=args.exit_with_parent, fd_store=not args.no_fd_store,
    )


def _preload(args: argparse.Namespace) -> int:
    from preload.daemon import launcher

    if not Path(args.checkpoint).is_dir():
        raise PreloadGateError(not_a_directory(args.checkpoint))
    _use_cache_dir(args)
    opts = _options(args)
    if args.dry_run:  # a dry run refuses what a start would refuse, but reports a held rank
        from preload.daemon import dry_run

        dry_run.write(dry_run.plan_with_holders(opts), args.json, sys.stdout)
        return 0
    return launcher.run(opts)


def _roots(args: argparse.Namespace) -> tuple[list[Path], list[dict[str, str]]]:
    """The roots to scan: the one asked for; else the default one and every
    root a live daemon registered (preload.daemon.registry), with refusals."""
    from preload.daemon.registry import live_roots
    from preload.sockets import default_socket_root

    if args.socket_root:
        if os.path.lexists(args.socket_root) and not os.path.isdir(args.socket_root):
            raise PreloadGateError(f"--socket-root {args.socket_root} is not a directory; name the directory "
                                   "daemons were started with (preload --socket-root DIR)")
        return [Path(args.socket_root)], []
    registered, refused = live_roots()
    return list(dict.fromkeys([default_socket_root(), *registered])), refused


def _status(args: argparse.Namespace) -> int:
    import msgspec

    from preload.daemon import status
    from preload.daemon.registry import registry_dir
    from preload.preflight import check_cache_root
    from preload.sockets import default_socket_root, legacy_socket_roots

    _use_cache_dir(args)
    check_cache_root(None)  # an unreadable one would hide its registry: refused, as preload and promote do
    roots, refused = _roots(args)
    ranks = [r for root in roots for r in status.scan(root)]
    # Daemons of older releases (or another session's $TMPDIR) live elsewhere: name them.
    elsewhere = [] if args.socket_root else [
        r for root in legacy_socket_roots() if root not in roots for r in status.scan(root) if r.serving]
    status.check_disk(ranks)
    scanned = [status.scan_store(root) for root in roots]
    report = status.StatusReport(socket_root=str(args.socket_root or default_socket_root()),
                                 socket_roots=[str(r) for r in roots], registry=str(registry_dir()),
                                 ranks=ranks, elsewhere=elsewhere, refused=refused,
                                 stores=[st for st, _ in scanned], stored=[a for _, kept in scanned for a in kept])
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(report), indent=2).decode())
        return 0
    lines = status.render(report, default_socket_root())
    if not ranks:
        where = (args.socket_root if args.socket_root else
                 f"{default_socket_root()} or any socket root registered in {registry_dir()} (a daemon "
                 "started with another PRELOAD_GATE_CACHE registers in its own; name its root with "
                 "--socket-root DIR)")
        lines.append(f"no preload daemons found under {where}")
    print("\n".join(lines))
    return 0


def _stop(args: argparse.Namespace) -> int:
    import msgspec

    from preload.daemon import stop
    from preload.sockets import default_socket_root

    target = stop.parse_target(args.target, args.all)
    root = args.socket_root or str(default_socket_root())
    if os.path.lexists(root) and not os.path.isdir(root):
        raise PreloadGateError(f"--socket-root {root} is not a directory; name the directory daemons were started "
                               "with (preload --socket-root DIR)")
    report = stop.stop(target, root, timeout_s=float(args.timeout))
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(report), indent=2).decode())
    else:
        print("\n".join(stop.render(report)))
    return 1 if report.failed else 0
