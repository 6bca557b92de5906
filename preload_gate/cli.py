"""``preload-gate``: one parser; ``VERBS`` says which module adds each verb.

This module sits above every package (README "Architecture"), so it is the
one place allowed to import them all. Each module in
the table exposes ``register(subparsers)``, which adds its verbs; a verb's
handler returns the exit code. The table is authoritative: a module that
adds a verb the table does not name, or a verb nobody adds, is an error, and
so is a module that fails to import (see ``preload.extras``): only a verb
marked with an optional extra is shown as unavailable when that extra is
missing, and ``--help`` says why.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

from pgbase.errors import PreloadGateError
from pgbase.oscause import file_limit
from preload.extras import ExtraMissingError, ModuleLoadError, import_for


@dataclass(frozen=True)
class Verb:
    """Where a verb lives: ``module``'s ``register(subparsers)`` adds it;
    ``extra`` is the optional extra that module cannot import without ("": none)."""

    module: str
    extra: str = ""


# Every verb and the module that adds it (--help lists them module by module,
# in this order). No verb needs an extra to be *imported* today (handlers
# import vLLM, transformers, ... when they run); tests/unit/test_cli_verbs.py
# imports every module here with the extras' packages blocked, so a new
# top-level import of one fails that test until its verb is marked.
VERBS: dict[str, Verb] = {
    "fixtures": Verb("fixtures.cli"),
    "promote": Verb("preload.cli"),
    "fingerprints": Verb("harness.fingerprints"),
    "preload": Verb("preload.daemon.cli"),
    "status": Verb("preload.daemon.cli"),
    "stop": Verb("preload.daemon.cli"),
    "bench": Verb("harness.cli"),
    "gate": Verb("harness.cli"),
    "demo": Verb("harness.cli"),
    "rollout": Verb("harness.cli"),
    "canary": Verb("canaries.cli"),
}


class VerbTableError(PreloadGateError):
    """A verb cannot be offered: its module failed to import, or the module
    and ``VERBS`` disagree about which verbs it adds."""


class _OneLineParser(argparse.ArgumentParser):
    """Bad usage is one line naming the problem and where help is, exit 2
    (argparse's default prints the whole usage block first).

    No abbreviations (issue 39): argparse's prefix matching read ``stop --a``
    as ``stop --all`` and stopped every daemon. Every verb's parser is this
    class (``add_subparsers`` makes its parsers of the parent's class), so the
    rule holds for each verb and each sub-verb (``canary record``, ``fixtures tiny``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def _modules(table: dict[str, Verb]) -> dict[str, list[str]]:
    """Module -> the verbs the table gives it, in table order."""
    out: dict[str, list[str]] = {}
    for name, verb in table.items():
        out.setdefault(verb.module, []).append(name)
    return out


def register_module(sub: argparse._SubParsersAction, module: str, extra: str = "") -> list[str]:
    """Import ``module``, call its ``register(sub)`` and return the verbs it
    added. Raises ``ExtraMissingError`` / ``ModuleLoadError`` as
    ``preload.extras.import_for`` does."""
    mod = import_for(module, extra)
    before = set(sub.choices)
    mod.register(sub)
    return [v for v in sub.choices if v not in before]


def _add_unavailable(sub: argparse._SubParsersAction, name: str, why: str) -> None:
    """A verb whose extra is missing: listed in --help with the reason; run, it
    says the same in one line (exit 2), whatever arguments it was given."""
    # No option prefix: every argument, "--x" too, lands in ``args`` unparsed.
    p = sub.add_parser(name, help=f"(unavailable: {why})", add_help=False, prefix_chars="\0")
    p.add_argument("args", nargs="*")

    def refuse(_args: argparse.Namespace) -> int:
        raise VerbTableError(f"this verb is unavailable: {why}")

    p.set_defaults(func=refuse)


def build_parser() -> argparse.ArgumentParser:
    """The whole CLI. Raises ``VerbTableError`` when a verb's module fails to
    import (and is not merely missing its declared extra) or adds verbs other
    than those ``VERBS`` gives it."""
    parser = _OneLineParser(
        prog="preload-gate",
        description="Restart vLLM engines from preloaded weights, keyed by content, and prove it.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for module, names in _modules(VERBS).items():
        extras = {VERBS[n].extra for n in names}
        if len(extras) != 1:
            raise VerbTableError(f"VERBS marks the verbs of {module} with different extras {sorted(extras)}; "
                                 "one module imports with one set of packages")
        try:
            added = register_module(sub, module, extras.pop())
        except ExtraMissingError as exc:
            for n in names:
                _add_unavailable(sub, n, str(exc))
            continue
        except ModuleLoadError as exc:
            raise VerbTableError(f"verb {', '.join(names)} cannot load: {exc}") from exc
        if set(added) != set(names):
            raise VerbTableError(
                f"{module} adds verbs {added} but VERBS gives it {names}; "
                "make preload_gate/cli.py's VERBS table name each verb its module adds"
            )
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except Exception as exc:
        # Out of descriptors anywhere (an import, a pipe to a rank, a socket,
        # a shard): the limit is the cause, whatever the step that hit it.
        cause = file_limit(exc)
        if cause is None:
            raise
        verb = next((a for a in (sys.argv[1:] if argv is None else argv) if a in VERBS), None)
        print(f"preload-gate{' ' + verb if verb else ''}: error: {cause.text}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None) -> int:
    try:
        parser = build_parser()
    except VerbTableError as exc:
        print(f"preload-gate: error: {exc}", file=sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    if extra:  # the verb's own parser says it: its name and its --help
        verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        verbs.choices[args.verb].error(f"unrecognized arguments: {' '.join(extra)}")
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
