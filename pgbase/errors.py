"""Typed failures, so callers decide on fallback by type, not by string.

Every error carries the sentence a person needs to act: which shard, which
field, what to run next. The CLI prints ``str(error)`` as its one line.
"""

from __future__ import annotations


class PreloadGateError(Exception):
    """Base of every error this project raises on purpose."""


class PreflightError(PreloadGateError):
    """A check that needs no weights failed; the message names the fix."""


class CheckpointError(PreloadGateError):
    """A checkpoint directory or one of its shards is unusable.

    ``shard`` names the file (None when the directory itself is the problem).
    """

    def __init__(self, message: str, shard: str | None = None) -> None:
        self.shard = shard
        super().__init__(f"{shard}: {message}" if shard else message)


class ManifestError(PreloadGateError):
    """A manifest is missing, unreadable, or stale for the checkpoint."""


class DigestFormatError(PreloadGateError, ValueError):
    """A digest someone handed us (a flag, a config key, a file, a reply) is
    not 64 hex characters; ``field`` names where it came from. Raised by
    :func:`pgbase.digest_text.parse_digest` only; a ValueError too, so code
    that refuses bad values by that type keeps refusing this one."""

    def __init__(self, message: str, field: str) -> None:
        self.field = field
        super().__init__(message)


class DigestMismatchError(PreloadGateError):
    """Bytes read do not hash to the digest they were asked to match."""


class WeightCacheUnavailableError(PreloadGateError):
    """No daemon is reachable, or its socket cannot be trusted."""


class DaemonBusyError(WeightCacheUnavailableError):
    """A daemon listens but its listen backlog stayed full for the whole
    connect timeout: it is alive and busy, not absent (starting another is
    no fix; retrying, or fewer engines connecting at once, is)."""


class CacheKeyMismatchError(PreloadGateError):
    """The daemon holds weights for another key; ``fields`` names the differences."""

    def __init__(self, fields: list[str], detail: str = "") -> None:
        self.fields = list(fields)
        msg = "weight cache key mismatch on fields: " + ", ".join(self.fields)
        super().__init__(msg + (f" ({detail})" if detail else ""))


class ProtocolError(PreloadGateError):
    """A frame broke the wire contract (size, JSON, schema, version)."""


class InsecureSocketError(WeightCacheUnavailableError):
    """A socket path failed an ownership, mode or symlink check."""


class WriteError(PreloadGateError, OSError):
    """A result file (manifest, report, golden) could not be written.

    Raised by ``pgbase.atomic`` after it removed its temporary file, so the
    previous file is intact. It is an OSError too (``errno`` is the cause's),
    so callers that catch OSError keep working, and a PreloadGateError, so
    the CLI prints it as one line instead of a traceback.
    """

    def __init__(self, path: str, cause: OSError) -> None:
        from pgbase.oscause import describe

        super().__init__(cause.errno, cause.strerror or str(cause), path)
        self.path = path
        self.why = describe(cause, path)  # now, while the cause (a full disk, the fd limit) holds

    def __str__(self) -> str:
        return f"cannot write {self.path}: {self.why}; the previous file is unchanged"
