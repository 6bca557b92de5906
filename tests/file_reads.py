"""What a library reads from a folder: every file it opens there.

Two witnesses, because a loader may open a file from Rust or C++ where
Python's audit hooks do not see it: the ``open`` audit event (every file
Python opens), and the files transformers' tokenizer loader resolves for
its backend (``PreTrainedTokenizerBase._from_pretrained``'s
``resolved_vocab_files``, the one place every tokenizer class loads through).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_watch: list[set[str] | None] = [None]  # the files being collected, or None: the hook is off
_installed: list[bool] = []


def _audit(event: str, args: tuple) -> None:
    seen = _watch[0]
    if seen is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        seen.add(os.path.realpath(os.fsdecode(args[0])))


@contextlib.contextmanager
def reads_of(root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[set[str]]:
    """The files under ``root`` read inside the block, relative to ``root``
    (filled in when the block ends)."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    if not _installed:
        sys.addaudithook(_audit)  # hooks cannot be removed: this one is off outside the block
        _installed.append(True)
    resolved: list[str] = []
    original = PreTrainedTokenizerBase._from_pretrained.__func__  # type: ignore[attr-defined]

    def spy(cls, resolved_vocab_files, *args, **kwargs):  # noqa: ANN001, ANN202
        resolved.extend(p for p in resolved_vocab_files.values() if isinstance(p, str))
        return original(cls, resolved_vocab_files, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "_from_pretrained", classmethod(spy))
    real = os.path.realpath(root)
    out: set[str] = set()
    _watch[0] = opened = set()
    try:
        yield out
    finally:
        _watch[0] = None
        for p in opened | {os.path.realpath(r) for r in resolved}:
            if p.startswith(real + os.sep) and os.path.isfile(p):
                out.add(Path(os.path.relpath(p, real)).as_posix())
