"""The load event: exactly one per engine rank, whatever happened.

``{"outcome": "hit"|"miss"|"error", "reason", "fields", "digest",
"daemon_digest", "mode", "seconds", "tensors", "bytes", "rank", "source"}``
is appended as one JSON line to the events file (the loader's
``events_file`` or ``$PRELOAD_GATE_EVENTS``) and logged as one line
starting ``preload-gate load:``, so a gate, a log search and a person all
see the same fact. ``source`` says where the weights came from: ``daemon``,
``disk`` (a fallback) or ``none`` (the load failed).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from pgbase.oscause import describe
from preload.trust import UntrustedPathError, open_own_file

log = logging.getLogger("preload.load")
# A hit is INFO; inheriting the root's WARNING would drop it wherever the
# host configured logging. An app that wants hits quiet sets this level itself.
if log.level == logging.NOTSET:
    log.setLevel(logging.INFO)

EVENTS_ENV = "PRELOAD_GATE_EVENTS"
OUTCOMES = ("hit", "miss", "error")
LOG_PREFIX = "preload-gate load:"


@dataclass
class LoadEvent:
    outcome: str
    reason: str
    fields: list[str] = field(default_factory=list)
    digest: str | None = None
    daemon_digest: str | None = None
    mode: str = "zero_copy"
    seconds: float = 0.0
    tensors: int = 0
    bytes: int = 0
    rank: int = 0
    dp_rank: int = 0
    source: str = "none"
    socket_dir: str | None = None
    pid: int = field(default_factory=os.getpid)
    # What ``digest`` is a hash of: "content" (SHA-256 of the shards, ours) or
    # "header_only" (vLLM's header hash: the unsafe negative control). A
    # judge compares only content digests with the candidate's content.
    identity: str = "content"
    # Where a hit's seconds went, in seconds per step (resolve, connect, state,
    # map, build, verify, process); steps not reached are absent.
    phases: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome {self.outcome!r} is not one of {OUTCOMES}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (as logging's own
    last-resort handler does), not the stream it was made with."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


# Our own line printer for a process where nobody configured logging. Not
# registered with logging.getLogger and not propagating, so no handler the
# host adds later can print its records a second time.
_fallback = logging.Logger("preload.load", logging.INFO)
_fallback.propagate = False
_fallback.addHandler(_StderrHandler())


def _route() -> logging.Logger:
    """The logger that prints the load line exactly once in this process.

    vLLM (vllm/logger.py) configures only the ``vllm`` logger: one stream
    handler, ``propagate: False``, its level from ``VLLM_LOGGING_LEVEL``; it
    never touches the root. In a vLLM engine core or worker ``preload.load``
    therefore has no handler and Python's last-resort handler drops INFO, so a
    hit left no line. Decided per load, because the host may configure logging
    after this module is imported:

    1. ``preload.load`` or an ancestor up to the root has a handler (the app
       configured logging, pytest's caplog, a harness handler): log there, as
       before, so the host's handlers print it once in the host's format.
    2. else the ``vllm`` logger has a handler (vLLM configured its logging in
       this process): log on its child ``vllm.preload_gate`` (it does not
       propagate past ``vllm``), so vLLM's handler prints it once in vLLM's
       format, next to the engine's own lines. vLLM is not imported for this:
       the logger is looked up in logging's registry, so a process without
       vLLM never pays for it.
    3. else nobody will print it: our private stderr logger does.
    """
    if log.hasHandlers():
        return log
    vllm_logger = logging.Logger.manager.loggerDict.get("vllm")
    if isinstance(vllm_logger, logging.Logger) and vllm_logger.handlers:
        return logging.getLogger("vllm.preload_gate")
    return _fallback


def events_path(configured: str | None) -> str | None:
    return configured or os.environ.get(EVENTS_ENV) or None


def emit(event: LoadEvent, events_file: str | None = None, loud: bool | None = None) -> bool:
    """Append the event line (one ``write`` on an O_APPEND fd, so ranks
    writing the same file never interleave) and log it.

    The file is held to :func:`preload.trust.open_own_file`: a symlink, a
    FIFO, a directory or a file of another user at the path is refused (an
    events path in a shared directory such as /tmp is otherwise a way for
    any local user to make engines append to a file of their choosing). A
    file it creates is 0600.

    Never raises: an events file that cannot be written (a missing directory,
    a full disk, a refused path) must not turn a good load into a failed
    start. The log line is still written, plus a warning naming the file and
    why. Returns whether the file got the line (True when no file is configured).
    """
    try:
        line = json.dumps(event.to_json(), sort_keys=True, default=str)
    except Exception as exc:  # a field that does not serialise: still say what happened
        line = json.dumps({"outcome": event.outcome, "reason": event.reason, "rank": event.rank,
                           "serialise_error": repr(exc)})
    written = True
    path = events_path(events_file)
    if path:
        try:
            fd = open_own_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "events file")
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)
        except UntrustedPathError as exc:
            written = False
            _log(logging.WARNING, "preload-gate: not writing the load event: %s; the load itself "
                 "is unaffected", exc)
        except OSError as exc:
            written = False
            _log(logging.WARNING, "preload-gate: cannot write the load event to %s (%s); the load itself "
                 "is unaffected; fix the events_file path", path, describe(exc, path))
    if loud is None:
        loud = event.outcome != "hit"
    _log(logging.WARNING if loud else logging.INFO, "%s %s", LOG_PREFIX, line)
    return written


def _log(level: int, msg: str, *args: Any) -> None:
    try:
        _route().log(level, msg, *args, stacklevel=3)
    except Exception:  # a broken log handler is not a failed load
        pass


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every load event in an events file, in the order written.

    A missing file is no events (``[]``: the engine never loaded, or loaded
    without an events file); blank lines are skipped. A line that is not a
    JSON object (a torn write, a stray print into the file) is kept in its
    place as ``{"outcome": "malformed", "raw": <its first 200 characters>}``,
    so a judge counting one ``hit`` per rank sees it rather than crashing on
    it or reading past it. Raises ``OSError`` when the file exists but cannot
    be read, ``UnicodeDecodeError`` when it is not UTF-8, and
    :class:`preload.trust.UntrustedPathError` when the path is a symlink
    (whoever owns it), not a regular file, or a file of another user: the
    rule :func:`emit` writes by, so a reader never believes a file no
    engine of ours could have written.
    """
    events: list[dict[str, Any]] = []
    try:
        fd = open_own_file(path, os.O_RDONLY, "events file")
    except FileNotFoundError:
        return events
    with open(fd, encoding="utf-8") as f:
        for line in f:  # newlines only: JSON text may hold other line separators
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                obj = None
            events.append(obj if isinstance(obj, dict) else {"outcome": "malformed", "raw": line[:200]})
    return events
