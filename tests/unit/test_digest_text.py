"""The one digest reader (``pgbase.digest_text.parse_digest``) as a table.

Each row is a value a person, a config or a peer could hand us and what the
reader makes of it: the lower-case digest, or a refusal whose one line names
the field, says what is wrong and what a digest looks like. Accepted rows sit
beside refused ones that differ in the one thing the rule is about (case,
length, a character, whitespace).
"""

from __future__ import annotations

import pytest

from pgbase.digest_text import SHORT_CHARS, parse_digest, short_digest
from pgbase.errors import DigestFormatError, PreloadGateError

pytestmark = pytest.mark.unit

LOWER = "0123456789abcdef" * 4
UPPER = LOWER.upper()

ACCEPTED = [
    ("valid lower", LOWER, LOWER),
    ("valid upper, read as lower", UPPER, LOWER),
    ("valid mixed case", LOWER[:32] + UPPER[32:], LOWER),
]

# (id, value, what the one line must say about it)
REFUSED = [
    ("63 characters", LOWER[:63], "it is 63 characters, not 64"),
    ("65 characters", LOWER + "0", "it is 65 characters, not 64"),
    ("non-hex, 64 characters", "g" * 64, "character 1 ('g') is not hex"),
    ("non-hex late, 64 characters", LOWER[:63] + "z", "character 64 ('z') is not hex"),
    ("empty", "", "it is empty"),
    ("leading space", " " + LOWER, "surrounding whitespace"),
    ("trailing newline", LOWER + "\n", "surrounding whitespace"),
    ("whitespace only", " " * 64, "surrounding whitespace"),
    ("inner space, 64 characters", LOWER[:31] + " " + LOWER[32:], "character 32 (' ') is not hex"),
    ("16-character prefix", LOWER[:SHORT_CHARS], "prefix status prints and socket directories are named by"),
    ("0x prefix", "0x" + LOWER[:62], "character 2 ('x') is not hex"),
    ("not a string", None, "it is NoneType, not a string"),
    ("bytes, not text", LOWER.encode(), "it is bytes, not a string"),
]


@pytest.mark.parametrize("value, want", [r[1:] for r in ACCEPTED], ids=[r[0] for r in ACCEPTED])
def test_accepted_values_read_as_lower_case(value: str, want: str) -> None:
    assert parse_digest(value, "--expect-digest") == want


@pytest.mark.parametrize("value, why", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refused_values_are_one_line_naming_field_problem_and_fix(value: object, why: str) -> None:
    with pytest.raises(DigestFormatError) as info:
        parse_digest(value, "--expect-digest")
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert msg.startswith("--expect-digest "), msg  # the field first
    assert why in msg, msg
    assert "64 hex characters" in msg and "preload-gate promote CKPT" in msg, msg  # the shape, and where to get one
    assert info.value.field == "--expect-digest"
    # One type, catchable as this project's base and as a bad value.
    assert isinstance(info.value, PreloadGateError) and isinstance(info.value, ValueError)


def test_every_refusal_row_differs_from_an_accepted_value() -> None:
    """Control for the table: the refused rows are refused for their own
    reason, not because the reader refuses everything of that length."""
    assert parse_digest("f" * 64, "x") == "f" * 64
    assert parse_digest("F" * 64, "x") == "f" * 64


def test_field_may_be_left_to_the_caller() -> None:
    """argparse prefixes "argument --flag:", so the line starts with the value."""
    with pytest.raises(DigestFormatError, match=r"^'xyz' is not a SHA-256 digest"):
        parse_digest("xyz", "")


def test_long_values_are_shown_cut() -> None:
    with pytest.raises(DigestFormatError) as info:
        parse_digest("x" * 10_000, "expected_digest")
    assert len(str(info.value)) < 400


def test_short_digest_is_the_socket_directory_name() -> None:
    from preload.sockets import socket_dir

    assert short_digest(LOWER) == LOWER[:16]
    assert socket_dir(UPPER, "/r").name == socket_dir(LOWER, "/r").name == short_digest(LOWER)
