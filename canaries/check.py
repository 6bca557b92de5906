"""Canary check: ask serving replicas the golden questions over the OpenAI API.

One asyncio task per replica, all at once under a concurrency bound. Each
replica gets one completions request carrying every golden prompt as token
ids (``prompt`` is a list of id lists), temperature 0, the golden's
``max_tokens`` and ``logprobs``, and ``return_tokens_as_token_ids`` so the
answer names token ids (``"token_id:123"``) rather than text that cannot be
mapped back. Tokens are compared exactly, logprobs within a tolerance
(``canaries.compare``).

Every attempt runs under ``asyncio.wait_for``: an HTTP client's timeout
bounds each socket read, not the whole answer, so a server that drips a
byte a second would otherwise hold the check forever. A replica is done in
at most ``(retries + 1) * timeout`` plus short back-offs, whatever it does.

>>> report = check(["http://10.0.0.5:8000"], load_golden("golden.json"))  # doctest: +SKIP
>>> report.ok  # doctest: +SKIP
True
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ParamSpec, TypeVar

from canaries.claims import Claim
from canaries.compare import DEFAULT_TOLERANCE
from canaries.errors import GoldenRefusedError
from canaries.golden import Golden
from canaries.replica import ANSWER_MISMATCH, CANNOT_JUDGE, UNJUDGED, Replica, ReplicaResult

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_RETRIES = 2
DEFAULT_CONCURRENCY = 8

P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class CheckReport:
    golden_digest: str
    tolerance: float
    results: list[ReplicaResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True only when there is at least one replica and every one matched."""
        return bool(self.results) and all(r.ok for r in self.results)

    @property
    def judged(self) -> bool:
        """False when some replica's answers could not be judged (a reason of ``UNJUDGED``)."""
        return not any(r.reason in UNJUDGED for r in self.results)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "golden_digest": self.golden_digest,
            "tolerance": self.tolerance,
            "judged": self.judged,
            "replicas": [{**asdict(r), "verdict": r.verdict} for r in self.results],
        }


async def check_async(
    base_urls: Sequence[str],
    golden: Golden,
    timeout: float = DEFAULT_TIMEOUT_S,
    retries: int = DEFAULT_RETRIES,
    tolerance: float = DEFAULT_TOLERANCE,
    expect_digest: str | None = None,
    claims: Mapping[str, Claim] | None = None,
    model: str | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    api_key: str = "EMPTY",
    version_probe: bool = True,
) -> CheckReport:
    """Ask every replica the golden prompts and compare; ``report.ok`` only if all match.

    Answers that differ from a golden recorded before goldens were keyed by
    config.json (no ``config_digest``) are ``cannot_judge``, not a failure
    (``report.judged`` is False). ``timeout`` bounds one attempt (model discovery, version, completion);
    failures that may pass (unreachable, timed out, 5xx) are retried up to
    ``retries`` times. ``expect_digest`` or per-replica ``claims`` make the
    check refuse (``GoldenRefusedError``) a golden recorded for other content
    than the replica says it serves, before any request is sent.
    :func:`check` is the same call, blocking.
    """
    if not base_urls:
        raise ValueError("no replica to check")
    if timeout <= 0 or retries < 0 or tolerance < 0 or concurrency < 1:
        raise ValueError("timeout must be > 0, retries >= 0, tolerance >= 0, concurrency >= 1")
    replica_claims = _claims(base_urls, golden, expect_digest, claims)
    sem = asyncio.Semaphore(concurrency)
    replicas = [Replica(u, golden, timeout, retries, tolerance, model, api_key, version_probe) for u in base_urls]
    results = await asyncio.gather(*(r.run(sem) for r in replicas))
    for r in results:
        c = replica_claims.get(r.base_url)
        if c is not None:
            r.claim = {"digest": c.digest, "source": c.source}
        if r.reason in ANSWER_MISMATCH and golden.config_digest is None:
            # Nothing in the golden shows it describes the config.json the
            # replica serves: a config-only fix (RoPE) would look exactly
            # like wrong weights (r02). Only differing answers are affected;
            # an unreachable replica or a version mismatch fails regardless.
            r.reason = CANNOT_JUDGE
            r.detail = f"cannot judge ({r.detail}): the golden records no config_digest"
    return CheckReport(golden.digest, tolerance, list(results))


def _blocking(coro_fn: Callable[P, Coroutine[Any, Any, R]], name: str, doc: str) -> Callable[P, R]:
    """``coro_fn`` as a blocking call: the same parameters, types and defaults
    (``inspect.signature`` shows them), run to completion by ``asyncio.run``."""

    @functools.wraps(coro_fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        return asyncio.run(coro_fn(*args, **kwargs))

    run.__name__ = run.__qualname__ = name
    run.__doc__ = doc
    return run


def _claims(
    base_urls: Sequence[str], golden: Golden, expect_digest: str | None, claims: Mapping[str, Claim] | None
) -> dict[str, Claim]:
    """Every replica's claim, refusing the golden when one names other content."""
    from canaries.claims import expected

    out: dict[str, Claim] = dict(claims or {})
    if expect_digest is not None:
        operator = expected(expect_digest)
        for u in base_urls:
            out.setdefault(u, operator)
    for u in base_urls:
        c = out.get(u)
        if c is not None and c.digest != golden.digest:
            raise GoldenRefusedError(u, golden.digest, c.digest, c.source)
    return out


check = _blocking(check_async, "check", """Ask every replica the golden prompts and compare; ``report.ok`` only if all match.

The blocking :func:`check_async` (run by ``asyncio.run``): the same
arguments, defaults and errors.
""")
