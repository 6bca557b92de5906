"""Does a golden describe what a replica serves? Settings, config, answer files.

The weights digest is not the whole question (field cases r02, r12): a
config-only fix (RoPE settings) or another tokenizer changes the answers of
the same weights, and so do the dtype, the parallelism, the quantization
and the KV-cache dtype. A golden recorded under other conditions would blame
the replica's tokens for a difference of conditions, so the check refuses
it before any request, naming the field that differs (exit 2).

What the replica serves is stated by the operator: the deployment flags
given to ``canary check`` (the pipeline prints them in its check command),
and ``--checkpoint DIR`` for the config and answer files it serves
(tokenizer, chat templates, generation defaults, processors:
:mod:`preload.identity.answer_files`), compared file by file.
Fields not stated are not compared; a golden older than these fields
(no ``settings``) is compared on what it recorded in ``engine``. A golden
that records no config digest (written before goldens were keyed) still
passes a replica that answers as it recorded; where answers differ, nothing
in it can show that it describes the config.json and tokenizer the replica
serves, so the check ends as "could not judge" (exit 2, naming the missing
key), never as a weights failure (r02). Under ``--checkpoint``, a golden that
records no ``answer_files`` (written before goldens covered every answer
file: it holds at most a ``tokenizer_digest`` over tokenizer files, never
``chat_template.jinja``) is refused by name, saying which files it does not
cover: a chat-template edit leaves the canary's token-id answers unchanged,
so nothing else would ever show it (t11).
"""

from __future__ import annotations

import os
from typing import Any

from canaries.golden import Golden
from pgbase.errors import PreloadGateError
from preload.deployment import DeploymentSettings
from preload.identity.answer_files import (
    LEGACY_TOKENIZER_FILES,
    Change,
    changes,
    legacy_tokenizer_digest,
    select,
)
from preload.identity.config import config_digest

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


class AnswerFilesMismatchError(PreloadGateError):
    """The files that decide answers differ from the golden's, named file by file."""

    def __init__(self, checkpoint: str | os.PathLike[str], diff: list[Change]) -> None:
        self.changes = diff
        super().__init__(
            f"refusing golden: the files that decide answers in {checkpoint} are not the ones it was recorded "
            f"with (answer_files: {', '.join(map(str, diff))}); record a golden for what the replicas serve: "
            f"preload-gate canary record --model {checkpoint} --out GOLDEN"
        )


class AnswerFilesUnrecordedError(PreloadGateError):
    """A golden older than ``answer_files``: it cannot show which answer files it was recorded with."""

    def __init__(self, golden: Golden, checkpoint: str | os.PathLike[str]) -> None:
        present = select(checkpoint)
        uncovered = [n for n in present if n not in LEGACY_TOKENIZER_FILES]
        if golden.tokenizer_digest is None:
            covers = "records no digest of them at all"
        else:
            same = legacy_tokenizer_digest(checkpoint) == golden.tokenizer_digest
            covers = (f"its tokenizer_digest covers only an older list of tokenizer files "
                      f"({'those match' if same else 'and those differ'})")
        missing = f"; not covered: {', '.join(uncovered)}" if uncovered else ""
        super().__init__(
            f"refusing golden: it records no answer_files (written before goldens covered every file that "
            f"decides answers: {covers}{missing}); re-record it: "
            f"preload-gate canary record --model {checkpoint} --out GOLDEN"
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
    flags the operator gave (absent: not compared). With ``checkpoint``:
    :class:`AnswerFilesMismatchError` naming each answer file that differs,
    :class:`AnswerFilesUnrecordedError` for a golden that records none."""
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
    have_config = config_digest(checkpoint)
    if golden.config_digest is not None and golden.config_digest != have_config:
        raise GoldenMismatchError("config_digest", golden.config_digest[:16], (have_config or "none")[:16],
                                  f"config.json of {checkpoint} has")
    if golden.answer_files is None:
        raise AnswerFilesUnrecordedError(golden, checkpoint)
    diff = changes(golden.answer_files, checkpoint)
    if diff:
        raise AnswerFilesMismatchError(checkpoint, diff)
