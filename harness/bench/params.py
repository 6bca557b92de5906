"""Row parameters (``preload-gate bench --param KEY=VALUE``): declared, parsed, refused.

Every row declares the parameters it reads (:class:`Param`: a name, a
parser, a default, what is allowed in words), and every ``--param`` is
checked against the rows asked for before any of them runs: a key no row
takes, or a value its parser refuses, is one line naming the row, the key
and what is allowed (exit 2). A row reads its values parsed, through
``options.value(name)``, never the raw text: a row cannot read what it did
not declare, and a typo is never silently a default.

Parsers are ``argparse``-style ``type=`` callables: the numeric flags'
(:mod:`pgbase.cliargs`) and the few below. Each raises
``argparse.ArgumentTypeError`` (or ``ValueError``) with the reason.

>>> shards = Param("shards", positive_int, 66, "an integer >= 1")
>>> resolve("restart_identity", [shards], {"shards": "5"})
{'shards': 5}
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.bench.errors import BenchError
from pgbase.cliargs import nonnegative_float, nonnegative_int, positive_float, positive_int


@dataclass(frozen=True)
class Param:
    """One ``--param`` a row takes. ``allowed`` says in words what ``parse``
    accepts ("an integer >= 1"); ``default`` is the parsed value used when the
    key is not given (None where the row derives it, ``help`` says from what)."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    allowed: str
    help: str = ""

    def describe(self) -> str:
        """``name: allowed (default D)``, as ``bench --list`` shows it."""
        default = self.help or ("" if self.default is None else f"default {_shown(self.default)}")
        return f"{self.name}: {self.allowed}" + (f" ({default})" if default else "")


def _shown(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return str(value)


def choice(*names: str) -> Callable[[str], str]:
    """A parser taking exactly one of ``names``."""

    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(names)}")
        return text

    return parse


def subset(known: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """A parser taking a comma-separated, non-empty list of ``known`` names."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}" if unknown else "no name given")
        return names

    return parse


def positive_ints(text: str) -> tuple[int, ...]:
    """A comma-separated, non-empty list of integers >= 1 (``1000`` or ``6,4``)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("no number given")
    return tuple(positive_int(p) for p in parts)


def size(text: str) -> int:
    """``2G``, ``512M``, ``64K`` (binary units, optional trailing B/iB) or a byte count >= 1."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 2G, 512M, 65536")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2)]
    n = int(float(m.group(1)) * scale)
    if n < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} is less than one byte")
    return n


def model(text: str) -> str:
    """``tiny``, ``smollm2`` or an existing checkpoint directory."""
    if text in ("tiny", "smollm2") or Path(text).is_dir():
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither tiny, smollm2 nor a directory")


def mutations(text: str) -> str:
    """``all`` or a comma-separated list of the gate's mutation cases."""
    from harness.mutations import CaseSelectionError, select_cases

    try:
        select_cases(text)
    except CaseSelectionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def resolve(row: str, declared: Iterable[Param], given: Mapping[str, str]) -> dict[str, Any]:
    """Each of ``row``'s ``declared`` parameters: the given text parsed, else
    its default. Keys the row does not declare are left alone (other rows'
    keys: :func:`check_known` is the check for those). A value the parser
    refuses is :class:`BenchError`, one line naming the row, key and rule."""
    out: dict[str, Any] = {}
    for p in declared:
        if p.name not in given:
            out[p.name] = p.default
            continue
        text = given[p.name]
        try:
            out[p.name] = p.parse(text)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise BenchError(f"bench row {row}: --param {p.name}={text}: {exc}; allowed: {p.allowed}") from None
    return out


def check_known(rows: Mapping[str, Sequence[Param]], given: Iterable[str], *, named: bool = True) -> None:
    """Refuse a key none of ``rows`` (name -> declared parameters) takes;
    ``named``: the rows were asked for by name (else: every row)."""
    takes = {p.name: None for ps in rows.values() for p in ps}
    for key in given:
        if key in takes:
            continue
        close = difflib.get_close_matches(key, list(takes), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        if named and len(rows) == 1:
            ((row, ps),) = rows.items()
            known = ", ".join(p.name for p in ps) or "none"
            raise BenchError(f"bench row {row} has no parameter {key!r}{hint}; its parameters: {known}")
        which = f"of {', '.join(rows)} " if named else ""
        raise BenchError(f"no bench row {which}takes --param {key}{hint}; "
                         "see preload-gate bench --list for each row's parameters")


__all__ = ["Param", "check_known", "choice", "model", "mutations", "nonnegative_float", "nonnegative_int",
           "positive_float", "positive_int", "positive_ints", "resolve", "size", "subset"]
