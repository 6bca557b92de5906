"""Deployment settings: the engine arguments a fleet serves with, stated once.

The same weights answer differently at bfloat16 and float16, under another
quantization or KV-cache dtype, or split another way (r12 in the field
cases): a gate verdict or a canary golden says nothing about a deployment
whose settings it did not run with. So the promotion pipeline parses the
engine arguments once, under vLLM's own flag names, and hands the same
:class:`DeploymentSettings` to the gate, the golden recording, the daemon
and the printed ``vllm serve`` command; reports and goldens record them, and
a canary check refuses a golden recorded under other settings by name.

Beside the settings, :func:`answer_identity` names everything else that
decides a model's answers and is not in the weights: ``config.json`` (RoPE
settings, say) and the answer files (tokenizer, chat templates, generation
defaults, processors, remote code: :mod:`preload.identity.answer_files`).
Goldens and the gate's reference cache are keyed by both.

>>> s = DeploymentSettings(dtype="float16", tensor_parallel_size=2)
>>> s.engine_args()
['--dtype', 'float16', '--tensor-parallel-size', '2']
>>> s.mismatched_fields(DeploymentSettings())
['dtype', 'tensor_parallel_size']
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from pgbase.cliargs import positive_int
from pgbase.errors import PreloadGateError
from pgbase.json_shape import convert
from preload.identity.answer_files import answer_files
from preload.identity.config import config_digest

# What ``vllm serve`` (and an offline ``LLM``) use when the flag is absent.
DEFAULT_DTYPE = "auto"

class SettingsError(PreloadGateError):
    """Engine arguments that cannot be taken as deployment settings."""


@dataclass(frozen=True)
class DeploymentSettings:
    """Every engine setting that decides what a replica answers or holds.

    Field names are vLLM's (``EngineArgs``), so a settings object maps onto
    ``vllm serve`` flags one to one (:meth:`engine_args`).
    """

    dtype: str = DEFAULT_DTYPE
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    max_model_len: int | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise SettingsError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise SettingsError(f"--max-model-len must be at least 1, got {self.max_model_len}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> DeploymentSettings:
        """Parse recorded settings: SettingsError, one line naming the field
        (unknown ones by name, a wrong type by msgspec's path ``$.dtype``:
        :func:`pgbase.json_shape.convert`; a range by its flag, from
        ``__post_init__``)."""
        return convert(obj, cls, "deployment settings", SettingsError)

    def mismatched_fields(self, other: DeploymentSettings) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def engine_args(self) -> list[str]:
        """The ``vllm serve`` flags that state these settings (defaults left out)."""
        out: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                out.append(flag)
            else:
                out += [flag, str(value)]
        return out


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, stated_only: bool = False) -> None:
    """The deployment flags, as ``vllm serve`` spells them (short forms too).

    ``stated_only``: flags left out are absent from the namespace (see
    :func:`stated_args`), for a caller that compares only what was stated.
    """
    def default(value: Any) -> Any:
        return argparse.SUPPRESS if stated_only else value

    parser.add_argument("--dtype", default=default(DEFAULT_DTYPE),
                        help="model dtype, as the replicas serve it (default auto: the checkpoint's)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=default(1))
    parser.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, default=default(1))
    parser.add_argument("--data-parallel-size", "-dp", type=positive_int, default=default(1))
    parser.add_argument("--max-model-len", type=positive_int, default=default(None))
    parser.add_argument("--quantization", "-q", default=default(None))
    parser.add_argument("--kv-cache-dtype", default=default("auto"))
    parser.add_argument("--enable-expert-parallel", action="store_true", default=default(False))


def stated_args(args: argparse.Namespace) -> dict[str, Any]:
    """The deployment flags given on a ``stated_only`` command line, by field name."""
    return {f.name: getattr(args, f.name) for f in fields(DeploymentSettings) if hasattr(args, f.name)}


def from_args(args: argparse.Namespace) -> DeploymentSettings:
    """The settings named by :func:`add_arguments` flags on a parsed namespace."""
    return DeploymentSettings(**{f.name: getattr(args, f.name) for f in fields(DeploymentSettings)})


def parse_engine_args(argv: list[str]) -> DeploymentSettings:
    """Settings from ``vllm serve``-style arguments; others (ports, host) are ignored.

    >>> parse_engine_args(["--dtype", "float16", "-tp", "2", "--port", "8000"]).tensor_parallel_size
    2
    """
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_arguments(parser)
    try:
        ns, _rest = parser.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise SettingsError(f"cannot read the engine arguments {' '.join(argv)!r}: {exc}") from None
    return from_args(ns)


def answer_identity(checkpoint: str | os.PathLike[str]) -> dict[str, Any]:
    """What decides a checkpoint's answers besides its weights.

    ``{"config_digest": hex or None, "answer_files": {relative path: sha256 hex}}``:
    config.json in canonical form (:func:`preload.identity.config.config_digest`)
    and every answer file present (:func:`preload.identity.answer_files.answer_files`).
    Raises :class:`pgbase.errors.CheckpointError` for an unreadable config.json.
    """
    return {"config_digest": config_digest(checkpoint), "answer_files": answer_files(checkpoint)}


def resolved_dtype(llm: Any) -> str | None:
    """The dtype an ``LLM`` computes in ("auto" resolved by vLLM), e.g. ``float16``.

    Read from the engine's model config, without importing vLLM here.
    """
    engine = getattr(llm, "llm_engine", None)
    config = getattr(engine, "model_config", None) or getattr(getattr(engine, "vllm_config", None), "model_config", None)
    dtype = getattr(config, "dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")
