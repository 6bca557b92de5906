"""Replicas something else supervises: one restart command per replica.

The operator gives a template, run once per restart::

    --restart-command 'systemctl restart vllm@{i}'
    --restart-command 'sh -c "echo MODEL={checkpoint} LOADER={loader_config_q} > /etc/vllm/{i}.env && systemctl restart vllm@{i}"'
    --restart-command 'kubectl -n serving exec vllm-{i} -- /restart.sh {checkpoint} {digest}'

The template is split like a shell line (:func:`shlex.split`) and each word
is filled in on its own, so a checkpoint path with spaces stays one
argument and nothing in a value is ever run by a shell (write ``sh -c``
yourself for that). Placeholders: ``{i}`` (replica index), ``{url}``,
``{port}``, ``{checkpoint}`` (the real path), ``{digest}`` (what the loader
asks the daemon for), ``{label}`` (A, B, ...), ``{events_file}``,
``{loader_config}`` (the ``--model-loader-extra-config`` JSON),
``{loader_config_q}`` (the same, shell-quoted, for inside ``sh -c``) and
``{serve_args}`` (every argument after the model, shell-quoted: engine
arguments, ``--load-format verified_cache`` and its config). An unknown
placeholder is refused before anything runs.

The command must return once the old process is stopped and the new one
started (``systemctl restart`` does); the rollout then waits for the
replica's own readiness and a new load event in ``{events_file}``, so a
command that restarts nothing is a ``no_load_event`` failure, not a pass.
"""

from __future__ import annotations

import shlex
import string
import subprocess
from collections.abc import Callable
from typing import Any

from harness.rollout.replicas import StartFailedError, Target
from harness.rollout.state import ReplicaRecord
from pgbase.errors import PreloadGateError

PLACEHOLDERS = ("i", "url", "port", "checkpoint", "digest", "label", "events_file", "loader_config",
                "loader_config_q", "serve_args")
COMMAND_TIMEOUT_S = 600.0


class TemplateError(PreloadGateError):
    """A restart-command template that cannot be filled in."""


def check_template(template: str) -> list[str]:
    """The template's words; :class:`TemplateError` for a bad quote or an unknown placeholder."""
    try:
        words = shlex.split(template)
    except ValueError as exc:
        raise TemplateError(f"--restart-command {template!r}: {exc}") from None
    if not words:
        raise TemplateError("--restart-command is empty; give the command that restarts replica {i}")
    for w in words:
        try:
            names = [f for _, f, _, _ in string.Formatter().parse(w) if f is not None]
        except ValueError as exc:
            raise TemplateError(f"--restart-command word {w!r}: {exc} (write a literal brace as {{{{ or }}}})") from None
        unknown = [n for n in names if n not in PLACEHOLDERS]
        if unknown:
            raise TemplateError(f"--restart-command: unknown placeholder {{{unknown[0]}}}; known: "
                                + ", ".join("{" + p + "}" for p in PLACEHOLDERS))
    return words


class CommandDriver:
    """Restart each replica by running the operator's command template."""

    kind = "command"

    def __init__(self, template: str, engine_args: list[str], timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        self.template = template
        self.words = check_template(template)
        self.engine_args = list(engine_args)
        self.timeout_s = timeout_s
        self._last_output = ""

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "restart_command": self.template}

    def values(self, record: ReplicaRecord, target: Target) -> dict[str, str]:
        from urllib.parse import urlparse

        cfg = json_text(target.loader_config(record.events_file))
        return {"i": str(record.index), "url": record.url, "port": str(urlparse(record.url).port or ""),
                "checkpoint": target.checkpoint, "digest": target.key, "label": target.label,
                "events_file": record.events_file, "loader_config": cfg, "loader_config_q": shlex.quote(cfg),
                "serve_args": shlex.join(target.serve_args(self.engine_args, record.events_file))}

    def argv(self, record: ReplicaRecord, target: Target) -> list[str]:
        v = self.values(record, target)
        return [w.format_map(v) for w in self.words]

    def restart(self, record: ReplicaRecord, target: Target, saved: Callable[[], None]) -> None:
        argv = self.argv(record, target)
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise StartFailedError("restart_command_failed", f"{argv[0]}: command not found") from None
        except subprocess.TimeoutExpired:
            raise StartFailedError("restart_command_failed",
                                   f"{shlex.join(argv)} did not return within {self.timeout_s:g} s") from None
        self._last_output = (p.stdout + p.stderr)[-4000:]
        if p.returncode != 0:
            raise StartFailedError("restart_command_failed", f"{shlex.join(argv)} exited {p.returncode}: "
                                                             f"{self._last_output[-400:].strip()}")
        saved()

    def alive(self, record: ReplicaRecord) -> bool | None:
        return None

    def log_tail(self, record: ReplicaRecord) -> str:
        return self._last_output

    def stop(self, record: ReplicaRecord) -> None:
        """Nothing: whoever supervises these replicas stops them."""


def json_text(obj: Any) -> str:
    import json

    return json.dumps(obj, sort_keys=True)
