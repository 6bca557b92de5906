"""Typed failures of the canary layer; the CLI prints each as one line."""

from __future__ import annotations

from pgbase.digest_text import parse_digest
from pgbase.errors import DigestFormatError, PreloadGateError


class GoldenError(PreloadGateError):
    """A golden file or a prompt set is missing, malformed, or cannot be recorded."""


def read_digest(value: object, field: str) -> str:
    """``value`` by :func:`pgbase.digest_text.parse_digest` (lower case); a
    refusal is a GoldenError, this layer's type for bad input, naming ``field``."""
    try:
        return parse_digest(value, field)
    except DigestFormatError as exc:
        raise GoldenError(str(exc)) from exc


class GoldenRefusedError(PreloadGateError):
    """The golden file was recorded for other content than a replica claims to serve.

    Comparing them would report a difference that says nothing about the
    replica (or, worse, a pass that says nothing), so the check refuses.
    """

    def __init__(self, replica: str, golden_digest: str, claimed_digest: str, source: str) -> None:
        self.replica = replica
        self.golden_digest = golden_digest
        self.claimed_digest = claimed_digest
        self.source = source
        super().__init__(
            f"refusing golden for {replica}: golden was recorded for digest {golden_digest[:16]}, "
            f"but {source} says the replica serves {claimed_digest[:16]}; "
            "record a golden for that checkpoint (preload-gate canary record) or check the right replica"
        )


class UnjudgedRepliesError(PreloadGateError):
    """Replicas answered, but their replies lack what a judgement needs
    (logprobs, the full answer): neither a pass nor a failure.

    ``replicas`` is ``[(base_url, detail)]``; the message is the first one's
    whole line, and how many more there are.
    """

    def __init__(self, replicas: list[tuple[str, str]]) -> None:
        self.replicas = replicas
        url, detail = replicas[0]
        more = f" (and {len(replicas) - 1} more replicas; each line above)" if len(replicas) > 1 else ""
        super().__init__(f"cannot judge {url}: {detail.removeprefix('not judged: ')}{more}")
