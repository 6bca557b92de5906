"""Verbs ``preload`` (start the daemons), ``status`` (ask running ones) and ``stop`` (stop and evict)."""

from __future__ import annotations

import argparse
import os
import stat
import sys
from pathlib import Path
from typing import Any

from pgbase.cliargs import positive_int
from pgbase.errors import PreloadGateError
from pgbase.shards import not_a_directory
from preload.daemon.preload_args import add_preload, cache_dir_arg


def register(sub: argparse._SubParsersAction) -> None:
    from preload.sockets import socket_root_arg

    p = add_preload(sub)
    p.set_defaults(func=_preload)

    s = sub.add_parser(
        "status", help="list running preload daemons, their digests and counters",
        description="With no --socket-root: every daemon of this user, under the default socket root and "
        "under every root a live daemon registered in <cache dir>/daemons (the cache dir is "
        "$PRELOAD_GATE_CACHE, else ~/.cache/preload-gate, as for manifests).")
    s.add_argument("--socket-root", default=None, type=socket_root_arg, help="only this socket root")
    s.add_argument("--cache-dir", default=None, type=cache_dir_arg,
                   help="the cache dir whose daemon registry to follow (default $PRELOAD_GATE_CACHE, else "
                   "~/.cache/preload-gate)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_status)

    t = sub.add_parser(
        "stop", help="stop a digest's daemons for good and drop its arenas from the fd store",
        description="Stop the daemons serving TARGET under the socket root (SIGTERM to their launcher, which "
        "stops every rank) and drop TARGET's arenas from the fd store (keeper or systemd), so no restart "
        "re-adopts them. TARGET is a checkpoint directory (or the checkpoint path status shows for a daemon "
        "whose folder was moved since) or a digest (64 hex, or 16+ leading hex as status prints it); --all "
        "stops and drops everything under the root. Nothing found is not an error.")
    t.add_argument("target", nargs="?", default=None, metavar="DIGEST|CKPT")
    t.add_argument("--all", action="store_true", help="every daemon under the socket root and every stored arena")
    t.add_argument("--socket-root", default=None, type=socket_root_arg,
                   help="the root the daemons were started with (default $PRELOAD_GATE_SOCKET_ROOT, else "
                   "/tmp/preload-gate-<uid>)")
    t.add_argument("--timeout", type=positive_int, default=30,
                   help="seconds to wait for each daemon after SIGTERM before SIGKILL (default 30)")
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=_stop)


def _use_cache_dir(args: argparse.Namespace) -> None:
    """``--cache-dir DIR`` is ``PRELOAD_GATE_CACHE=DIR`` for this process and
    every rank it starts (manifests, the daemon registry)."""
    if args.cache_dir:
        os.environ["PRELOAD_GATE_CACHE"] = args.cache_dir


def _options(args: argparse.Namespace) -> Any:
    from preload.daemon.launcher import PreloadOptions
    from preload.daemon.placement import Parallelism
    from preload.engine_platform import resolve

    # What an engine on this host attaches (vLLM's platform; the loader's rule, one function):
    # explicit choices no consumer here can use are refused before anything is read.
    stage, transport = resolve(args.stage, args.transport)
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
        stage=stage, transport=transport, identity=args.identity, socket_root=args.socket_root,
        expect_digest=args.expect_digest, unsafe_identity=args.unsafe_identity, engine=engine,
        health_port=args.health_port, health_host=args.health_host, master_port=args.master_port,
        exit_with_parent=args.exit_with_parent, fd_store=not args.no_fd_store, take_over=args.take_over,
        orphan_ttl_s=args.orphan_ttl,
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


def _check_given_root(root: str, otherwise: str) -> None:
    """A ``--socket-root`` typed on the command line exists as a directory.
    A mistyped one would read as "no daemons" (status) or "nothing to stop"
    (stop); the default root or PRELOAD_GATE_SOCKET_ROOT's, not there yet,
    is normal (no daemon has started) and is not checked here."""
    from pgbase.oscause import describe

    try:
        st = os.stat(root)
    except OSError as exc:
        raise PreloadGateError(f"--socket-root {root} cannot be used: {describe(exc, root)}; name the directory "
                               f"the daemons were started with (preload --socket-root DIR), or {otherwise}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise PreloadGateError(f"--socket-root {root} is not a directory; name the directory daemons were started "
                               "with (preload --socket-root DIR)")


def _roots(args: argparse.Namespace) -> tuple[list[Path], list[dict[str, str]]]:
    """The roots to scan: the one asked for; else the default one and every
    root a live daemon registered (preload.daemon.registry), with refusals."""
    from preload.daemon.registry import live_roots
    from preload.sockets import default_socket_root

    if args.socket_root:
        _check_given_root(args.socket_root, "leave it out to list every root this user's daemons registered")
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
    if args.socket_root:
        _check_given_root(args.socket_root, f"leave it out for the default root {default_socket_root()}")
    root = args.socket_root or str(default_socket_root())
    if os.path.lexists(root) and not os.path.isdir(root):
        raise PreloadGateError(f"--socket-root {root} is not a directory; name the directory daemons were started "
                               "with (preload --socket-root DIR)")
    # --all says what it stops before it does (stderr: --json stays one document).
    report = stop.stop(target, root, timeout_s=float(args.timeout),
                       announce=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(report), indent=2).decode())
    else:
        print("\n".join(stop.render(report)))
    return 1 if report.failed else 0
