"""The OpenAI completions wire format, as a canary reads a replica's answer.

Answers name token ids (``"token_id:123"``, from ``return_tokens_as_token_ids``)
so they map back to the golden's ids; anything else a replica sends is a
``malformed`` :class:`ReplicaFailure` naming where it went wrong.
"""

from __future__ import annotations

import json
from typing import Any

from canaries.compare import Answer

_TOKEN_PREFIX = "token_id:"


class ReplicaFailure(Exception):
    """One replica cannot be checked; ``reason`` is a short code, the message says why.

    ``retryable`` failures (unreachable, timed out, 5xx, 429) are tried again;
    a malformed answer or a 4xx is not: it would answer the same way.
    """

    def __init__(self, reason: str, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.retryable = retryable


def api_urls(base_url: str) -> tuple[str, str]:
    """``(OpenAI base ending in /v1, server root)`` from what an operator types."""
    url = base_url.rstrip("/")
    if url.endswith("/v1"):
        return url, url[: -len("/v1")]
    return url + "/v1", url


def _parse_token(tok: Any, where: str) -> int:
    if not isinstance(tok, str) or not tok.startswith(_TOKEN_PREFIX):
        raise ReplicaFailure("malformed", f"{where}: token {str(tok)[:40]!r} is not 'token_id:N' "
                             "(does the server honour return_tokens_as_token_ids?)")
    try:
        return int(tok[len(_TOKEN_PREFIX):])
    except ValueError:
        raise ReplicaFailure("malformed", f"{where}: token {tok[:40]!r} has no integer id") from None


def _number(x: Any, where: str) -> float | None:
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ReplicaFailure("malformed", f"{where}: logprob {str(x)[:40]!r} is not a number")
    return float(x)


def parse_completion(body: Any, n_prompts: int) -> list[Answer]:
    """Answers, in prompt order, from a completions response body (parsed JSON).

    Raises :class:`ReplicaFailure`: ``no_choices`` (no ``choices`` list, or
    not one choice per prompt), ``no_logprobs`` (a choice whose ``logprobs``
    is null or absent: its tokens cannot be read as ids), ``malformed``
    (anything else not in the wire format). Logprobs missing at a position
    (null, or lists shorter than ``tokens``) are kept as None: whether that
    prevents a judgement is :func:`canaries.compare.compare_answer`'s to say.
    """
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        keys = ", ".join(sorted(map(str, body)))[:80] if isinstance(body, dict) else type(body).__name__
        raise ReplicaFailure("no_choices", f"completion response has no 'choices' list (it has: {keys or 'nothing'})")
    choices = body["choices"]
    if len(choices) != n_prompts:
        raise ReplicaFailure("no_choices", f"completion response has {len(choices)} choices for {n_prompts} prompts")
    answers: list[Answer | None] = [None] * n_prompts
    for pos, ch in enumerate(choices):
        if not isinstance(ch, dict):
            raise ReplicaFailure("malformed", f"choice {pos} is not an object")
        idx = ch.get("index", pos)
        if not isinstance(idx, int) or not 0 <= idx < n_prompts or answers[idx] is not None:
            raise ReplicaFailure("malformed", f"choice {pos} has a bad or repeated index {idx!r}")
        answers[idx] = _answer(ch, f"choice {idx}")
    return [a for a in answers if a is not None]


def _answer(ch: dict[str, Any], where: str) -> Answer:
    lp = ch.get("logprobs")
    if lp is None:
        raise ReplicaFailure("no_logprobs", f"{where}: the server returned no logprobs ('logprobs' is null); "
                             f"{ENABLE_LOGPROBS}")
    if not isinstance(lp, dict) or not isinstance(lp.get("tokens"), list):
        raise ReplicaFailure("malformed", f"{where} has no logprobs.tokens")
    ids = [_parse_token(t, where) for t in lp["tokens"]]
    token_lps = lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or []
    if not isinstance(token_lps, list) or not isinstance(tops, list):
        raise ReplicaFailure("malformed", f"{where}: logprobs are not lists")
    if len(token_lps) > len(ids) or len(tops) > len(ids):
        raise ReplicaFailure("malformed", f"{where}: {len(token_lps)} token_logprobs and {len(tops)} top_logprobs "
                             f"for {len(ids)} tokens")
    top: list[dict[int, float] | None] = []
    for step in tops:
        if step is None:
            top.append(None)
            continue
        if not isinstance(step, dict):
            raise ReplicaFailure("malformed", f"{where}: a top_logprobs entry is not an object")
        parsed: dict[int, float] = {}
        for k, v in step.items():
            val = _number(v, where)
            if val is None:
                raise ReplicaFailure("malformed", f"{where}: top logprob of {k!r} is null")
            parsed[_parse_token(k, where)] = val
        top.append(parsed)
    # Shorter lists than tokens: the positions past their end have none.
    chosen = [_number(x, where) for x in token_lps] + [None] * (len(ids) - len(token_lps))
    top += [None] * (len(ids) - len(top))
    reason = ch.get("finish_reason")
    return Answer(ids, chosen, top, reason if isinstance(reason, str) else None)


# What a replica must do for a canary to judge it; said under every no_logprobs.
ENABLE_LOGPROBS = (
    "the canary compares logprobs, so the replica must return them for every token it asks about "
    "(vLLM does, up to its --max-logprobs, default 20; a router or gateway in front must pass "
    "'logprobs' and 'return_tokens_as_token_ids' through, or check the replica's own URL)"
)


def version_from_completion(body: Any) -> str | None:
    """A vLLM version the completion response states, if any.

    vLLM's OpenAI server does not put its version in completion bodies today;
    a front that does (``system_fingerprint`` of the form ``vllm-X.Y.Z``) is
    believed, as the answer comes from the replica itself.
    """
    fp = body.get("system_fingerprint") if isinstance(body, dict) else None
    if isinstance(fp, str) and fp.startswith("vllm-"):
        return fp[len("vllm-"):]
    return None


def json_body(text: str | None, what: str) -> Any:
    """``text`` parsed as JSON; a ``malformed`` failure naming ``what`` when it is not."""
    try:
        return json.loads(text or "")
    except ValueError:
        raise ReplicaFailure("malformed", f"{what}: answer is not JSON: {(text or '')[:80]!r}") from None
