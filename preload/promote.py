"""Promotion: hash a checkpoint once, record its manifest, name its socket dir.

>>> p = promote("/models/smollm2")  # doctest: +SKIP
>>> p.digest, p.socket_dir  # doctest: +SKIP
('3f5c...', PosixPath('/run/user/0/preload-gate/3f5c0a1b2c3d4e5f'))
"""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pgbase.errors import PreloadGateError
from pgbase.oscause import describe
from preload.identity.filestat import STAT_BLIND_FILESYSTEMS, filesystem_type
from preload.identity.manifest import Manifest, build_manifest, write_manifest
from preload.preflight import preflight_promote
from preload.sockets import ensure_private_dir, socket_dir


@dataclass(frozen=True)
class Promotion:
    manifest: Manifest
    manifest_path: Path
    socket_dir: Path

    @property
    def digest(self) -> str:
        return self.manifest.digest

    def to_json(self) -> dict:
        return {
            "digest": self.digest,
            "checkpoint": self.manifest.checkpoint,
            "config_digest": self.manifest.config_digest,
            "socket_dir": str(self.socket_dir),
            "manifest": str(self.manifest_path),
            "shards": [
                {"name": s.name, "size": s.size, "sha256": s.sha256} for s in self.manifest.shards
            ],
            # Exactly the files hashed (vLLM's own selection), and the
            # coreutils command that reproduces the digest for this folder.
            "files": [s.name for s in self.manifest.shards],
            "selection": self.manifest.selection,
            "sha256sum_command": sha256sum_command(self.manifest),
            # False on a filesystem whose stat cannot see every edit (tmpfs):
            # engines there need identity pinned (this digest) or full.
            "stat_identity": filesystem_type(self.manifest.checkpoint) not in STAT_BLIND_FILESYSTEMS,
        }


def sha256sum_command(manifest: Manifest) -> str:
    """The shell command that prints ``manifest.digest`` with coreutils alone.

    The files are named one by one, in byte order, so the command is right
    for any layout (a glob would also hash files vLLM does not read, such as a
    ``consolidated.safetensors`` beside indexed shards).

    >>> sha256sum_command(promote("/models/m").manifest)  # doctest: +SKIP
    '(cd /models/m && sha256sum -- model.safetensors) | sha256sum'
    """
    names = " ".join(shlex.quote(s.name) for s in manifest.shards)
    return f"(cd {shlex.quote(manifest.checkpoint)} && sha256sum -- {names}) | sha256sum"


def promote(
    checkpoint: str | os.PathLike[str],
    socket_root: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    workers: int | None = None,
    progress: bool | None | Callable[[str], None] = None,
) -> Promotion:
    """Validate and hash ``checkpoint``, write its manifest atomically, and
    create its digest-keyed socket directory (0700).

    Nothing is written unless every shard validated and hashed, and nothing
    is read before the checks that need no weights passed (socket root,
    cache writability and trust: :mod:`preload.preflight`).
    """
    preflight_promote(checkpoint, socket_root, cache_dir)
    manifest = build_manifest(checkpoint, workers=workers, progress=progress)
    # The socket directory before the manifest: a root that cannot be made
    # (a parent that only looks writable: /proc, a read-only mount) leaves
    # nothing half-promoted behind.
    target = socket_dir(manifest.digest, socket_root)
    try:
        sdir = ensure_private_dir(target)
    except OSError as exc:
        raise PreloadGateError(
            f"cannot create the socket directory {target}: {describe(exc, target)}; "
            "choose a writable --socket-root (or PRELOAD_GATE_SOCKET_ROOT)"
        ) from exc
    path = write_manifest(manifest, cache_dir)
    fstype = filesystem_type(manifest.checkpoint)
    if fstype in STAT_BLIND_FILESYSTEMS:
        logging.getLogger("preload.promote").warning(
            "%s is on %s, where writes through mmap change no stat field: engines in identity mode "
            "'stat' will miss here; start them with identity 'pinned' and expected_digest %s (or 'full')",
            manifest.checkpoint, fstype, manifest.digest)
    return Promotion(manifest, path, sdir)
