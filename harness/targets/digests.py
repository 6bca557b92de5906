"""Each checkpoint's content digest in one gate run: carried with its proof, hashed once.

A promotion hashes the candidate once (``preload-gate promote``, which writes
the manifest). Everything after it in the run (the gate's own expectation,
the daemon it starts, the verdict's independent digest, the golden) takes
that digest with its proof, the manifest and its stat check (the rule every
restarting engine follows, :func:`preload.identity.manifest.resolve_digest`):
a manifest that still describes the folder means the bytes are the promoted
ones; the daemon then proves them again in the one pass in which it reads
them to load (:mod:`preload.daemon.proof`). A checkpoint is hashed again only
where a rule says its bytes may have changed: no manifest, a stale one (the
stat check names the shard), a stat-blind filesystem, or a file the gate
itself edited (:meth:`Digests.edited`).

``hashed_bytes`` counts what this run read to hash (the promotion test and
the bench's bytes-read figure read it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from harness.targets.checkpoints import file_digest, weight_files
from pgbase.errors import PreloadGateError
from preload.identity.manifest import StaleManifestError, resolve_digest

Note = Callable[[str, str], None]


def seen_digest(path: str | os.PathLike[str]) -> str | None:
    """The content digest of the weights at ``path`` as *this* machine sees
    them: its manifest's where the stat check passes (the files are the
    promoted ones), else hashed. A manifest written on another machine for
    the same path fails the stat check there (other inode, device or times),
    so a node that sees other files at the path reports their digest, never
    the promotion's. None where ``path`` is no local checkpoint folder.
    """
    if not Path(path).is_dir():
        return None
    try:
        return resolve_digest(path, mode="stat").digest
    except PreloadGateError:  # no manifest, a stale or a foreign one: the bytes decide
        pass
    try:
        return file_digest(path)
    except (PreloadGateError, OSError):
        return None


class Digests:
    """Digests by real path for one run. ``socket_root``: where a promotion
    made here creates the digest's socket directory."""

    def __init__(self, socket_root: str | None, note: Note | None = None) -> None:
        self.socket_root = socket_root
        self.note: Note = note or (lambda _s, _m: None)
        self._known: dict[str, str] = {}
        self.sources: dict[str, str] = {}  # path -> "manifest" | "promoted" | "hashed"
        self.hashed_bytes = 0

    @staticmethod
    def _key(path: str | os.PathLike[str]) -> str:
        return os.path.realpath(path)

    def _proven(self, path: Path) -> str | None:
        """The manifest's digest when its stat check passes; None where a
        rule says the bytes may differ (no manifest, stale, stat-blind)."""
        try:
            return resolve_digest(path, mode="stat").digest
        except StaleManifestError:
            return None
        except PreloadGateError:  # an unreadable or foreign manifest: never trusted, hashed instead
            return None

    def _count(self, path: Path) -> None:
        self.hashed_bytes += sum(p.stat().st_size for p in weight_files(path))

    def of(self, path: str | os.PathLike[str]) -> str:
        """The digest of ``path``: known this run, else the manifest's (stat
        check passed), else hashed (safetensors or ``.bin``; no manifest written)."""
        key = self._key(path)
        if key in self._known:
            return self._known[key]
        digest = self._proven(Path(path))
        if digest is not None:
            self.sources[key] = "manifest"
        else:
            self.note("hash", f"hashing {path}")
            self._count(Path(path))
            digest = file_digest(path)
            self.sources[key] = "hashed"
        self._known[key] = digest
        return digest

    def promoted(self, path: str | os.PathLike[str]) -> str:
        """The digest of ``path`` with a manifest an engine's stat check finds:
        the existing one when it still describes the folder, else a promotion
        now (one hash, the manifest written atomically)."""
        key = self._key(path)
        if key in self._known and self.sources.get(key) in ("manifest", "promoted"):
            return self._known[key]
        digest = self._proven(Path(path))
        if digest is not None:
            self.sources[key] = "manifest"
            self._known[key] = digest
            return digest
        return self.promote(path)

    def promote(self, path: str | os.PathLike[str]) -> str:
        """Promote ``path`` now (hash it once, write its manifest) and keep the digest."""
        from preload.promote import promote

        self.note("hash", f"promoting {path}")
        self._count(Path(path))
        digest = promote(path, socket_root=self.socket_root).digest
        key = self._key(path)
        self._known[key], self.sources[key] = digest, "promoted"
        return digest

    def edited(self, path: str | os.PathLike[str]) -> None:
        """The gate changed ``path``'s bytes: what was known of it is void."""
        key = self._key(path)
        self._known.pop(key, None)
        self.sources.pop(key, None)

    def hash_now(self, path: str | os.PathLike[str]) -> str:
        """Hash ``path`` whatever a manifest says (its bytes were edited in place,
        mtimes possibly restored: the stat check is what the case tests)."""
        self.edited(path)
        self.note("hash", f"hashing {path}")
        self._count(Path(path))
        digest = file_digest(path)
        key = self._key(path)
        self._known[key], self.sources[key] = digest, "hashed"
        return digest
