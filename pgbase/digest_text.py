"""A SHA-256 digest as text: the one reader of every digest we are handed.

A checkpoint's identity is its content digest, and it reaches us as text
from many places: a flag (``preload --expect-digest``, ``canary check
--expect-digest``), the loader's extra config (``expected_digest``), a
manifest, a golden file, a load event, a daemon's reply or ``/metrics``.
All of them go through :func:`parse_digest`, so one rule holds everywhere:

- exactly 64 characters, each ``0-9``, ``a-f`` or ``A-F``; nothing is
  stripped (a pasted trailing space or newline is refused by name, never
  silently dropped: the value is then not what was typed, and a config that
  only works by accident stops working when it is read another way);
- upper case is accepted and returned as lower case, the form ``sha256sum``,
  ``hashlib`` and ``preload-gate promote`` print: the same content is one
  digest, one socket directory and one cache key however it was pasted;
- anything else is a :class:`~pgbase.errors.DigestFormatError` whose one
  line names the field, shows the value, says what is wrong and how to get
  a digest.

The 16-character prefix (:data:`SHORT_CHARS`) is something else: it names
socket directories (``<socket_root>/<digest[:16]>``) and is what status
lines print (:func:`short_digest`). It is never read back as an identity;
:func:`parse_digest` refuses it with a line that says so.

>>> parse_digest("AB" * 32, "--expect-digest") == "ab" * 32
True
"""

from __future__ import annotations

from pgbase.errors import DigestFormatError

DIGEST_CHARS = 64
SHORT_CHARS = 16
_HEX = frozenset("0123456789abcdefABCDEF")
HOW_TO_GET = "as `preload-gate promote CKPT` prints it"
_SHOWN = 80  # characters of a bad value the message repeats


def parse_digest(value: object, field: str) -> str:
    """``value`` as a lower-case SHA-256 hex digest; ``field`` names where it
    came from (a flag, a config key, ``file: key``) in the refusal, or is
    "" where the caller prefixes its own name (argparse: "argument --flag:").

    Raises :class:`~pgbase.errors.DigestFormatError` (one line) for anything
    but 64 hex characters: wrong length, a non-hex character, surrounding
    whitespace, an empty string, a value that is not a string.

    >>> parse_digest("ab" * 31, "expected_digest")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
      ...
    pgbase.errors.DigestFormatError: expected_digest 'abab...' is not a SHA-256 digest: it is 62 characters, ...
    """
    if not isinstance(value, str):
        return _refuse(value, field, f"it is {type(value).__name__}, not a string")
    if value != value.strip():
        return _refuse(value, field, "it has surrounding whitespace; pass the 64 characters alone")
    if not value:
        return _refuse(value, field, "it is empty")
    if len(value) != DIGEST_CHARS:
        why = f"it is {len(value)} characters, not {DIGEST_CHARS}"
        if len(value) == SHORT_CHARS:
            why += " (16 is the prefix status prints and socket directories are named by, not a digest)"
        return _refuse(value, field, why)
    if not _HEX.issuperset(value):  # one C-level pass: pinned restarts read a digest on every start
        bad = next(i for i, c in enumerate(value) if c not in _HEX)
        return _refuse(value, field, f"character {bad + 1} ({value[bad]!r}) is not hex")
    return value.lower()


def short_digest(digest: str) -> str:
    """The first :data:`SHORT_CHARS` characters: a socket directory's name, a
    status line's label. For showing and naming only; never parsed back."""
    return digest[:SHORT_CHARS]


def _refuse(value: object, field: str, why: str) -> str:
    shown = repr(value) if len(repr(value)) <= _SHOWN else repr(value)[:_SHOWN] + "..."
    where = f"{field} " if field else ""
    raise DigestFormatError(
        f"{where}{shown} is not a SHA-256 digest: {why}; a digest is {DIGEST_CHARS} hex characters "
        f"(0-9, a-f, either case), {HOW_TO_GET}", field)
