"""The preload layer's ``promote`` verb (``preload``/``status`` are
:mod:`preload.daemon.cli`; ``fingerprints`` compares against the mutation
catalogue, so it is :mod:`harness.fingerprints`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from pgbase.cliargs import positive_int


def register(sub: argparse._SubParsersAction) -> None:
    from preload.sockets import socket_root_arg

    p = sub.add_parser("promote", help="hash a checkpoint, write its manifest, create its socket dir")
    p.add_argument("checkpoint")
    p.add_argument("--socket-root", default=None, type=socket_root_arg, help="root of the digest-keyed socket dirs")
    p.add_argument("--cache-dir", default=None, type=_nonempty,
                   help="where manifests live (default ~/.cache/preload-gate)")
    p.add_argument("--workers", type=positive_int, default=None, help="hashing threads (default: all cores)")
    p.add_argument("--json", action="store_true", help="print the promotion as JSON")
    p.set_defaults(func=_promote)


def _nonempty(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError("is empty; name a directory (it is created if missing)")
    return value


def _progress() -> Callable[[str], None] | None:
    """A bar on a terminal (None: the library's default); elsewhere (a log, CI)
    plain ``promote: ...`` lines on stderr, so a long hash is never silent (issue 39)."""
    if sys.stderr.isatty():
        return None
    return lambda line: print(f"promote: {line}", file=sys.stderr, flush=True)


def _promote(args: argparse.Namespace) -> int:
    from preload.promote import promote, sha256sum_command

    result = promote(args.checkpoint, socket_root=args.socket_root, cache_dir=args.cache_dir, workers=args.workers,
                     progress=_progress())
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(f"digest      {result.digest}")
        print(f"socket dir  {result.socket_dir}")
        print(f"manifest    {result.manifest_path}")
        for s in result.manifest.shards:
            print(f"  {s.sha256}  {s.name}  ({s.size} bytes)")
        print(f"files from  {result.manifest.selection}")
        print(f"reproduce   {sha256sum_command(result.manifest)}")
    return 0
