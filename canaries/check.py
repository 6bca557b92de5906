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
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from openai import APIConnectionError, APIStatusError, APITimeoutError, AsyncOpenAI

from canaries.claims import Claim
from canaries.compare import DEFAULT_TOLERANCE, Answer, Difference, compare_answers
from canaries.errors import GoldenRefusedError
from canaries.golden import Golden

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_RETRIES = 2
DEFAULT_CONCURRENCY = 8
_BACKOFF_S = 0.5
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


# The reasons that mean the replica answered and its answers differ from the
# golden's (as opposed to a replica that could not be asked or judged).
ANSWER_MISMATCH = frozenset({"token_mismatch", "logprob_drift"})


@dataclass
class ReplicaResult:
    """The verdict for one replica.

    ``reason``: ``match``, ``near_tie`` (matched, except where two tokens the
    golden recorded within the tolerance swapped: ``near_ties`` names each),
    ``token_mismatch``, ``logprob_drift``,
    ``unreachable``, ``timeout``, ``http_error``, ``malformed``,
    ``no_model``, ``version_mismatch``, ``error`` (anything else, named).
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

    def line(self) -> str:
        verdict = ("NEAR-TIE" if self.reason == "near_tie" else "PASS") if self.ok else "FAIL"
        return f"{verdict} {self.base_url}: {self.detail}"


@dataclass
class CheckReport:
    golden_digest: str
    tolerance: float
    results: list[ReplicaResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True only when there is at least one replica and every one matched."""
        return bool(self.results) and all(r.ok for r in self.results)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "golden_digest": self.golden_digest,
            "tolerance": self.tolerance,
            "replicas": [asdict(r) for r in self.results],
        }


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
    """Answers, in prompt order, from a completions response body (parsed JSON)."""
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        raise ReplicaFailure("malformed", "completion response has no 'choices' list")
    choices = body["choices"]
    if len(choices) != n_prompts:
        raise ReplicaFailure("malformed", f"completion response has {len(choices)} choices for {n_prompts} prompts")
    answers: list[Answer | None] = [None] * n_prompts
    for pos, ch in enumerate(choices):
        if not isinstance(ch, dict):
            raise ReplicaFailure("malformed", f"choice {pos} is not an object")
        idx = ch.get("index", pos)
        if not isinstance(idx, int) or not 0 <= idx < n_prompts or answers[idx] is not None:
            raise ReplicaFailure("malformed", f"choice {pos} has a bad or repeated index {idx!r}")
        lp = ch.get("logprobs")
        if not isinstance(lp, dict) or not isinstance(lp.get("tokens"), list):
            raise ReplicaFailure("malformed", f"choice {idx} has no logprobs.tokens")
        where = f"choice {idx}"
        ids = [_parse_token(t, where) for t in lp["tokens"]]
        token_lps = lp.get("token_logprobs") or []
        tops = lp.get("top_logprobs") or []
        if not isinstance(token_lps, list) or not isinstance(tops, list):
            raise ReplicaFailure("malformed", f"{where}: logprobs are not lists")
        top: list[dict[int, float]] = []
        for step in tops:
            if step is None:
                top.append({})
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
        answers[idx] = Answer(ids, [_number(x, where) for x in token_lps], top)
    return [a for a in answers if a is not None]


class _Replica:
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
                failure = ReplicaFailure("error", f"{type(exc).__name__}: {exc}")
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
            version = _version_from_completion(body)
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
        comparison = compare_answers(self.golden.prompts, answers, self.tolerance)
        shape = f"{len(answers)} prompts x {self.golden.sampling.max_tokens} tokens"
        if comparison.ok and comparison.near_ties:
            ties = [asdict(t) for t in comparison.near_ties]
            where = ", ".join(f"prompt {t.prompt_index} position {t.position} ({t.expected_id}<->{t.got_id}, "
                              f"gap {t.gap:.2g})" for t in comparison.near_ties)
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
        body = _json_body(resp, "GET /v1/models")
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
        body = _json_body(resp, "POST /v1/completions")
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


def _version_from_completion(body: Any) -> str | None:
    """A vLLM version the completion response states, if any.

    vLLM's OpenAI server does not put its version in completion bodies today;
    a front that does (``system_fingerprint`` of the form ``vllm-X.Y.Z``) is
    believed, as the answer comes from the replica itself.
    """
    fp = body.get("system_fingerprint") if isinstance(body, dict) else None
    if isinstance(fp, str) and fp.startswith("vllm-"):
        return fp[len("vllm-"):]
    return None


def _json_body(text: str | None, what: str) -> Any:
    try:
        return json.loads(text or "")
    except ValueError:
        raise ReplicaFailure("malformed", f"{what}: answer is not JSON: {(text or '')[:80]!r}") from None


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
    """Check every replica against ``golden``; see :func:`check`."""
    if not base_urls:
        raise ValueError("no replica to check")
    if timeout <= 0 or retries < 0 or tolerance < 0 or concurrency < 1:
        raise ValueError("timeout must be > 0, retries >= 0, tolerance >= 0, concurrency >= 1")
    replica_claims = _claims(base_urls, golden, expect_digest, claims)
    sem = asyncio.Semaphore(concurrency)
    replicas = [_Replica(u, golden, timeout, retries, tolerance, model, api_key, version_probe) for u in base_urls]
    results = await asyncio.gather(*(r.run(sem) for r in replicas))
    for r in results:
        c = replica_claims.get(r.base_url)
        if c is not None:
            r.claim = {"digest": c.digest, "source": c.source}
    return CheckReport(golden.digest, tolerance, list(results))


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


def check(
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

    ``timeout`` bounds one attempt (model discovery, version, completion);
    failures that may pass (unreachable, timed out, 5xx) are retried up to
    ``retries`` times. ``expect_digest`` or per-replica ``claims`` make the
    check refuse (``GoldenRefusedError``) a golden recorded for other content
    than the replica says it serves, before any request is sent.
    """
    return asyncio.run(check_async(
        base_urls, golden, timeout=timeout, retries=retries, tolerance=tolerance,
        expect_digest=expect_digest, claims=claims, model=model, concurrency=concurrency, api_key=api_key,
        version_probe=version_probe,
    ))
