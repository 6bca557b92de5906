"""What a rollout calls one checkpoint: what decides its answers, the golden's rule.

Two folders are the same checkpoint to a rollout when their weights digest,
their config.json (canonical) and their answer files (tokenizer, chat
template, generation config: :func:`preload.deployment.answer_identity`)
are all equal, the same rule a golden is keyed and checked by
(:func:`canaries.fit.check_fit`). A config-only fix (RoPE scaling, a new
chat template) is therefore a rollout with switches and canaries, and a
byte-identical copy at another path is no rollout at all.

A daemon is *this* checkpoint's when it holds the digest the replicas ask
for and its key holds what the replicas' key will hold: the config digest,
and the deployment's dtype and TP size where they are stated
(:func:`key_mismatch`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any

from preload.deployment import DeploymentSettings, answer_identity
from preload.engine_platform import for_device, host_device_type

# vLLM's aliases for --dtype.
_DTYPES = {"half": "float16", "float": "float32"}


def identity(digest: str, checkpoint: str | os.PathLike[str]) -> str:
    """SHA-256 over the weights digest, the config digest and the answer files of ``checkpoint``.

    >>> identity("ab" * 32, "/models/ft-0412")  # doctest: +SKIP
    '5f0c...'
    """
    body = {"weights": digest, **answer_identity(checkpoint)}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def what_differs(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> list[str]:
    """Which of config.json and the answer files differ between two folders (names)."""
    ia, ib = answer_identity(a), answer_identity(b)
    out = ["config.json"] if ia["config_digest"] != ib["config_digest"] else []
    fa, fb = ia["answer_files"], ib["answer_files"]
    return out + sorted(n for n in set(fa) | set(fb) if fa.get(n) != fb.get(n))


def _dtype(name: str) -> str:
    name = str(name).removeprefix("torch.")
    return _DTYPES.get(name, name)


@functools.cache
def engine_surface() -> tuple[str, str] | None:
    """The (stage, transport) the replicas' engines on this host attach, by
    vLLM's platform (:mod:`preload.engine_platform`); None without vLLM."""
    device = host_device_type()
    return for_device(device) if device else None


def key_mismatch(key: dict[str, Any], config_digest: str | None, settings: DeploymentSettings) -> list[str]:
    """The fields of a daemon's key (its ``stats`` answer's ``key``) that the
    replicas' key will not hold: ``config_digest``, ``dtype`` (unless ``auto``),
    ``tp_size``, and the ``export_stage``/``transport`` this host's engines
    attach (a raw daemon of the same digest serves no vLLM replica). Empty:
    a replica asking for this checkpoint hits it."""
    out = []
    surface = engine_surface()
    if surface is not None:
        for name, want in zip(("export_stage", "transport"), surface, strict=True):
            if key.get(name) is not None and key.get(name) != want:
                out.append(name)
    if key.get("config_digest") != config_digest:
        out.append("config_digest")
    if settings.dtype != "auto" and key.get("dtype") and _dtype(key["dtype"]) != _dtype(settings.dtype):
        out.append("dtype")
    if int(key.get("tp_size") or 1) != int(settings.tensor_parallel_size or 1):
        out.append("tp_size")
    return out
