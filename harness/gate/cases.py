"""The cases a gate run judges: the target's catalogue rows (self-test) or
the deployment's own promotion and switch cases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.gate.options import GateOptions
from harness.mutations import (
    BASE_SETTINGS,
    EngineSettings,
    GateCase,
    KeyCheck,
    case_by_name,
    dense_key,
    select_cases,
)
from preload.deployment import DeploymentSettings

# The gate's engines and daemon bound their context on small machines.
MAX_MODEL_LEN = 256


@dataclass(frozen=True)
class DeploymentCase(GateCase):
    """A promotion case run in the deployment's settings: the daemon holds
    the candidate under the same settings, so equal weights must hit."""

    deployment: DeploymentSettings = DeploymentSettings()

    @property
    def expect(self) -> str:
        return "hit" if self.weights_equal else "miss"

    def key_check(self, digest: str, is_moe: bool = False) -> KeyCheck:
        key = dense_key(digest, self.settings)
        return KeyCheck(self.expected_fields, tuple(key.mismatched_fields(key)))

    def engine_kwargs(self) -> dict[str, Any]:
        """The row's engine settings with the deployment's own."""
        d = self.deployment
        return {**super().engine_kwargs(), "pipeline_parallel_size": d.pipeline_parallel_size,
                "quantization": d.quantization, "kv_cache_dtype": d.kv_cache_dtype,
                "max_model_len": d.max_model_len or MAX_MODEL_LEN}


def settings_json(case: GateCase) -> dict[str, Any]:
    """The settings column of a case's report row."""
    out = case.settings.to_json()
    if isinstance(case, DeploymentCase):
        out.update(case.deployment.to_json())
    return out


def gate_settings(opts: GateOptions) -> DeploymentSettings:
    """The deployment settings of a promotion run (the self-test's own when none are given)."""
    return opts.settings or DeploymentSettings(dtype=BASE_SETTINGS.dtype, max_model_len=MAX_MODEL_LEN)


def _engine_settings(d: DeploymentSettings) -> EngineSettings:
    return EngineSettings(dtype=d.dtype, tensor_parallel_size=d.tensor_parallel_size,
                          data_parallel_size=d.data_parallel_size)


def select_target_cases(target: Any, spec: str) -> list[GateCase]:
    """``all``: the target's own rows (the whole catalogue for ours); else the named rows."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if spec.strip() in ("", "all"):
        if not target.default_cases:
            return select_cases("all")
        names = list(target.default_cases)
    return [case_by_name(n) for n in names]


def promotion_case(opts: GateOptions) -> GateCase:
    """The candidate served from its own daemon: it must hit and equal ``auto``."""
    d = gate_settings(opts)
    return DeploymentCase("promotion", "the candidate served from its own daemon: a hit, equal to auto",
                          recipe=None, weights_equal=True, settings=_engine_settings(d), deployment=d)


def switch_case(opts: GateOptions) -> GateCase:
    """The candidate while a daemon still holds the base (``gate CAND --base BASE``)."""
    d = gate_settings(opts)
    return DeploymentCase("switch_from_base", "the candidate while a daemon still holds the base: a miss, "
                          "or a hit where the base is the same content (a re-promotion)",
                          recipe=None, weights_equal=False, expected_fields=("content_digest",),
                          settings=_engine_settings(d), deployment=d, holds_base=True)
