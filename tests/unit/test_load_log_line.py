"""The ``preload-gate load:`` log line appears exactly once per load, in any
process: none configured logging (a vLLM worker configures only its ``vllm``
logger, so Python's last-resort handler used to drop a hit's INFO line), the
host configured it (printed once, by the host's handler), or vLLM did
(printed once, by vLLM's handler, in vLLM's format).

Each case runs in a fresh interpreter, so the logging state is exactly the
one written in its script, and counts the lines on its stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from preload.events import LOG_PREFIX

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

EMIT = """
from preload.events import LoadEvent, emit
emit(LoadEvent(outcome="hit", reason="daemon served the key", source="daemon"))
emit(LoadEvent(outcome="miss", reason="no daemon", source="disk"))
"""
# What the old emit did: INFO on a logger nobody gave a handler.
OLD_STUB = """
import logging
logging.getLogger("preload.load").info("preload-gate load: {\\"outcome\\": \\"hit\\"}")
logging.getLogger("preload.load").warning("preload-gate load: {\\"outcome\\": \\"miss\\"}")
"""


def _run(script: str, stream: str = "stderr") -> list[str]:
    """The lines holding the load prefix that ``script``, run in a fresh
    interpreter, wrote to ``stream`` ("stderr", or "both": vLLM logs to stdout)."""
    env = {k: v for k, v in os.environ.items() if k != "PRELOAD_GATE_EVENTS"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stderr if stream == "stderr" else out.stdout + out.stderr
    if stream == "stderr":
        assert LOG_PREFIX not in out.stdout
    return [line for line in text.splitlines() if LOG_PREFIX in line]


def _outcomes(lines: list[str]) -> list[str]:
    return [json.loads(line.split(LOG_PREFIX, 1)[1])["outcome"] for line in lines]


def test_control_old_emit_drops_a_hit_when_nothing_is_configured() -> None:
    # The difference this file tests for: the old call printed the miss
    # (through the last-resort handler) and nothing for the hit.
    assert _outcomes(_run(OLD_STUB)) == ["miss"]


def test_one_line_per_load_when_nothing_is_configured() -> None:
    lines = _run(EMIT)
    assert _outcomes(lines) == ["hit", "miss"]
    assert all(line.startswith(LOG_PREFIX) for line in lines)


def test_host_configured_root_prints_it_once_in_its_format() -> None:
    # basicConfig's default level is WARNING: the hit must still show, once.
    lines = _run('import logging\nlogging.basicConfig(format="HOST %(levelname)s %(name)s %(message)s")\n'
                 + EMIT)
    assert _outcomes(lines) == ["hit", "miss"]
    assert lines[0].startswith(f"HOST INFO preload.load {LOG_PREFIX}")
    assert lines[1].startswith(f"HOST WARNING preload.load {LOG_PREFIX}")


def test_handler_on_preload_load_prints_it_once() -> None:
    script = """
    import logging, sys
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("MINE %(message)s"))
    logging.getLogger("preload.load").addHandler(h)
    """
    lines = _run(textwrap.dedent(script) + EMIT)
    assert _outcomes(lines) == ["hit", "miss"]
    assert all(line.startswith(f"MINE {LOG_PREFIX}") for line in lines)


def test_logging_configured_after_import_is_honoured() -> None:
    # The route is chosen per load: configuring logging later moves the line
    # to the host's handler, it does not add a second one.
    script = """
    import logging
    import preload.events
    logging.basicConfig(format="LATE %(message)s")
    """
    lines = _run(textwrap.dedent(script) + EMIT)
    assert _outcomes(lines) == ["hit", "miss"]
    assert all(line.startswith(f"LATE {LOG_PREFIX}") for line in lines)


def test_vllm_logging_prints_it_once_in_vllm_format() -> None:
    pytest.importorskip("vllm.logger")
    # vLLM's own setup, as its engine core and workers run it; the control
    # first (the old call, nothing printed for the hit), then emit.
    script = """
    import logging, sys
    import vllm.logger
    vllm.logger._configure_vllm_root_logger()
    logging.getLogger("preload.load").info("preload-gate load: {\\"outcome\\": \\"old-hit\\"}")
    """
    lines = _run(textwrap.dedent(script) + EMIT, stream="both")
    assert _outcomes(lines) == ["hit", "miss"]
    assert " INFO " in lines[0] and " WARNING " in lines[1]
    assert all("pid=" in line for line in lines)  # vLLM's format: "(Process pid=N) LEVEL date [file:line] msg"


def test_a_broken_handler_does_not_fail_the_load(tmp_path: Path) -> None:
    script = f"""
    import logging
    class Boom(logging.Handler):
        def emit(self, record): raise RuntimeError("boom")
        def handleError(self, record): raise RuntimeError("boom again")
    logging.getLogger("preload.load").addHandler(Boom())
    from preload.events import LoadEvent, emit, read_events
    assert emit(LoadEvent(outcome="hit", reason="x"), {str(tmp_path / "ev.jsonl")!r})
    assert [e["outcome"] for e in read_events({str(tmp_path / "ev.jsonl")!r})] == ["hit"]
    """
    assert _run(script) == []
