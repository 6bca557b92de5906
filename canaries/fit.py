"""Does a golden describe what a replica serves? Settings, config, tokenizer.

The weights digest is not the whole question (field cases r02, r12): a
config-only fix (RoPE settings) or another tokenizer changes the answers of
the same weights, and so do the dtype, the parallelism, the quantization
and the KV-cache dtype. A golden recorded under other conditions would blame
the replica's tokens for a difference of conditions, so the check refuses
it before any request, naming the field that differs (exit 2).

What the replica serves is stated by the operator: the deployment flags
given to ``canary check`` (the pipeline prints them in its check command),
and ``--checkpoint DIR`` for the config and tokenizer files it serves.
Fields not stated are not compared; a golden older than these fields
(no ``settings``) is compared on what it recorded in ``engine``. A golden
that records no config digest (written before goldens were keyed) still
passes a replica that answers as it recorded; where answers differ, nothing
in it can show that it describes the config.json and tokenizer the replica
serves, so the check ends as "could not judge" (exit 2, naming the missing
key), never as a weights failure (r02).
"""

from __future__ import annotations

import os
from typing import Any

from canaries.golden import Golden
from pgbase.errors import PreloadGateError
from preload.deployment import DeploymentSettings, answer_identity

# vLLM's dtype aliases (``--dtype half`` is float16).
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}


class GoldenMismatchError(PreloadGateError):
    """The golden was recorded under other settings, config or tokenizer than the replica serves."""

    def __init__(self, field: str, golden_value: Any, served_value: Any, what: str) -> None:
        self.field, self.golden_value, self.served_value = field, golden_value, served_value
        super().__init__(
            f"refusing golden: it was recorded with {field}={golden_value}, but {what} {field}={served_value}; "
            "record a golden under the replica's settings (preload-gate canary record with the same flags)"
        )


class UnkeyedGoldenError(PreloadGateError):
    """Answers differ from a golden that records no config digest: it cannot show what it describes."""

    def __init__(self, fields: list[str]) -> None:
        self.fields = fields
        super().__init__(
            f"cannot judge: answers differ from a golden that records no {' or '.join(fields)} (written "
            "before goldens were keyed by config.json and tokenizer), so a config or tokenizer change "
            "cannot be told from wrong weights; re-record it: preload-gate canary record --model CKPT --out GOLDEN"
        )


def _dtype(name: Any) -> str:
    s = str(name).removeprefix("torch.")
    return _DTYPE_ALIASES.get(s, s)


def golden_settings(golden: Golden) -> dict[str, Any]:
    """The golden's settings; from its ``engine`` record when it predates ``settings``."""
    if golden.settings is not None:
        return golden.settings.to_json()
    out: dict[str, Any] = {}
    for name in ("dtype", "max_model_len"):
        if name in golden.engine:
            out[name] = golden.engine[name]
    return out


def check_fit(golden: Golden, stated: dict[str, Any], checkpoint: str | os.PathLike[str] | None = None) -> None:
    """Raise :class:`GoldenMismatchError` for the first field where the golden
    and what the replica serves differ; ``stated`` holds the deployment
    flags the operator gave (absent: not compared)."""
    recorded = golden_settings(golden)
    defaults = DeploymentSettings().to_json()
    for name, served in stated.items():
        want = recorded.get(name, defaults.get(name))
        if name == "dtype":
            resolved = golden.engine.get("resolved_dtype")
            accepted = {_dtype(want)} | ({_dtype(resolved)} if resolved else set())
            if _dtype(served) not in accepted:
                shown = want if not resolved or _dtype(resolved) == _dtype(want) else f"{want} ({resolved})"
                raise GoldenMismatchError("dtype", shown, served, "the replica serves")
            continue
        if name == "max_model_len" and want is None:
            continue  # vLLM's default from config.json; the config digest covers it
        if served != want:
            raise GoldenMismatchError(name, want, served, "the replica serves")
    if checkpoint is None:
        return
    served_identity = answer_identity(checkpoint)
    for name, label in (("config_digest", "config.json"), ("tokenizer_digest", "tokenizer")):
        want = getattr(golden, name)
        have = served_identity[name]
        if want is not None and want != have:
            raise GoldenMismatchError(
                name, (want or "none")[:16], (have or "none")[:16],
                f"{label} of {checkpoint} has",
            )
