"""The numeric flag types as a table: each type refuses its edge value with a
message naming it, and accepts the neighbour on the other side of the edge
(the control that the refusal is the bound's doing, not the parse's)."""

from __future__ import annotations

import argparse

import pytest

from pgbase import cliargs

pytestmark = pytest.mark.unit

# (type, refused text, message it must carry, accepted neighbour, its value)
TABLE = [
    ("positive_int", "0", "0 is not a positive integer; give 1 or more", "1", 1),
    ("nonnegative_int", "-1", "-1 is negative; give 0 or more", "0", 0),
    ("seed_int", "4294967296", "give 0 to 4294967295", "4294967295", 2**32 - 1),
    ("seed_int", "-1", "-1 is not a seed numpy takes", "0", 0),
    ("port", "65536", "65536 is not a TCP port; give 0-65535", "0", 0),
    ("fixed_port", "0", "0 is not a TCP port; give 1-65535", "65535", 65535),
    ("positive_float", "0", "0 is not a positive number; give more than 0", "0.001", 0.001),
    ("nonnegative_float", "-0.5", "-0.5 is negative; give 0 or more", "0", 0.0),
    # A digest, by pgbase.digest_text's one rule (its own table: test_digest_text.py).
    ("digest_arg", "g" * 64, "character 1 ('g') is not hex", "AB" * 32, "ab" * 32),
    ("size_arg", "0", "less than one byte", "2G", 2 << 30),
    ("size_arg", "2T", "more than 1T", "64M", 64 << 20),
    ("digest_arg", "ab" * 32 + " ", "surrounding whitespace", "ab" * 32, "ab" * 32),
    # The parse itself, before any bound.
    ("positive_int", "1.5", "'1.5' is not an integer", "15", 15),
    ("positive_float", "nan", "'nan' is not a finite number", "1e3", 1000.0),
    ("nonnegative_float", "x", "'x' is not a number", "2", 2.0),
]


@pytest.mark.parametrize("name, bad, message, good, value", TABLE, ids=[f"{r[0]}:{r[1]}" for r in TABLE])
def test_refuses_past_the_bound_and_accepts_its_neighbour(name, bad, message, good, value):
    convert = getattr(cliargs, name)
    with pytest.raises(argparse.ArgumentTypeError) as caught:
        convert(bad)
    assert message in str(caught.value)
    assert convert(good) == value and type(convert(good)) is type(value)


def test_every_type_has_a_row_and_a_name_of_its_own():
    types = {n for n in dir(cliargs) if not n.startswith("_") and callable(getattr(cliargs, n))
             and getattr(getattr(cliargs, n), "__module__", "") == cliargs.__name__}
    assert types == {r[0] for r in TABLE}
    assert all(getattr(cliargs, n).__name__ == n and getattr(cliargs, n).__doc__ for n in types)


def test_argparse_prints_the_refusal_as_one_usage_line(capsys):
    parser = argparse.ArgumentParser(prog="pg")
    parser.add_argument("--workers", type=cliargs.positive_int)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--workers", "0"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "pg: error: argument --workers: 0 is not a positive integer; give 1 or more")
    assert parser.parse_args(["--workers", "2"]).workers == 2
