"""``preload-gate``: one parser, verbs contributed by each layer.

This module sits above every package (fixtures <- preload <- harness,
canaries), so it is the one place allowed to import them all. Each layer
exposes ``register(subparsers)``; a verb's handler returns the exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import NoReturn

from preload.errors import PreloadGateError

# Modules that add verbs, in the order --help lists them.
_VERB_MODULES = (
    "fixtures.cli",
    "preload.cli",
    "preload.daemon.cli",
    "harness.cli",
    "canaries.cli",
)


class _OneLineParser(argparse.ArgumentParser):
    """Bad usage is one line naming the problem and where help is, exit 2
    (argparse's default prints the whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="preload-gate",
        description="Restart vLLM engines from preloaded weights, keyed by content, and prove it.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for name in _VERB_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except PreloadGateError as exc:
        print(f"preload-gate {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `preload-gate ... | head`: the reader left; not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"preload-gate {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
