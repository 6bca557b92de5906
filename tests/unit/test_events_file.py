"""The events file as the loader writes it and every reader reads it: one
reader (``preload.events.read_events``), used by the engine runner, so a
torn line reaches the verdict instead of being lost or crashing the gate."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from harness.engine import EngineResult, EngineSpec, run_engine
from harness.verdict import BLOCK, PASS, Expectation, judge
from preload.events import LoadEvent, emit, read_events

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]

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


# A stand-in engine worker (``python -m torn_events_engine SPEC OUT``): it
# answers like an engine and leaves the events file the loader would, two
# hits, then (with TORN=1) a line cut short mid-write.
TORN_EVENTS_ENGINE = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    digest = "a" * 64
    lines = [json.dumps({"outcome": "hit", "reason": "daemon served the key", "digest": digest,
                         "daemon_digest": digest, "rank": r, "source": "daemon"}) for r in range(2)]
    if os.environ.get("TORN") == "1":
        lines.append('{"outcome": "hit", "rank": 1, "dig')
    Path(os.environ["PRELOAD_GATE_EVENTS"]).write_text("\\n".join(lines) + "\\n")
    Path(sys.argv[2]).write_text(json.dumps({"ok": True, "token_ids": [[5, 6, 7]], "texts": ["x"],
                                             "logprobs": [[{"5": -0.5}, {"6": -0.5}, {"7": -0.5}]]}))
""")


@pytest.mark.parametrize("torn", [False, True], ids=["control-well-formed", "torn-line"])
def test_engine_runner_keeps_a_torn_line_and_it_blocks(tiny_ckpt: Path, tmp_path: Path, torn: bool) -> None:
    """What run_engine hands the verdict is the events file as written, bad
    line included (read by preload.events.read_events, not a reader of its
    own that could drop it): a torn line blocks, the well-formed file passes."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "torn_events_engine.py").write_text(TORN_EVENTS_ENGINE)
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), str(mods)]), "TORN": "1" if torn else "0"}
    spec = EngineSpec(checkpoint=str(tiny_ckpt), env=env)
    result = run_engine(spec, tmp_path / "engine", timeout_s=120, worker="torn_events_engine")
    assert result.ok, result.error
    exp = Expectation("hit", DIGEST, DIGEST, ranks=2)
    ref = EngineResult(ok=True, token_ids=TOKENS, logprobs=[[{"5": -0.5}, {"6": -0.5}, {"7": -0.5}]])
    v = judge(exp, ref, result)
    if not torn:
        assert v.status == PASS, v
        return
    assert result.events[-1] == {"outcome": "malformed", "raw": '{"outcome": "hit", "rank": 1, "dig'}
    assert v.status == BLOCK and "error" in v.reasons
    assert any("malformed" in d for d in v.details)
