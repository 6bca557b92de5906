"""One replica's canary check: discover the model, check the version, ask, compare.

Every attempt runs under ``asyncio.wait_for``: an HTTP client's timeout
bounds each socket read, not the whole answer, so a server that drips a
byte a second would otherwise hold the check forever.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from openai import APIConnectionError, APIStatusError, APITimeoutError, AsyncOpenAI

from canaries.compare import NO_LOGPROBS, SHORT_ANSWER, Answer, Difference, Gap, compare_answers
from canaries.completion import (
    ENABLE_LOGPROBS,
    ReplicaFailure,
    api_urls,
    json_body,
    parse_completion,
    version_from_completion,
)
from canaries.golden import Golden

_BACKOFF_S = 0.5


# The reasons that mean the replica answered and its answers differ from the
# golden's (as opposed to a replica that could not be asked or judged).
ANSWER_MISMATCH = frozenset({"token_mismatch", "logprob_drift"})
# Differing answers against a golden that cannot show it describes what the
# replica serves (no config digest: r02): neither a pass nor a failure.
CANNOT_JUDGE = "cannot_judge"
# Every reason printed CANNOT-JUDGE: the replica answered, but what it sent
# (or the golden) cannot decide between right and wrong weights.
UNJUDGED = frozenset({CANNOT_JUDGE, NO_LOGPROBS, SHORT_ANSWER})
# The word each result is printed with: PASS, NEAR-TIE, FAIL or CANNOT-JUDGE.
VERDICTS = ("PASS", "NEAR-TIE", "FAIL", "CANNOT-JUDGE")


@dataclass
class ReplicaResult:
    """The verdict for one replica.

    ``reason``: ``match``, ``near_tie`` (matched, except where two tokens the
    golden recorded within the tolerance swapped: ``near_ties`` names each),
    ``token_mismatch``, ``logprob_drift``,
    ``unreachable``, ``timeout``, ``http_error``, ``malformed``,
    ``no_choices`` (no ``choices`` list, or not one per prompt),
    ``no_model``, ``version_mismatch``, ``error`` (anything else, named),
    and the reasons of :data:`UNJUDGED`: ``cannot_judge`` (answers differ
    from a golden that cannot tell a config change from wrong weights),
    ``no_logprobs`` (the reply lacks logprobs a judgement needs),
    ``short_answer`` (the server cut an answer before the golden's length).
    """

    base_url: str
    ok: bool
    reason: str
    detail: str
    model: str | None = None
    vllm_version: str | None = None
    attempts: int = 0
    seconds: float = 0.0
    max_logprob_delta: float | None = None
    first_difference: dict[str, Any] | None = None
    claim: dict[str, str] | None = None
    near_ties: list[dict[str, Any]] = field(default_factory=list)
    # Where vllm_version came from: "probe" (GET /version), or why it is unknown.
    version_source: str = ""

    @property
    def verdict(self) -> str:
        """One of :data:`VERDICTS`: how this result is printed."""
        if self.ok:
            return "NEAR-TIE" if self.reason == "near_tie" else "PASS"
        return "CANNOT-JUDGE" if self.reason in UNJUDGED else "FAIL"

    def line(self) -> str:
        return f"{self.verdict} {self.base_url}: {self.detail}"


def gap_detail(gap: Gap, golden: Golden) -> str:
    """The line for a reply that lacks what a judgement needs: what it lacks,
    where, and what makes the replica answer in full."""
    where = f"prompt {gap.prompt_index} at position {gap.position} ({gap.what})"
    if gap.kind == NO_LOGPROBS:
        return (f"not judged: the server returned no logprobs for {where}, "
                f"{golden.sampling.top_logprobs} top logprobs asked; {ENABLE_LOGPROBS}")
    return (f"not judged: the server cut the answer to {where}, {golden.sampling.max_tokens} tokens asked; "
            "a server or router limit on max_tokens stopped it: raise that limit, or check the replica's own URL")


class Replica:
    """One replica's check: discover the model, check the version, ask, compare."""

    def __init__(
        self, base_url: str, golden: Golden, timeout_s: float, retries: int, tolerance: float,
        model: str | None, api_key: str, version_probe: bool = True,
    ) -> None:
        self.base_url = base_url
        self.golden = golden
        self.timeout_s = timeout_s
        self.retries = retries
        self.tolerance = tolerance
        self.model = model
        self.api_key = api_key
        self.version_probe = version_probe
        self.version_note = ""
        self.api, self.root = api_urls(base_url)

    async def run(self, sem: asyncio.Semaphore) -> ReplicaResult:
        async with sem:
            t0 = time.monotonic()
            # max_retries=0: retries are ours, each under one overall deadline.
            client = AsyncOpenAI(base_url=self.api, api_key=self.api_key, max_retries=0, timeout=self.timeout_s)
            try:
                result, attempts = await self._attempts(client)
                if result.first_difference is not None:
                    await self._name_tokens(client, result)
            finally:
                await client.close()
        result.attempts = attempts
        result.seconds = round(time.monotonic() - t0, 3)
        if not result.ok and result.reason in ("unreachable", "timeout", "http_error") and attempts > 1:
            result.detail += f" (after {attempts} attempts)"
        return result

    async def _attempts(self, client: Any) -> tuple[ReplicaResult, int]:
        attempts = 0
        while True:
            attempts += 1
            try:
                return await asyncio.wait_for(self._attempt(client), timeout=self.timeout_s), attempts
            except asyncio.TimeoutError:
                failure = ReplicaFailure("timeout", f"no complete answer within {self.timeout_s:g} s", retryable=True)
            except ReplicaFailure as exc:
                failure = exc
            except Exception as exc:  # a surprise is this replica's failure, not the whole check's
                failure = _surprise(exc)
            if not failure.retryable or attempts > self.retries:
                return ReplicaResult(self.base_url, False, failure.reason, str(failure)), attempts
            await asyncio.sleep(_BACKOFF_S * attempts)

    async def _name_tokens(self, client: Any, result: ReplicaResult) -> None:
        """Put the differing tokens into words, under its own deadline: a
        replica slow to detokenize still gets its token verdict, with ids."""
        assert result.first_difference is not None
        diff = result.first_difference["difference"]
        try:
            described = await asyncio.wait_for(
                self._describe(client, result.model or "", diff, ask_replica=True), timeout=self.timeout_s)
        except Exception:  # the golden's own token texts still name what they can
            described = await self._describe(client, result.model or "", diff, ask_replica=False)
        result.first_difference = described
        result.detail = described["detail"]

    async def _attempt(self, client: Any) -> ReplicaResult:
        self.version_note = ""
        model = self.model or await self._served_model(client)
        version = await self._version(client) if self.version_probe else None
        if not self.version_probe:
            self.version_note = "not probed (--no-version-probe)"
        if version is not None and version != self.golden.vllm_version:
            return ReplicaResult(
                self.base_url, False, "version_mismatch",
                f"GET /version says vLLM {version}, the golden was recorded with {self.golden.vllm_version}; "
                "record a golden with the replica's vLLM (behind a router that answers /version itself, "
                "pass --no-version-probe)",
                model=model, vllm_version=version, version_source="probe",
            )
        answers, body = await self._ask(client, model)
        if version is None:
            version = version_from_completion(body)
            if version is not None:
                self.version_note = "the completion response"
                if version != self.golden.vllm_version:
                    return ReplicaResult(
                        self.base_url, False, "version_mismatch",
                        f"the completion response says vLLM {version}, the golden was recorded with "
                        f"{self.golden.vllm_version}; record a golden with the replica's vLLM",
                        model=model, vllm_version=version, version_source=self.version_note,
                    )
        source = "probe" if version is not None and not self.version_note else (
            self.version_note or "unknown: the replica did not say; not compared")
        comparison = compare_answers(self.golden.prompts, answers, self.tolerance, self.golden.sampling.top_logprobs)
        shape = f"{len(answers)} prompts x {self.golden.sampling.max_tokens} tokens"
        if comparison.ok and comparison.near_ties:
            ties = [asdict(t) for t in comparison.near_ties]
            where = ", ".join(f"prompt {t.prompt_index} position {t.position} ({t.expected_id}<->{t.got_id}, "
                              f"gap {t.gap:.2g}" + (", a tie the golden recorded" if t.recorded else "") + ")"
                              for t in comparison.near_ties)
            return ReplicaResult(
                self.base_url, True, "near_tie",
                f"near-tie, not a weights difference: the golden recorded both tokens within the tolerance "
                f"{self.tolerance:g} at {where}; that prompt compared up to there, the rest match; "
                f"max |logprob delta| {comparison.max_delta:.4f}",
                model=model, vllm_version=version, max_logprob_delta=comparison.max_delta, near_ties=ties,
                version_source=source,
            )
        if comparison.ok:
            return ReplicaResult(
                self.base_url, True, "match",
                f"{shape} match; max |logprob delta| {comparison.max_delta:.4f} (tolerance {self.tolerance:g})"
                + ("" if source == "probe" else f"; vLLM version {source}"),
                model=model, vllm_version=version, max_logprob_delta=comparison.max_delta, version_source=source,
            )
        if comparison.gap is not None:
            return ReplicaResult(
                self.base_url, False, comparison.gap.kind, gap_detail(comparison.gap, self.golden),
                model=model, vllm_version=version, version_source=source, max_logprob_delta=comparison.max_delta,
            )
        diff = comparison.difference
        assert diff is not None
        # Named in words by run(), outside this attempt's deadline.
        return ReplicaResult(
            self.base_url, False, "token_mismatch" if diff.kind == "token" else "logprob_drift",
            f"{diff.kind} difference in prompt {diff.prompt_index} at position {diff.position}",
            model=model, vllm_version=version, version_source=source,
            max_logprob_delta=comparison.max_delta, first_difference={"difference": diff},
        )

    async def _call(self, what: str, request: Any) -> str | None:
        """Await one openai-client request and return its body text (None for a
        404 on an optional endpoint); map the client's failures onto ours.

        Bodies are taken as text and parsed here, not by the client, so that
        garbage is reported as ``malformed`` naming the replica.
        """
        try:
            resp = await request
        except APITimeoutError as exc:
            raise ReplicaFailure("timeout", f"{what}: timed out", retryable=True) from exc
        except APIConnectionError as exc:
            raise ReplicaFailure("unreachable", f"{what}: cannot connect ({exc.__cause__ or exc})", retryable=True) from exc
        except APIStatusError as exc:
            code = exc.status_code
            if code == 404 and what == "GET /version":
                return None
            text = exc.response.text[:200]
            raise ReplicaFailure("http_error", f"{what}: HTTP {code} {text!r}", retryable=code >= 500 or code == 429) from exc
        # with_raw_response gives a wrapper; get(cast_to=str) the text itself.
        return resp if isinstance(resp, str) else str(resp.http_response.text)

    async def _served_model(self, client: Any) -> str:
        resp = await self._call("GET /v1/models", client.models.with_raw_response.list())
        body = json_body(resp, "GET /v1/models")
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
            raise ReplicaFailure("malformed", "GET /v1/models: no 'data' list of models with ids")
        ids = [m["id"] for m in data]
        if len(ids) > 1:
            # vLLM with --enable-lora lists adapters beside the base, each
            # naming its base as "parent": the one model without one is it.
            roots = [m["id"] for m in data if not m.get("parent")]
            if len(roots) == 1 and all(m.get("parent") in (None, roots[0]) for m in data):
                return str(roots[0])
        if len(ids) != 1:
            raise ReplicaFailure("no_model", f"replica serves {len(ids)} models ({', '.join(ids)[:200]}); pass --model NAME")
        return str(ids[0])

    async def _version(self, client: Any) -> str | None:
        """vLLM's ``/version``; None when nothing usable answers there.

        A gateway that only forwards ``/v1`` (401/403), a web front that
        answers every path with HTML, or no such endpoint: the probe says
        nothing about the replica, so the version is taken from the
        completion response if it says, and otherwise left unknown (noted in
        the result), rather than failing a correct replica. Unreachable and
        timed-out stay failures: the completion would meet the same.
        """
        try:
            resp = await self._call("GET /version", client.get(self.root + "/version", cast_to=str))
        except ReplicaFailure as exc:
            if exc.reason != "http_error" or exc.retryable:
                raise
            self.version_note = f"unknown: {exc}"
            return None
        if resp is None:
            self.version_note = "unknown: GET /version: 404"
            return None
        try:
            body = json.loads(resp)
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("version"), str):
            self.version_note = f"unknown: GET /version is not vLLM's ({resp[:40]!r})"
            return None
        return str(body["version"])

    async def _ask(self, client: Any, model: str) -> tuple[list[Answer], Any]:
        s = self.golden.sampling
        # vLLM's sampling extensions travel in extra_body; see Sampling for why
        # each is stated rather than left to the server's defaults.
        request = client.completions.with_raw_response.create(
            model=model,
            prompt=[p.prompt_token_ids for p in self.golden.prompts],
            max_tokens=s.max_tokens,
            temperature=0.0,
            top_p=1.0,
            logprobs=s.top_logprobs,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            extra_body={
                "repetition_penalty": s.repetition_penalty,
                "ignore_eos": s.ignore_eos,
                "return_tokens_as_token_ids": True,
            },
        )
        resp = await self._call("POST /v1/completions", request)
        body = json_body(resp, "POST /v1/completions")
        return parse_completion(body, len(self.golden.prompts)), body

    async def _token_text(self, client: Any, model: str, token_id: int | None, ask_replica: bool) -> str:
        if token_id is None:
            return "<end of answer>"
        known = self.golden.token_text(token_id)
        if known is not None:
            return known
        if not ask_replica:
            return f"<id {token_id}>"
        # Not in the golden's vocabulary excerpt: ask the replica's tokenizer.
        try:
            text = await client.post(
                self.root + "/detokenize", body={"model": model, "tokens": [token_id]}, cast_to=str
            )
            body = json.loads(text)
            if isinstance(body, dict) and isinstance(body.get("prompt"), str):
                return str(body["prompt"])
        except Exception:  # best effort: naming the id is enough when this fails
            pass
        return f"<id {token_id}>"

    async def _describe(self, client: Any, model: str, d: Difference, ask_replica: bool) -> dict[str, Any]:
        prompt = self.golden.prompts[d.prompt_index].prompt
        out: dict[str, Any] = {"kind": d.kind, "prompt_index": d.prompt_index, "prompt": prompt, "position": d.position}
        if d.kind == "token":
            exp_text = await self._token_text(client, model, d.expected_id, ask_replica)
            got_text = await self._token_text(client, model, d.got_id, ask_replica)
            out.update(expected_id=d.expected_id, expected_text=exp_text, got_id=d.got_id, got_text=got_text)
            out["detail"] = (
                f"token mismatch in prompt {d.prompt_index} ({prompt[:40]!r}) at position {d.position}: "
                f"expected {d.expected_id} {exp_text!r}, got {d.got_id} {got_text!r}"
            )
        else:
            tok_text = await self._token_text(client, model, d.token_id, ask_replica)
            out.update(token_id=d.token_id, token_text=tok_text,
                       expected_logprob=d.expected_logprob, got_logprob=d.got_logprob)
            out["detail"] = (
                f"logprob drift in prompt {d.prompt_index} ({prompt[:40]!r}) at position {d.position}: "
                f"token {d.token_id} {tok_text!r} expected {d.expected_logprob}, got {d.got_logprob} "
                f"(tolerance {self.tolerance:g})"
            )
        return out


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups: what went wrong, not the TaskGroup that carried it."""
    # By shape, not by name: on Python 3.10 the group is the exceptiongroup backport's.
    subs = getattr(exc, "exceptions", None)
    if isinstance(subs, tuple) and subs and all(isinstance(e, BaseException) for e in subs):
        return [leaf for sub in subs for leaf in _leaves(sub)]
    return [exc]


def _surprise(exc: Exception) -> ReplicaFailure:
    """A failure the client did not map (see :meth:`Replica._call`), by its real
    cause: the HTTP stack's task groups (anyio's connect) raise an
    ExceptionGroup around it. A connection error among them is ``unreachable``
    (retried, as the client's own), anything else an ``error``."""
    leaves = _leaves(exc)
    text = "; ".join(dict.fromkeys(f"{type(e).__name__}: {e}" for e in leaves))
    if any(isinstance(e, ConnectionError) for e in leaves):
        return ReplicaFailure("unreachable", f"cannot connect ({text})", retryable=True)
    return ReplicaFailure("error", text)
