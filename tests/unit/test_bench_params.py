"""``preload-gate bench --param KEY=VALUE``: declared once per row, checked before any row runs.

The table is the registry itself: every parameter of every row, each text
its kind names on either side of each bound (an ill-typed one, one past the
range) and the kind's ``allowed`` line. A refused text is one line naming
the row, the key, the value and what is allowed; an accepted one passes the
same check (the neighbour). Every numeric parameter declares both bounds
(``Kind.bounds``), and the table derives from them, not from the kind's own
samples, the value just outside each bound (refused) and the bound itself
(accepted). A new row or parameter is covered by being
declared. Unknown keys, keys given twice, and keys every running row would
leave unused (its rows do not run here; the row's other values leave it
out, one row per ``Param.unused``, with a check that every such parameter
has one) are refused the same way. Nothing here runs a row (the check comes
first; the rows are never called).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from harness.bench import ROWS, BenchError, BenchOptions, check_request, load_rows, run_rows
from harness.bench import params as P

pytestmark = pytest.mark.unit


def _every_param() -> list[tuple[str, P.Param]]:
    return [(r.name, p) for r in load_rows().values() for p in r.params]


PARAMS = _every_param()
REFUSED = [(row, p, text) for row, p in PARAMS for text in p.kind.refused]
ACCEPTED = [(row, p, text) for row, p in PARAMS for text in p.kind.accepted]


def _numeric(value) -> bool:
    items = value if isinstance(value, tuple) else (value,)
    return bool(items) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items)


def _unbounded(kind: P.Kind) -> str | None:
    """Why a numeric ``kind`` is not bounded on both sides (None: it is, or
    it is no number): a value past an absent bound reaches the row (clients=10**9
    is a MemoryError in the row, load_mb=1e-300 a checkpoint of nothing)."""
    if not _numeric(kind.parse(kind.accepted[0])):
        return None
    bounds = getattr(kind, "bounds", None)
    if bounds is None:
        return "declares no bounds"
    lo, hi = bounds
    if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
        return f"bounds {bounds} are not a finite range"
    return None


def _edges(kind: P.Kind) -> tuple[list[str], list[str]]:
    """(just outside each bound, each bound) as texts, from ``kind.bounds``."""
    bounds = getattr(kind, "bounds", None)
    if bounds is None or not _numeric(kind.parse(kind.accepted[0])):
        return [], []
    lo, hi = bounds
    if isinstance(lo, int) and isinstance(hi, int):
        return [str(lo - 1), str(hi + 1)], [str(lo), str(hi)]
    return [repr(math.nextafter(lo, -math.inf)), repr(math.nextafter(hi, math.inf))], [repr(lo), repr(hi)]


BOUNDED = [(row, p) for row, p in PARAMS if _edges(p.kind)[0]]
PAST = [(row, p, text) for row, p in BOUNDED for text in _edges(p.kind)[0]]
AT = [(row, p, text) for row, p in BOUNDED for text in _edges(p.kind)[1]]
# The values issue 25 reported (and their kin): each refused by its kind before the row starts.
REPORTED = [("attach_load", "clients", "1000000000"), ("attach_load", "load_mb", "1e-300"),
            ("attach_load", "load_mb", "nan"), ("attach_load", "load_mb", "inf"), ("attach_load", "load_mb", "-1"),
            ("attach_load", "load_mb", "-inf"), ("restart_identity", "shard_mb", "1e-300"),
            ("restart_identity", "trip_shards", "1000,1000000000"), ("daemon_peak_memory", "size", "1000000G")]


@pytest.fixture(autouse=True)
def _rows_never_run(monkeypatch):
    """A check that let a bad value through would run the row: fail instead.
    Every row runs here as far as the check knows (CUDA rows included), so a
    value is judged by its kind alone; the unused rows below say otherwise."""
    for name, row in list(load_rows().items()):
        monkeypatch.setitem(ROWS, name, replace(row, run=lambda _o, name=name: pytest.fail(f"row {name} ran")))
    monkeypatch.setattr("harness.bench.missing", lambda needs: None)


def test_the_registry_declares_parameters():
    assert len(PARAMS) >= 20 and len(REFUSED) >= 3 * len(PARAMS) - 10
    for row, p in PARAMS:
        assert p.kind.refused and p.kind.accepted, (row, p.name)
        # The default is a value of the kind (None: the row derives it, and says from what).
        assert p.default is not None or p.help, (row, p.name)


@pytest.mark.parametrize(("row", "param", "text"), REFUSED, ids=[f"{r}-{p.name}-{t!r}" for r, p, t in REFUSED])
def test_a_refused_value_is_one_line_naming_row_key_and_rule(tmp_path, row, param, text):
    with pytest.raises(BenchError) as caught:
        run_rows(BenchOptions(workdir=tmp_path, params={param.name: text}), [row])
    line = str(caught.value)
    assert line.startswith(f"bench row {row}: --param {param.name}={text}: "), line
    assert line.endswith(f"; allowed: {param.allowed}") and "\n" not in line and "Traceback" not in line
    assert not list(tmp_path.iterdir()), "refused before anything was written"


@pytest.mark.parametrize(("row", "param", "text"), ACCEPTED, ids=[f"{r}-{p.name}-{t!r}" for r, p, t in ACCEPTED])
def test_an_accepted_value_passes_the_same_check(row, param, text):
    assert check_request(BenchOptions(params={param.name: text}), [row]) == [row]


def test_every_numeric_parameter_declares_both_bounds():
    numeric = [(row, p.name) for row, p in PARAMS if _numeric(p.kind.parse(p.kind.accepted[0]))]
    assert len(numeric) >= 15
    assert {(row, p.name) for row, p in BOUNDED} == set(numeric)
    assert not [(row, p.name, why) for row, p in PARAMS if (why := _unbounded(p.kind))]


@pytest.mark.parametrize(("row", "param", "text"), PAST, ids=[f"{r}-{p.name}-{t}" for r, p, t in PAST])
def test_a_value_just_past_a_declared_bound_is_refused(tmp_path, row, param, text):
    test_a_refused_value_is_one_line_naming_row_key_and_rule(tmp_path, row, param, text)
    # The line names both bounds (an int as written, a float as %g writes it).
    assert all((str(b) if isinstance(b, int) else f"{b:g}") in param.allowed for b in param.kind.bounds), param.allowed


@pytest.mark.parametrize(("row", "param", "text"), AT, ids=[f"{r}-{p.name}-{t}" for r, p, t in AT])
def test_a_value_at_a_declared_bound_is_accepted(row, param, text):
    test_an_accepted_value_passes_the_same_check(row, param, text)


@pytest.mark.parametrize(("row", "key", "text"), REPORTED, ids=[f"{r}-{k}-{t}" for r, k, t in REPORTED])
def test_the_reported_values_are_refused(tmp_path, row, key, text):
    param = next(p for p in load_rows()[row].params if p.name == key)
    test_a_refused_value_is_one_line_naming_row_key_and_rule(tmp_path, row, param, text)


def test_control_an_unbounded_numeric_kind_is_caught():
    """The check above flags a numeric kind with no upper bound (the old
    ``integer(1)``), and passes a bounded one and a kind that is no number."""
    lax = P.Kind(int, "an integer >= 1", ("0",), ("1",))
    assert _unbounded(lax) == "declares no bounds" and _edges(lax) == ([], [])
    assert _unbounded(P.Kind(float, "a number", ("x",), ("1",), bounds=(0.0, math.inf))) is not None
    assert _unbounded(P.integer(1, 9)) is None and _edges(P.integer(1, 9)) == (["0", "10"], ["1", "9"])
    assert _unbounded(P.choice("a", "b")) is None


# Each parameter a row may leave out (its Param.unused), and other values that leave it out.
UNUSED = [
    ("restart_identity", "trip_shards", {"schemes": "header_only,content/pinned"}, "round trips are counted only "
     "with content/stat in schemes"),
    ("restart_identity", "trip_shards", {"latency_ms": "0"}, "only under a stat latency > 0"),
    ("restart_identity", "trip_shards", {"latency_ms": "5", "stat_latency_ms": "0"}, "only under a stat latency"),
    ("restart_identity", "trip_repeats", {"schemes": "content/pinned"}, "only with content/stat in schemes"),
]


@pytest.mark.parametrize(("row", "key", "others", "why"), UNUSED, ids=[f"{u[1]}-{sorted(u[2])}" for u in UNUSED])
def test_a_value_the_row_leaves_out_is_refused(tmp_path, row, key, others, why):
    declared = {p.name: p for p in load_rows()[row].params}
    good = declared[key].kind.accepted[0]
    with pytest.raises(BenchError) as caught:
        run_rows(BenchOptions(workdir=tmp_path, params={key: good, **others}), [row])
    line = str(caught.value)
    assert line.startswith(f"--param {key}={good} would be unused: bench row {row}: ") and why in line, line
    assert line.endswith("drop it, or change what leaves it out") and "\n" not in line
    # The neighbour: the same other values without the key pass.
    assert check_request(BenchOptions(params=others), [row]) == [row]
    assert not list(tmp_path.iterdir())


def test_every_parameter_a_row_may_leave_out_has_a_row():
    may = {(row, p.name) for row, p in PARAMS if p.unused is not None}
    assert may == {(row, key) for row, key, *_ in UNUSED}
    # Under the defaults each is read: test_an_accepted_value_passes_the_same_check gives it alone.


def test_a_key_whose_rows_do_not_run_here_is_refused(monkeypatch):
    """The GPU rows' keys on a machine without CUDA, and a heavy row's under
    --skip-heavy, would change nothing: refused, naming the row and why."""
    monkeypatch.setattr("harness.bench.missing", lambda needs: "no CUDA device is visible" if needs else None)
    with pytest.raises(BenchError) as caught:
        run_rows(BenchOptions(params={"tensors": "8"}), ["gpu_attach", "gpu_checksum"])
    assert str(caught.value) == (
        "--param tensors=8 would be unused: bench row gpu_attach does not run here (no CUDA device is visible); "
        "bench row gpu_checksum does not run here (no CUDA device is visible); drop it, or change what leaves "
        "it out")
    with pytest.raises(BenchError, match=r"^--param jobs=2 would be unused: bench row gate_selftest does not run "
                                         r"here \(heavy \(.*\); skipped by --skip-heavy\)"):
        run_rows(BenchOptions(params={"jobs": "2"}), skip_heavy=True)
    # Controls: a row that runs reads it, with the others skipped or not.
    monkeypatch.setattr("harness.bench.missing", lambda needs: None)
    assert check_request(BenchOptions(params={"tensors": "8"}), ["gpu_attach", "gpu_checksum"])
    assert check_request(BenchOptions(params={"clients": "2"}), skip_heavy=True)


def test_a_key_given_twice_is_refused():
    with pytest.raises(BenchError, match=r"^--param jobs is given twice \(1, 2\); give it once$"):
        P.given(["jobs=1", "jobs=2"])
    with pytest.raises(BenchError, match="^--param wants KEY=VALUE, got 'jobs'$"):
        P.given(["jobs"])
    assert P.given(["jobs=1", "clients=2", "schemes=a=b"]) == {"jobs": "1", "clients": "2", "schemes": "a=b"}


def test_every_parameter_a_row_reads_is_declared():
    """``options.value("k")`` in a row module reads a declared key (a read of
    an undeclared one would fail only when that row runs, on a GPU box)."""
    bench = Path(__file__).resolve().parents[2] / "harness" / "bench"
    read = {k for f in bench.glob("*.py") for k in re.findall(r'options\.value\("(\w+)"\)', f.read_text())}
    declared = {p.name for _, p in PARAMS}
    assert read and read <= declared, sorted(read - declared)
    assert not any("options.params[" in f.read_text() or "options.params.get" in f.read_text()
                   for f in bench.glob("*.py")), "raw text reads are gone"


def test_an_unknown_key_names_the_row_and_its_parameters(tmp_path):
    with pytest.raises(BenchError) as caught:
        run_rows(BenchOptions(workdir=tmp_path, params={"shard": "3"}), ["restart_identity"])
    assert str(caught.value).startswith("bench row restart_identity has no parameter 'shard' (did you mean shards?); "
                                        "its parameters: shards, shard_mb, latency_ms")
    with pytest.raises(BenchError, match="bench row preflight_failure has no parameter 'shards'.*: none$"):
        run_rows(BenchOptions(workdir=tmp_path, params={"shards": "3"}), ["preflight_failure"])
    # A key one of the rows asked for takes is fine for the others (each reads its own).
    assert check_request(BenchOptions(params={"clients": "2"}), ["restart_identity", "attach_load"])
    with pytest.raises(BenchError, match="no bench row of restart_identity, attach_load takes --param client "):
        run_rows(BenchOptions(params={"client": "2"}), ["restart_identity", "attach_load"])
    with pytest.raises(BenchError, match="^no bench row takes --param nope; see preload-gate bench --list"):
        run_rows(BenchOptions(params={"nope": "1"}))
    assert not list(tmp_path.iterdir())


def test_a_row_reads_parsed_values_and_defaults():
    """The row gets numbers, not text, and the declared default where no key is given."""
    from harness.bench import bench_row

    seen = []

    @bench_row("_probe_row", "probe", params=(P.Param("n", P.integer(1, 9), 7),))
    def probe(options: BenchOptions) -> list:
        seen.append(options.value("n"))
        return []

    try:
        probe(BenchOptions(params={"n": "3"}))
        probe(BenchOptions())
        with pytest.raises(BenchError, match="^bench row _probe_row: --param n=0: 0 is out of range; allowed: an "
                                             "integer from 1 to 9$"):
            probe(BenchOptions(params={"n": "0"}))
    finally:
        ROWS.pop("_probe_row")
    assert seen == [3, 7]


def test_control_a_kind_whose_samples_lie_fails_the_table():
    """A kind whose ``refused`` text it accepts (a range written in words but
    not enforced) is caught by the same check the table runs."""
    lax = P.Kind(int, "an integer >= 1", ("0",), ("1",))
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        with pytest.raises(BenchError):
            P.resolve("probe", [P.Param("n", lax, 1)], {"n": "0"})
