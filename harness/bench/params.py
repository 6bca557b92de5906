"""Row parameters (``preload-gate bench --param KEY=VALUE``): declared once, parsed, refused.

Every row declares the parameters it reads (:class:`Param`: a name, a
:class:`Kind`, a default), and every ``--param`` is checked against the rows
asked for before any of them runs. The kind is the one declaration of a
parameter's type and range: it parses the text, says in words what is
allowed ("an integer from 1 to 256"), holds its bounds (every numeric kind
has both: a count with no upper bound reaches the row as a MemoryError) and
names texts on either side of each bound; the registry's table test
(``tests/unit/test_bench_params.py``) tries the values just past and at
each bound of every parameter of every row. Refused, each in one line naming the row,
the key and what is allowed (exit 2):

- a key none of the rows asked for takes (:func:`check_known`);
- a value its kind refuses (:func:`resolve`);
- a key given twice (:func:`given`), or one that would go unused: its only
  rows do not run here (no CUDA; ``--skip-heavy``), or the row's other
  values leave it out (``Param.unused``, :func:`check_used`).

A row reads its values parsed, through ``options.value(name)``, never the
raw text: a row cannot read what it did not declare, and a typo is never
silently a default.

>>> shards = Param("shards", integer(1, 100_000), 66)
>>> resolve("restart_identity", [shards], {"shards": "5"})
{'shards': 5}
>>> shards.describe()
'shards: an integer from 1 to 100000 (default 66)'
"""

from __future__ import annotations

import argparse
import difflib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.bench.errors import BenchError
from pgbase.cliargs import SIZE_MAX, size_arg


@dataclass(frozen=True)
class Kind:
    """A parameter's type and range. ``parse`` turns the text into the value
    or raises ``argparse.ArgumentTypeError`` with the reason; ``allowed`` says
    the same rule in words; ``refused`` are texts just past each bound (and an
    ill-typed one), ``accepted`` texts at each bound. ``bounds``: a numeric
    kind's inclusive range ``(lo, hi)``, both finite (None: no number)."""

    parse: Callable[[str], Any]
    allowed: str
    refused: tuple[str, ...]
    accepted: tuple[str, ...]
    bounds: tuple[float, float] | None = None


def _fmt(x: float) -> str:
    return f"{x:g}"


def _past(x: float, way: float) -> str:
    """The float next to ``x`` towards ``way``, as a text that parses back to it."""
    return repr(math.nextafter(x, way))


def integer(lo: int, hi: int, unit: str = "") -> Kind:
    """An integer in ``[lo, hi]``. Both bounds are required: a count with no
    upper one reaches the row (``clients=10**9`` is a MemoryError there)."""
    allowed = f"an integer from {lo} to {hi}" + (f" ({unit})" if unit else "")

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"{n} is out of range")
        return n

    return Kind(parse, allowed, ("x", "1.5", str(lo - 1), str(hi + 1)), (str(lo), str(hi)), (lo, hi))


def number(lo: float, hi: float, unit: str = "") -> Kind:
    """A finite number in ``[lo, hi]``. A quantity that must be more than
    nothing gives the least that still means something as ``lo``, not 0
    exclusive (``load_mb=1e-300`` is > 0 and a checkpoint of nothing)."""
    lo, hi = float(lo), float(hi)
    allowed = f"a number from {_fmt(lo)} to {_fmt(hi)}" + (f" ({unit})" if unit else "")

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if not lo <= x <= hi:
            raise argparse.ArgumentTypeError(f"{text} is out of range")
        return x

    refused = ("fast", "nan", "inf", "-inf", _past(lo, -math.inf), _past(hi, math.inf))
    return Kind(parse, allowed, refused, (_fmt(lo), _fmt(hi)), (lo, hi))


def integers(lo: int, hi: int, most: int = 16) -> Kind:
    """A comma-separated list of 1 to ``most`` integers in ``[lo, hi]`` (``1000`` or ``6,4``)."""
    one = integer(lo, hi)

    def parse(text: str) -> tuple[int, ...]:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError("no number given")
        if len(parts) > most:
            raise argparse.ArgumentTypeError(f"{len(parts)} numbers given, at most {most}")
        return tuple(one.parse(p) for p in parts)

    return Kind(parse, f"1 to {most} comma-separated integers from {lo} to {hi}",
                (",", f"6,{lo - 1}", f"6,{hi + 1}", "6,x", ",".join([str(lo)] * (most + 1))),
                (str(lo), f"{lo},{hi}", ",".join([str(hi)] * most)), (lo, hi))


def choice(*names: str) -> Kind:
    """Exactly one of ``names``."""

    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(names)}")
        return text

    return Kind(parse, f"one of {', '.join(names)}", ("", "mine", names[0].upper()), names)


def subset(known: Sequence[str]) -> Kind:
    """A comma-separated, non-empty list of ``known`` names."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}" if unknown else "no name given")
        return names

    return Kind(parse, f"comma-separated, of {', '.join(known)}", (",", f"{known[0]},nope"),
                (known[0], ",".join(known[:2])))


# The largest size a row or ``bench --size`` takes: 1 TiB, more memory and
# scratch disk than any host these rows run on has, so a typo (``2000G``)
# is refused here and not in the middle of a write.


def _size(text: str) -> int:
    return size_arg(text)


# ``2G``, ``512M``, ``64K``, ``1T`` (binary units, optional trailing B/iB) or a byte count, 1 byte to 1 TiB.
SIZE = Kind(_size, f"a size from 1 byte to 1T ({SIZE_MAX} bytes; e.g. 256M, 2G, 65536)", ("lots", "0", "-1M", str(SIZE_MAX + 1), "2T"),
            ("1", "64M", "1.5G", "1T", str(SIZE_MAX)), (1, SIZE_MAX))


def size(text: str) -> int:
    """:data:`SIZE`'s parser (``bench --size`` reads sizes the same way)."""
    return _size(text)


def _model(text: str) -> str:
    if text in ("tiny", "smollm2"):
        return text
    if not text.strip():  # Path("") is the current directory
        raise argparse.ArgumentTypeError("is empty; give tiny, smollm2 or a checkpoint directory")
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is neither tiny, smollm2 nor a directory")
    if not any(Path(text).glob("*.safetensors")):
        raise argparse.ArgumentTypeError(f"{text!r} holds no *.safetensors shard; give a checkpoint directory")
    return text


MODEL = Kind(_model, "tiny, smollm2 or a checkpoint directory", ("/no/such/model", "huge", "", "/"),
             ("tiny", "smollm2"))


def _mutations(text: str) -> str:
    from harness.mutations import CaseSelectionError, select_cases

    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; give all or comma-separated mutation cases")
    try:
        select_cases(text)
    except CaseSelectionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


# The gate's own case selection (``gate --mutations``), asked, not copied.
MUTATIONS = Kind(_mutations, "all or comma-separated mutation cases", ("bogus", "identical_copy,bogus", ""),
                 ("all", "identical_copy,zeroed_norm"))


@dataclass(frozen=True)
class Param:
    """One ``--param`` a row takes: its :class:`Kind` (type and range), the
    value used when the key is not given (None where the row derives it,
    ``help`` says from what), and ``unused``: given the row's parsed values,
    why this one would change nothing (None: it is used)."""

    name: str
    kind: Kind
    default: Any
    help: str = ""
    unused: Callable[[Mapping[str, Any]], str | None] | None = field(default=None, compare=False)

    @property
    def allowed(self) -> str:
        return self.kind.allowed

    def describe(self) -> str:
        """``name: allowed (default D)``, as ``bench --list`` shows it."""
        default = self.help or ("" if self.default is None else f"default {_shown(self.default)}")
        return f"{self.name}: {self.allowed}" + (f" ({default})" if default else "")


def _shown(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return str(value)


def given(items: Iterable[str]) -> dict[str, str]:
    """``KEY=VALUE`` texts as given on the command line, each key once."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BenchError(f"--param wants KEY=VALUE, got {item!r}")
        if key in out:
            raise BenchError(f"--param {key} is given twice ({out[key]}, {value}); give it once")
        out[key] = value
    return out


def resolve(row: str, declared: Iterable[Param], given: Mapping[str, str]) -> dict[str, Any]:
    """Each of ``row``'s ``declared`` parameters: the given text parsed, else
    its default. Keys the row does not declare are left alone (other rows'
    keys: :func:`check_known` is the check for those). A value the kind
    refuses is :class:`BenchError`, one line naming the row, key and rule."""
    out: dict[str, Any] = {}
    for p in declared:
        if p.name not in given:
            out[p.name] = p.default
            continue
        text = given[p.name]
        try:
            out[p.name] = p.kind.parse(text)
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


def check_used(rows: Mapping[str, Sequence[Param]], skipped: Mapping[str, str], given: Mapping[str, str]) -> None:
    """Refuse a given key that no running row would use: every row that takes
    it is ``skipped`` here (row -> why it does not run), or leaves it out by
    its other values (``Param.unused``). ``rows``: every row asked for."""
    for key, text in given.items():
        reasons: list[str] = []
        for row, declared in rows.items():
            p = next((p for p in declared if p.name == key), None)
            if p is None:
                continue
            if row in skipped:
                reasons.append(f"bench row {row} does not run here ({skipped[row]})")
                continue
            why = p.unused(resolve(row, declared, given)) if p.unused else None
            if why is None:
                break  # a running row reads it
            reasons.append(f"bench row {row}: {why}")
        else:
            if reasons:
                raise BenchError(f"--param {key}={text} would be unused: {'; '.join(reasons)}; drop it, "
                                 "or change what leaves it out")


__all__ = ["MODEL", "MUTATIONS", "SIZE", "SIZE_MAX", "Kind", "Param", "check_known", "check_used", "choice", "given",
           "integer", "integers", "number", "resolve", "size", "subset"]
