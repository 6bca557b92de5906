"""Which executor a harness engine runs under (harness.engine.engine_executor).

Single-rank offline engines run vLLM's engine core in their own process
("uni"); anything with more than one rank, or served through the OpenAI
server, keeps vLLM's own multiprocess executors. One row per rule.
"""

from __future__ import annotations

import pytest

from harness.engine import EXECUTOR_ENV, EngineSpec, EngineSpecError, engine_env, engine_executor

pytestmark = pytest.mark.unit

ROWS = [
    # (spec overrides, environment value, expected executor)
    ({}, None, "uni"),
    ({}, "mp", "mp"),
    ({}, "uni", "uni"),
    ({"tensor_parallel_size": 2}, None, "mp"),
    ({"tensor_parallel_size": 2}, "uni", "mp"),  # never in-process across ranks
    ({"pipeline_parallel_size": 2}, None, "mp"),
    ({"data_parallel_size": 2, "server": True}, None, "mp"),
    ({"server": True}, "uni", "mp"),
]


@pytest.mark.parametrize(("overrides", "chosen", "expected"), ROWS)
def test_executor_rule(overrides: dict, chosen: str | None, expected: str, monkeypatch) -> None:
    if chosen is None:
        monkeypatch.delenv(EXECUTOR_ENV, raising=False)
    else:
        monkeypatch.setenv(EXECUTOR_ENV, chosen)
    spec = EngineSpec(checkpoint="/models/tiny", **overrides)
    assert engine_executor(spec) == expected
    env = engine_env(spec)
    assert env[EXECUTOR_ENV] == expected
    # vLLM's own switch follows: off exactly when the engine core runs in-process.
    assert (env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0") == (expected == "uni")


def test_a_spec_env_choice_wins_over_the_process_env(monkeypatch) -> None:
    monkeypatch.setenv(EXECUTOR_ENV, "uni")
    assert engine_executor(EngineSpec(checkpoint="/m", env={EXECUTOR_ENV: "mp"})) == "mp"


def test_an_unknown_executor_is_a_named_error(monkeypatch) -> None:
    monkeypatch.setenv(EXECUTOR_ENV, "ray")
    with pytest.raises(EngineSpecError, match="PRELOAD_GATE_ENGINE_EXECUTOR='ray' is not one of uni, mp"):
        engine_executor(EngineSpec(checkpoint="/m"))
