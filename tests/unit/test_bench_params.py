"""``preload-gate bench --param KEY=VALUE``: declared per row, checked before any row runs.

New-user F8: a value a row's ``int()`` could not read was a traceback
(``shards=abc``), an out-of-range one failed deep inside the row or was
silently meaningless (``trip_repeats=0``, ``clients=0``), and a key no row
reads (``shard=3``) was ignored. Every row now declares its parameters, and
a bad key or value is one line naming the row, the key and what is allowed.

One row per declared parameter: a value it refuses, and a good neighbour
that passes the same check; a check that every declared parameter has a
row, and that every ``options.value(...)`` a row module reads is declared.
Nothing here runs a row (the check comes first; the rows are never called).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from harness.bench import ROWS, BenchError, BenchOptions, check_request, load_rows, run_rows

pytestmark = pytest.mark.unit

# row, key, a refused value, what the line names, an accepted value.
CASES = [
    ("restart_identity", "shards", "abc", "is not an integer", "5"),
    ("restart_identity", "shard_mb", "0", "is not a positive number", "0.05"),
    ("restart_identity", "latency_ms", "-1", "is negative", "0"),
    ("restart_identity", "stat_latency_ms", "fast", "is not a number", "2.5"),
    ("restart_identity", "header_impl", "mine", "is not one of auto, vllm, reimpl", "reimpl"),
    ("restart_identity", "trip_shards", "6,0", "is not a positive integer", "6,4"),
    ("restart_identity", "trip_repeats", "0", "is not a positive integer", "2"),
    ("restart_identity", "schemes", "content/stat,nope", "unknown nope", "content/stat,content/pinned"),
    ("promote_throughput", "hash_shards", "-2", "is not a positive integer", "4"),
    ("promote_throughput", "repeats", "1.5", "is not an integer", "1"),
    ("promote_throughput", "workers", "-1", "is negative", "0"),
    ("daemon_weight_load", "model", "/no/such/model", "is neither tiny, smollm2 nor a directory", "tiny"),
    ("rollout_switch", "model", "/no/such/model", "is neither tiny, smollm2 nor a directory", "tiny"),
    ("daemon_peak_memory", "size", "lots", "bad size", "64M"),
    ("daemon_peak_memory", "model", "huge", "is neither tiny, smollm2 nor a directory", "smollm2"),
    ("gpu_attach", "tensors", "0", "is not a positive integer", "8"),
    ("gpu_attach", "reps", "x", "is not an integer", "3"),
    ("gpu_checksum", "tensors", "-8", "is not a positive integer", "8"),
    ("gpu_checksum", "reps", "0", "is not a positive integer", "1"),
    ("gpu_daemon_attach", "tensors", "1e3", "is not an integer", "40"),
    ("gpu_daemon_attach", "reps", "-1", "is not a positive integer", "2"),
    ("gpu_readopt", "tensors", "x", "is not an integer", "40"),
    ("gate_selftest", "mutations", "bogus", "unknown mutation bogus", "identical_copy,zeroed_norm"),
    ("gate_selftest", "jobs", "0", "is not a positive integer", "2"),
    ("gate_ray", "mutations", "bogus", "unknown mutation bogus", "identical_copy"),
    ("attach_load", "clients", "0", "is not a positive integer", "4"),
    ("attach_load", "rounds", "many", "is not an integer", "1"),
    ("attach_load", "load_mb", "nan", "is not a finite number", "1.5"),
    ("attach_load", "load_shards", "0", "is not a positive integer", "2"),
]


@pytest.fixture(autouse=True)
def _rows_never_run(monkeypatch):
    """A check that let a bad value through would run the row: fail instead."""
    for name, row in list(load_rows().items()):
        monkeypatch.setitem(ROWS, name, replace(row, run=lambda _o, name=name: pytest.fail(f"row {name} ran")))


@pytest.mark.parametrize(("row", "key", "bad", "why", "good"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_a_bad_value_is_one_line_naming_row_key_and_rule(tmp_path, row, key, bad, why, good):
    declared = {p.name: p for p in load_rows()[row].params}
    with pytest.raises(BenchError) as caught:
        run_rows(BenchOptions(workdir=tmp_path, params={key: bad}), [row])
    line = str(caught.value)
    assert line.startswith(f"bench row {row}: --param {key}={bad}: ") and why in line, line
    assert line.endswith(f"allowed: {declared[key].allowed}") and "\n" not in line
    # The neighbour: a good value passes the same check (and is parsed, not text).
    assert check_request(BenchOptions(workdir=tmp_path, params={key: good}), [row]) == [row]
    assert not list(tmp_path.iterdir()), "refused before anything was written"


def test_every_declared_parameter_has_a_row():
    declared = {(r.name, p.name) for r in load_rows().values() for p in r.params}
    assert declared == {(row, key) for row, key, *_ in CASES}


def test_every_parameter_a_row_reads_is_declared():
    """``options.value("k")`` in a row module reads a declared key (a read of
    an undeclared one would fail only when that row runs, on a GPU box)."""
    bench = Path(__file__).resolve().parents[2] / "harness" / "bench"
    read = {k for f in bench.glob("*.py") for k in re.findall(r'options\.value\("(\w+)"\)', f.read_text())}
    declared = {p.name for r in load_rows().values() for p in r.params}
    assert read and read <= declared, sorted(read - declared)
    assert not any("options.param(" in f.read_text() for f in bench.glob("*.py")), "raw text reads are gone"


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


def test_a_row_reads_parsed_values_and_defaults(monkeypatch):
    """The row gets numbers, not text, and the declared default where no key is given."""
    from harness.bench import bench_row
    from harness.bench.params import Param, positive_int

    seen = []

    @bench_row("_probe_row", "probe", params=(Param("n", positive_int, 7, "an integer >= 1"),))
    def probe(options: BenchOptions) -> list:
        seen.append(options.value("n"))
        return []

    try:
        probe(BenchOptions(params={"n": "3"}))
        probe(BenchOptions())
        with pytest.raises(BenchError, match="bench row _probe_row: --param n=0: "):
            probe(BenchOptions(params={"n": "0"}))
    finally:
        ROWS.pop("_probe_row")
    assert seen == [3, 7]
