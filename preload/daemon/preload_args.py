"""The ``preload`` verb's arguments, as one parser both the verb and
``status`` (which writes a daemon's command back from its launcher's argv)
build: one definition, so what ``status`` repeats is what ``preload`` takes."""

from __future__ import annotations

import argparse
import os

from pgbase.cliargs import (
    digest_arg,
    fixed_port,
    nonnegative_float,
    nonnegative_int,
    port,
    positive_int,
)


def add_preload(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``preload`` verb to ``sub`` and return its parser (no ``func``
    set: the caller decides what runs)."""
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
    p.add_argument("--cache-dir", default=None, type=cache_dir_arg,
                   help="where manifests live and daemons register (default $PRELOAD_GATE_CACHE, else "
                   "~/.cache/preload-gate): the one promote --cache-dir wrote")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop (sockets removed) when the process that started this one exits, however it "
                   "exits: for supervisors such as the gate; without it the daemon outlives its starter")
    p.add_argument("--stage", choices=EXPORT_STAGES, default=None,
                   help="raw: checkpoint tensors (no vLLM); loaded: vLLM params before processing "
                   "(what CPU engines attach); processed: after processing (what CUDA engines attach). "
                   "Default: what vLLM's platform on this host attaches (raw without vLLM)")
    p.add_argument("--transport", choices=("shm", "cuda"), default=None,
                   help="shm (memfd) or cuda (one VMM arena). Default: the one that goes with the stage on "
                   "this host")
    p.add_argument("--identity", choices=IDENTITY_MODES, default="stat",
                   help="where the digest to prove comes from: the manifest (stat), --expect-digest "
                   "(pinned), or none: serve what the bytes hash to (full)")
    p.add_argument("--expect-digest", default=None, type=digest_arg,
                   help="refuse to serve unless the bytes hash to this (64 hex, as promote prints it)")
    p.add_argument("--take-over", action="store_true",
                   help="a daemon for the same digest runs: ask it to hand its arena over through the fd "
                   "store and exit, then adopt it (no checkpoint read; attached engines keep theirs)")
    p.add_argument("--no-fd-store", action="store_true",
                   help="keep no arena in the fd store (a daemon's crash loses its weights) and adopt none")
    p.add_argument("--orphan-ttl", type=nonnegative_float, default=3600.0, dest="orphan_ttl", metavar="SECONDS",
                   help="how long the fd store keeps a rank's arena after its daemon dies without stopping "
                   "(a crash, kill -9), for a successor to adopt; 0: until preload-gate stop (default 3600)")
    p.add_argument("--health-port", type=port, default=None, help="serve /health and /metrics (off by default)")
    p.add_argument("--health-host", default="127.0.0.1")
    p.add_argument("--unsafe-identity", choices=UNSAFE_IDENTITIES, default=None,
                   help="UNSAFE negative control for the gate: key by vLLM's header-only hash and skip "
                   "the byte proof")
    p.add_argument("--dry-run", action="store_true",
                   help="run every check that needs no weights, print the placement plan; load nothing")
    p.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON")
    return p


def cache_dir_arg(value: str) -> str:
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
