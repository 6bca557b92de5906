"""The ``verified_cache`` loader's extra config (``--model-loader-extra-config``).

Parsed and checked without vLLM, so a bad key or value is one named error
before any engine work; unknown keys are an error. The UNSAFE negative
controls (``unsafe_identity``, ``unsafe_silent_fallback``,
``unsafe_uncounted_memory``) are refused
unless the test-only switch in :mod:`preload.trust` is set.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pgbase.digest_text import parse_digest
from pgbase.errors import DigestFormatError, PreloadGateError
from preload.identity.manifest import MODES as IDENTITIES
from preload.trust import UNSAFE_CONTROLS_ENV, UNSAFE_IDENTITIES, unsafe_controls_allowed

LOAD_FORMAT = "verified_cache"
# How an engine holds attached tensors; preload.hf_attach takes the same two.
MODES = ("zero_copy", "copy")


class LoaderConfigError(PreloadGateError):
    """The loader's extra config is malformed."""


@dataclass(frozen=True)
class LoaderOptions:
    socket_root: str | None = None
    socket_dir: str | None = None
    mode: str = "zero_copy"
    fallback: bool = True
    identity: str = "stat"
    expected_digest: str | None = None
    # None: on where an engine can write into the daemon's arena (CUDA:
    # zero-copy maps the daemon's own memory), off for sealed shm arenas.
    verify_resident: bool | None = None
    events_file: str | None = None
    connect_timeout_s: float = 5.0
    state_timeout_s: float = 300.0
    unsafe_identity: str | None = None
    unsafe_silent_fallback: bool = False
    # UNSAFE control (tests only): count no daemon memory in vLLM's budget
    # (get_external_weight_memory 0), as this loader did before it counted it.
    unsafe_uncounted_memory: bool = False

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> LoaderOptions:
        extra = dict(extra or {})
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(names))
        if unknown:
            raise LoaderConfigError(
                f"unknown {LOAD_FORMAT} extra config keys: {unknown} (known: {', '.join(sorted(names))})"
            )
        for k in ("fallback", "verify_resident", "unsafe_silent_fallback", "unsafe_uncounted_memory"):
            if k in extra and not isinstance(extra[k], bool):
                raise LoaderConfigError(f"{LOAD_FORMAT} extra config {k!r} must be true or false")
        for k in ("connect_timeout_s", "state_timeout_s"):
            if k in extra:
                if isinstance(extra[k], bool) or not isinstance(extra[k], (int, float)) or extra[k] <= 0:
                    raise LoaderConfigError(f"{LOAD_FORMAT} extra config {k!r} must be a positive number")
                extra[k] = float(extra[k])
        for k in ("socket_root", "socket_dir", "expected_digest", "events_file", "unsafe_identity"):
            if extra.get(k) is not None and not isinstance(extra[k], str):
                raise LoaderConfigError(f"{LOAD_FORMAT} extra config {k!r} must be a string")
        opts = cls(**extra)
        if opts.mode not in MODES:
            raise LoaderConfigError(f"{LOAD_FORMAT} mode {opts.mode!r} is not one of {', '.join(MODES)}")
        if opts.identity not in IDENTITIES:
            raise LoaderConfigError(f"{LOAD_FORMAT} identity {opts.identity!r} is not one of {', '.join(IDENTITIES)}")
        if opts.identity == "pinned" and not opts.expected_digest:
            raise LoaderConfigError(f"{LOAD_FORMAT} identity 'pinned' needs expected_digest")
        if opts.expected_digest is not None:
            try:
                digest = parse_digest(opts.expected_digest, f"{LOAD_FORMAT} extra config 'expected_digest'")
            except DigestFormatError as exc:
                raise LoaderConfigError(str(exc)) from exc
            opts = dataclasses.replace(opts, expected_digest=digest)
        if opts.unsafe_identity is not None and opts.unsafe_identity not in UNSAFE_IDENTITIES:
            raise LoaderConfigError(f"{LOAD_FORMAT} unsafe_identity must be "
                                    f"{' or '.join(map(repr, UNSAFE_IDENTITIES))}")
        for name, on in (("unsafe_identity", opts.unsafe_identity is not None),
                         ("unsafe_silent_fallback", opts.unsafe_silent_fallback),
                         ("unsafe_uncounted_memory", opts.unsafe_uncounted_memory)):
            if on and not unsafe_controls_allowed():
                raise LoaderConfigError(
                    f"{LOAD_FORMAT} extra config {name!r} is a negative control for tests only; it is "
                    f"refused unless {UNSAFE_CONTROLS_ENV}=1 is set (never in production)")
        return opts

