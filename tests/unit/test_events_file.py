"""The events file as the loader writes it and every reader reads it: one
reader (``preload.events.read_events``), used by the engine runner, so a
torn line reaches the verdict instead of being lost or crashing the gate."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import engine as engine_runner
from harness.engine import EngineResult
from harness.verdict import BLOCK, PASS, Expectation, judge
from preload.events import LoadEvent, emit, read_events

pytestmark = pytest.mark.unit

DIGEST = "a" * 64
TOKENS = [[5, 6, 7]]


def _hits(path: Path, ranks: int) -> list[dict]:
    events = [LoadEvent(outcome="hit", reason="daemon served the key", digest=DIGEST, daemon_digest=DIGEST,
                        rank=r, source="daemon") for r in range(ranks)]
    for ev in events:
        assert emit(ev, str(path), loud=False)
    return [ev.to_json() for ev in events]


def test_read_events_keeps_bad_lines_in_place(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    assert read_events(path) == []  # no file: the engine never loaded with events on
    written = _hits(path, 2)
    assert read_events(path) == written  # the control: what emit wrote comes back as written
    torn = path.read_text(encoding="utf-8").splitlines()[0][:40]
    with path.open("a", encoding="utf-8") as f:
        f.write("\n" + torn + "\n[1, 2]\n")
    assert read_events(path) == [*written, {"outcome": "malformed", "raw": torn},
                                 {"outcome": "malformed", "raw": "[1, 2]"}]


def test_engine_runner_reads_with_the_same_reader_and_a_torn_line_blocks(tmp_path: Path) -> None:
    assert engine_runner.read_events is read_events  # one reader: the runner does not carry its own
    path = tmp_path / "events.jsonl"
    _hits(path, 2)
    exp = Expectation("hit", DIGEST, DIGEST, ranks=2)
    ref = EngineResult(ok=True, token_ids=TOKENS, logprobs=[[{"5": -0.5}, {"6": -0.5}, {"7": -0.5}]])

    def cand() -> EngineResult:
        return EngineResult(ok=True, token_ids=TOKENS, logprobs=ref.logprobs, events=read_events(path))

    assert judge(exp, ref, cand()).status == PASS  # control: the well-formed file passes
    with path.open("a", encoding="utf-8") as f:
        f.write('{"outcome": "hit", "rank": 1, "dig\n')  # a write cut short
    v = judge(exp, ref, cand())
    assert v.status == BLOCK and "error" in v.reasons
    assert any("malformed" in d for d in v.details)
