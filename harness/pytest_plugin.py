"""pytest plugin: an output-equivalence test for a preloaded model in a few lines.

Registered through the ``pytest11`` entry point, so installing preload-gate
makes these fixtures available in any project's tests::

    # conftest.py
    import pytest

    @pytest.fixture(scope="session")
    def preload_gate_checkpoint():
        return "/models/my-finetune"

    # test_equivalence.py
    def test_cached_equals_auto(cached_engine, auto_engine, assert_same_output):
        assert_same_output(auto_engine, cached_engine)

(or pass ``--preload-gate-checkpoint DIR`` instead of the fixture).

Fixtures (session-scoped: one daemon and two engine starts per session):

- ``preload_gate_checkpoint``: the checkpoint to test (override it, or use
  the command-line option).
- ``preload_gate_prompts``: the prompts (override to use your own).
- ``preload_daemon``: a running ``preload-gate preload`` on the checkpoint,
  in a private socket root; ``.digest``, ``.socket_root``.
- ``cached_engine`` / ``auto_engine``: :class:`harness.engine.EngineResult`
  of a ``verified_cache`` engine (fallback off: it must hit) and an ``auto``
  engine on the same checkpoint, greedy, temperature 0.
- ``assert_same_output(reference, candidate)``: fails with the first
  differing prompt and position, both tokens decoded, and the load events.

Importing this module does not import vLLM; engines run in subprocesses.
The first of these fixtures a session uses makes pytest a holder
(:mod:`pgbase.survivor`): the daemon, the engines and whatever else the
session starts from then on end with pytest, ``kill -9`` included.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from harness.engine import DEFAULT_PROMPTS, EngineResult, EngineSpec, run_engine
from harness.verdict import first_difference


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("preload-gate")
    group.addoption("--preload-gate-checkpoint", default=None,
                    help="checkpoint for the preload-gate fixtures (or override preload_gate_checkpoint)")
    group.addoption("--preload-gate-dtype", default="bfloat16", help="engine dtype (default bfloat16)")


class _Decoder:
    """Token ids to text with the checkpoint's own tokenizer.json, when it has one."""

    def __init__(self, checkpoint: str | None) -> None:
        self._tok: Any = None
        if checkpoint and (Path(checkpoint) / "tokenizer.json").is_file():
            try:
                from tokenizers import Tokenizer

                self._tok = Tokenizer.from_file(str(Path(checkpoint) / "tokenizer.json"))
            except Exception:  # decoding is a courtesy; ids are always shown
                self._tok = None

    def __call__(self, token: int | None) -> str:
        if token is None:
            return "<end of output>"
        if self._tok is None:
            return f"<id {token}>"
        return repr(self._tok.decode([token], skip_special_tokens=False))


def explain_difference(
    reference: EngineResult,
    candidate: EngineResult,
    checkpoint: str | None = None,
    prompts: Sequence[str] | None = None,
) -> str | None:
    """None when both runs produced the same greedy tokens; else a token-by-token account."""
    if not reference.ok or not candidate.ok:
        which = "reference" if not reference.ok else "candidate"
        r = reference if not reference.ok else candidate
        return f"the {which} engine failed: {r.error}\n{r.log_tail[-1500:]}"
    diff = first_difference(reference.token_ids, candidate.token_ids)
    if diff is None:
        return None
    decode = _Decoder(checkpoint)
    p, i = diff["prompt"], diff["position"]
    prompt = prompts[p] if prompts and p < len(prompts) else f"prompt #{p}"
    same = reference.token_ids[p][:i] if p < len(reference.token_ids) else []
    lines = [
        f"greedy outputs differ for {prompt!r} at generated token {i}:",
        f"  reference: id {diff['reference']} {decode(diff['reference'])}",
        f"  candidate: id {diff['candidate']} {decode(diff['candidate'])}",
        f"  {i} tokens agree before it: {same}",
    ]
    if candidate.events:
        lines.append("  candidate load events: " + "; ".join(json.dumps(e, sort_keys=True) for e in candidate.events))
    return "\n".join(lines)


@pytest.fixture(scope="session")
def preload_gate_checkpoint(request: pytest.FixtureRequest) -> str:
    value = request.config.getoption("--preload-gate-checkpoint")
    if not value:
        pytest.skip("no checkpoint: pass --preload-gate-checkpoint DIR or override preload_gate_checkpoint")
    return str(value)


@pytest.fixture(scope="session")
def preload_gate_prompts() -> tuple[str, ...]:
    return DEFAULT_PROMPTS


@pytest.fixture(scope="session")
def _preload_gate_workdir() -> Iterator[Path]:
    from pgbase.survivor import hold

    hold("pytest plugin")  # every fixture below starts its processes after this one
    d = Path(tempfile.mkdtemp(prefix="pg-plugin-"))
    os.chmod(d, 0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def preload_daemon(preload_gate_checkpoint: str, request: pytest.FixtureRequest,
                   _preload_gate_workdir: Path) -> Iterator[Any]:
    from harness.daemon_process import DaemonProcess
    from preload.promote import promote

    root = _preload_gate_workdir / "sockets"
    root.mkdir(mode=0o700)
    promote(preload_gate_checkpoint, socket_root=root, progress=False)
    dtype = request.config.getoption("--preload-gate-dtype")
    daemon = DaemonProcess(preload_gate_checkpoint, str(root), _preload_gate_workdir / "daemon.log",
                           ["--dtype", dtype, "--max-model-len", "256"])
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()


def _spec(request: pytest.FixtureRequest, checkpoint: str, prompts: Sequence[str], **kw: Any) -> EngineSpec:
    return EngineSpec(checkpoint=checkpoint, dtype=request.config.getoption("--preload-gate-dtype"),
                      prompts=tuple(prompts), **kw)


@pytest.fixture(scope="session")
def auto_engine(preload_gate_checkpoint: str, preload_gate_prompts: Sequence[str],
                request: pytest.FixtureRequest, _preload_gate_workdir: Path) -> EngineResult:
    return run_engine(_spec(request, preload_gate_checkpoint, preload_gate_prompts),
                      _preload_gate_workdir / "auto")


@pytest.fixture(scope="session")
def cached_engine(preload_daemon: Any, preload_gate_checkpoint: str, preload_gate_prompts: Sequence[str],
                  request: pytest.FixtureRequest, _preload_gate_workdir: Path) -> EngineResult:
    extra = {"socket_root": preload_daemon.socket_root, "fallback": False}
    return run_engine(
        _spec(request, preload_gate_checkpoint, preload_gate_prompts, load_format="verified_cache",
              extra_config=extra),
        _preload_gate_workdir / "cached",
    )


def cached_load_problem(candidate: EngineResult) -> str | None:
    """Why a cached engine's load cannot count as a cache hit, or None.

    No load event at all is the silent fallback this project exists to
    catch: the engine served weights from somewhere without saying where.
    """
    if not candidate.events:
        return ("the cached engine recorded no load event: it served without saying where its "
                "weights came from (a silent fallback); a verified_cache load always writes one")
    misses = [e for e in candidate.events if e.get("outcome") != "hit"]
    if misses:
        return "the cached engine did not hit: " + "; ".join(str(e.get("reason")) for e in misses)
    return None


@pytest.fixture
def assert_same_output(preload_gate_checkpoint: str, preload_gate_prompts: Sequence[str]
                       ) -> Callable[..., None]:
    """``assert_same_output(reference, candidate)``; a cached candidate must
    also have recorded a hit (pass ``cached=False`` to compare two engines
    that load from disk)."""

    def check(reference: EngineResult, candidate: EngineResult, cached: bool = True) -> None:
        why = explain_difference(reference, candidate, preload_gate_checkpoint, preload_gate_prompts)
        if why:
            pytest.fail(why, pytrace=False)
        if cached:
            problem = cached_load_problem(candidate)
            if problem:
                pytest.fail(problem, pytrace=False)

    return check
