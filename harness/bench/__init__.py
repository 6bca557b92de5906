"""Benchmarks: each row measures an anchor and ours side by side, in one run.

Performance claims are ratios, never timed assertions in tests: a row runs
the anchor (what a user would otherwise do: vLLM's header hash, sequential
``sha256sum``, a disk load) and ours on the same inputs in the same process
and reports both figures and their ratio. Rows register themselves with
``@bench_row``; ``ROW_MODULES`` lists the modules that hold rows and the
optional extra each cannot import without. The rule is the CLI's
(``preload.extras``): a module that fails to import is an error, except a
module marked with an extra whose extra is missing, whose rows then report
"not run" with the extra to install (never silently gone).

A row declares what it needs (``needs="cuda"``) and why it is heavy
(``heavy="two vLLM engine starts"``): with no ``--only`` every row runs
that fits the machine, and a row whose need is missing reports "not run:
why" instead of failing, so one command works on a laptop and on a GPU box.
``--list`` shows the heavy ones, so nobody starts a 15-minute row by surprise.

A row declares its ``--param`` keys too (``params=[Param(...)]``, each with
its type and range, :mod:`harness.bench.params`): every given key and value
is checked against the rows asked for before any runs (unknown, ill-typed,
out of range, or unused by every row that runs here), and the row reads them
parsed (``options.value("shards")``).

>>> results = run_rows(BenchOptions(size_bytes=64 << 20), only=["restart_identity"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from harness.bench import params as _params
from harness.bench.errors import BenchError
from harness.bench.params import Param
from preload.extras import ExtraMissingError, ModuleLoadError, import_for

# Modules that define rows, in the order the table lists them, and the
# optional extra each needs to be imported ("": none; no row module needs one
# today: rows import vLLM or triton when they run).
ROW_MODULES: dict[str, str] = {
    "harness.bench.identity": "",
    "harness.bench.hashing": "",
    "harness.bench.daemon": "",
    "harness.bench.gpu": "",
    "harness.bench.gpu_daemon": "",
    "harness.bench.readopt": "",
    "harness.bench.restart": "",
    "harness.bench.gate": "",
    "harness.bench.load": "",
    "harness.bench.preflight": "",
    "harness.bench.rollout": "",
}


@dataclass(frozen=True)
class BenchOptions:
    """Knobs shared by rows; ``params`` carries the ``KEY=VALUE`` texts as
    given, ``values`` the running row's declared parameters, parsed (filled
    when the row is called)."""

    workdir: Path | None = None
    size_bytes: int = 2 << 30
    params: dict[str, str] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)

    def value(self, key: str) -> Any:
        """The running row's parameter ``key``, parsed, or its declared default."""
        if key not in self.values:
            raise KeyError(f"{key!r} is not a declared parameter of this row (bench_row(params=...))")
        return self.values[key]


@dataclass(frozen=True)
class Figure:
    """One measured quantity (e.g. wall seconds of header_only)."""

    label: str
    value: float
    unit: str

    def text(self) -> str:
        v = self.value
        shown = f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return f"{shown} {self.unit}".strip()


@dataclass(frozen=True)
class BenchResult:
    """A row's outcome: the anchor, ours, their ratio (anchor / ours unless
    ``ratio_meaning`` says otherwise), raw details, and notes on method."""

    row: str
    title: str
    anchor: Figure
    ours: Figure
    ratio: float | None
    ratio_meaning: str
    target: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    notes: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> BenchResult:
        """A result as bench.json recorded it (so a chart can be redrawn from a file)."""
        try:
            fields = {k: obj[k] for k in ("row", "title", "ratio", "ratio_meaning")}
            fields["anchor"] = Figure(**obj["anchor"])
            fields["ours"] = Figure(**obj["ours"])
        except (KeyError, TypeError) as exc:
            raise BenchError(f"bench result is malformed: {exc}") from None
        extra = {k: obj[k] for k in ("target", "details", "notes") if k in obj}
        return cls(**fields, **extra)

    @property
    def not_run(self) -> str | None:
        """Why the row did not run on this machine, or None when it did."""
        why = self.details.get("not_run")
        return str(why) if why else None


@dataclass(frozen=True)
class BenchRow:
    """A registered row; ``heavy`` says why it is costly ("" when it is not),
    ``needs`` names hardware it cannot run without ("cuda" or "")."""

    name: str
    title: str
    run: Callable[[BenchOptions], list[BenchResult]]
    heavy: str = ""
    needs: str = ""
    params: tuple[Param, ...] = ()


ROWS: dict[str, BenchRow] = {}
# Row modules not loaded because their extra is missing -> why (load_rows).
UNLOADED: dict[str, str] = {}


_NEEDS = ("", "cuda")
RowFn = Callable[[BenchOptions], list[BenchResult]]


def bench_row(name: str, title: str, *, heavy: str = "", needs: str = "",
              params: Sequence[Param] = ()) -> Callable[[RowFn], RowFn]:
    """Register a row function; it returns one or more results.

    A row that ``needs`` something is not called where it is missing (run
    through :func:`run_rows` or directly): the row reports :func:`not_run`
    with the reason instead, so its body can assume what it needs. ``params``
    are the ``--param`` keys it reads; it is called with their values parsed
    (``options.value``), a bad one refused first (:class:`BenchError`).
    """
    if needs not in _NEEDS:
        raise BenchError(f"benchmark row {name!r} needs {needs!r}; known needs: {_NEEDS[1:]}")
    declared = tuple(params)

    def deco(fn: RowFn) -> RowFn:
        if name in ROWS:
            raise BenchError(f"benchmark row {name!r} is registered twice")

        @functools.wraps(fn)
        def run(options: BenchOptions) -> list[BenchResult]:
            values = _params.resolve(name, declared, options.params)
            why = missing(needs)
            return [not_run(name, title, why)] if why else fn(replace(options, values=values))

        ROWS[name] = BenchRow(name, title, run, heavy=heavy, needs=needs, params=declared)
        return run

    return deco


def missing(needs: str) -> str | None:
    """Why this machine cannot run a row that ``needs`` something, or None."""
    if needs != "cuda":
        return None
    try:
        import torch
    except ImportError:
        return "no CUDA (torch is not installed)"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


def not_run(row: str, title: str, why: str) -> BenchResult:
    """The result of a row this machine cannot run: says so, claims nothing."""
    return BenchResult(
        row=row, title=title, anchor=Figure("not run", 0.0, ""), ours=Figure("not run", 0.0, ""),
        ratio=None, ratio_meaning="", notes=f"not run: {why}", details={"not_run": why},
    )


def load_rows() -> dict[str, BenchRow]:
    """Import every row module (registering its rows) and return the rows.

    A module marked with an extra that is missing goes to ``UNLOADED`` with
    the reason; any other import failure raises ``BenchError`` naming the
    module and the import error.
    """
    for module, extra in ROW_MODULES.items():
        try:
            import_for(module, extra)
        except ExtraMissingError as exc:
            UNLOADED[module] = str(exc)
        except ModuleLoadError as exc:
            raise BenchError(f"benchmark rows cannot load: {exc}") from exc
    return ROWS


def _why_not_run(row: BenchRow, *, skip_heavy: bool, named: bool) -> str | None:
    """Why ``row`` is reported as not run instead of run here, or None."""
    why = missing(row.needs)
    if why is None and skip_heavy and not named and row.heavy:
        why = f"heavy ({row.heavy}); skipped by --skip-heavy"
    return why


def check_request(options: BenchOptions, only: Iterable[str] | None = None, *,
                  skip_heavy: bool = False) -> list[str]:
    """The rows ``only`` names (default: every row), once each is known and
    every ``--param`` is one they take, with a value they accept, that a row
    which runs here would use; else :class:`BenchError`, before any row runs."""
    rows = load_rows()
    names = list(only) if only else list(rows)
    unknown = [n for n in names if n not in rows]
    if unknown:
        unloaded = "".join(f"; rows of {m} not loaded: {why}" for m, why in UNLOADED.items())
        raise BenchError(f"unknown benchmark rows {unknown}; known: {', '.join(rows)}{unloaded}")
    declared = {n: rows[n].params for n in names}
    _params.check_known(declared, options.params, named=bool(only))
    for n in names:
        _params.resolve(n, rows[n].params, options.params)
    skipped = {n: why for n in names
               if (why := _why_not_run(rows[n], skip_heavy=skip_heavy, named=bool(only))) is not None}
    _params.check_used(declared, skipped, options.params)
    return names


def run_rows(
    options: BenchOptions, only: Iterable[str] | None = None, *, skip_heavy: bool = False
) -> list[BenchResult]:
    """Run ``only`` (default: every row). A row whose ``needs`` this machine
    lacks is reported as not run, named or not; ``skip_heavy`` reports the
    heavy rows as not run too (only when no row is named); so is each row
    module whose extra is missing (``UNLOADED``), with no row named."""
    rows = load_rows()
    names = check_request(options, only, skip_heavy=skip_heavy)
    # A module whose extra is missing reports, in place of its rows, that it did not run.
    results: list[BenchResult] = [] if only else [not_run(m, f"rows of {m}", why) for m, why in UNLOADED.items()]
    for n in names:
        row = rows[n]
        why = _why_not_run(row, skip_heavy=skip_heavy, named=bool(only))
        if why is not None:
            results.append(not_run(row.name, row.title, why))
            continue
        results.extend(row.run(options))
    return results


def ratio_text(r: BenchResult) -> str:
    """``"2.50x (faster)"``: the ratio and what it means; ``"n/a"`` when there is none."""
    return "n/a" if r.ratio is None else f"{r.ratio:.2f}x ({r.ratio_meaning})"


def distinct_tables(results: list[BenchResult]) -> list[tuple[str, list[dict[str, Any]]]]:
    """``(row, table)`` for each distinct ``details["table"]`` (a list of flat
    dicts) once, in result order: rows may attach one table to several results."""
    seen: list[object] = []
    out = []
    for r in results:
        table = r.details.get("table")
        if not table or any(table is t for t in seen):
            continue
        seen.append(table)
        out.append((r.row, table))
    return out


def markdown(results: list[BenchResult]) -> str:
    """The table people read: the anchor beside ours in every row."""
    lines = [
        "| row | anchor | ours | ratio | target | notes |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.not_run:
            lines.append(f"| {r.title} | not run | not run | n/a | {r.target} | {r.notes} |")
            continue
        lines.append(
            f"| {r.title} | {r.anchor.label}: {r.anchor.text()} | {r.ours.label}: {r.ours.text()} "
            f"| {ratio_text(r)} | {r.target} | {r.notes} |"
        )
    # The raw measurements, each distinct table once, below the summary.
    for row, table in distinct_tables(results):
        cols = list(table[0])
        lines += ["", f"{row}: raw measurements", ""]
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "---|" * len(cols))
        lines += ["| " + " | ".join(str(t[c]) for c in cols) + " |" for t in table]
    return "\n".join(lines) + "\n"


def parse_size(text: str) -> int:
    """``2G``, ``512M``, ``64K`` (binary units, optional trailing B/iB) or a byte count >= 1."""
    try:
        return _params.size(text)
    except argparse.ArgumentTypeError as exc:
        raise BenchError(f"--size: {exc}") from None


def default_workdir() -> Path:
    return Path(os.environ.get("PRELOAD_GATE_BENCH_DIR") or os.environ.get("TMPDIR") or "/tmp")


def scratch(options: BenchOptions, prefix: str) -> Path:
    """A new scratch directory under the bench workdir; the row removes it."""
    from pgbase.survivor import register_scratch

    base = options.workdir or default_workdir()
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    register_scratch(work)  # a bench killed (SIGTERM, kill -9) leaves none of it: its survivor removes it
    return work


def progress(text: str) -> None:
    """One line per step on a terminal; rows can take a minute at 50 ms a round trip."""
    if sys.stderr.isatty():
        print(text, file=sys.stderr, flush=True)
