"""The preload layer's ``promote`` verb (``preload``/``status`` are
:mod:`preload.daemon.cli`; ``fingerprints`` compares against the mutation
catalogue, so it is :mod:`harness.fingerprints`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
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


# Off a terminal, promote stays quiet for its first QUIET_S seconds: a quick
# promote (or a refusal) is one line, a long hash is never silent.
QUIET_S = 2.0


def _progress() -> Callable[[str], None] | None:
    """A bar on a terminal (None: the library's default); elsewhere (a log, CI)
    plain ``promote: ...`` lines on stderr once the hash has run QUIET_S
    seconds (the first line held until then, the last said if any was), so
    a long hash is never silent (issue 39) and a quick one adds no lines."""
    if sys.stderr.isatty():
        return None
    held: list[str] = []
    start: list[float] = []  # when hashing began (the first line), not when vLLM was asked for the files
    spoke = False

    def say(line: str) -> None:
        nonlocal spoke
        if not start:
            start.append(time.monotonic())
        if not spoke and time.monotonic() - start[0] < QUIET_S:
            if not held:
                held.append(line)  # the header: what is being hashed
            return
        if not spoke:
            spoke = True
            for first in held:
                print(f"promote: {first}", file=sys.stderr, flush=True)
        print(f"promote: {line}", file=sys.stderr, flush=True)

    return say


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
