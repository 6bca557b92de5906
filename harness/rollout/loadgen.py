"""A load generator for a rollout: requests to every replica, each answer judged.

One thread per replica (``per_replica`` of them) sends the golden prompts
in turn, one completions request at a time at ``rate`` requests a second
per replica (a steady load, not a flood that would starve the restarts on
a small host), exactly as the canary asks
them (the prompt's token ids, temperature 0, the golden's ``max_tokens``,
logprobs and stated penalties, ``return_tokens_as_token_ids``). Every
request ends in one of three counts:

- ``answered``: HTTP 200 whose tokens match the golden of one checkpoint of
  the rollout for that prompt (:func:`canaries.compare.compare_answer`:
  tokens exactly, logprobs within the tolerance, near-ties accepted and
  counted apart), counted by checkpoint;
- ``refused``: no answer (connection refused or reset, a timeout, an HTTP
  error, a body that is not a completion): what a client meets while its
  replica restarts;
- ``wrong``: an answer that matches none of the goldens: weights nobody
  rolled out. A rollout must end with ``wrong == 0``.

All goldens must ask the same prompts (the default canary prompts do), so
one answer can be held against each.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from canaries.compare import DEFAULT_TOLERANCE, compare_answer
from canaries.completion import ReplicaFailure, parse_completion
from canaries.golden import Golden
from pgbase.errors import PreloadGateError

REQUEST_TIMEOUT_S = 10.0
DEFAULT_RATE = 2.0  # requests per second per replica: load, not a flood that starves the restarts
REFUSED_PAUSE_S = 0.2  # between attempts at a replica that refuses (it is restarting)


class LoadGenError(PreloadGateError):
    """Goldens a load generator cannot judge answers against."""


@dataclass
class LoadCounts:
    """What the load generator saw, in total and per replica."""

    answered: int = 0
    refused: int = 0
    wrong: int = 0
    near_ties: int = 0
    by_checkpoint: Counter[str] = field(default_factory=Counter)
    by_replica: dict[str, Counter[str]] = field(default_factory=dict)
    wrong_examples: list[dict[str, Any]] = field(default_factory=list)
    refused_reasons: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"answered": self.answered, "refused": self.refused, "wrong": self.wrong,
                "near_ties": self.near_ties, "by_checkpoint": dict(self.by_checkpoint),
                "by_replica": {k: dict(v) for k, v in self.by_replica.items()},
                "refused_reasons": dict(self.refused_reasons.most_common(10)),
                "wrong_examples": self.wrong_examples[:5], "seconds": round(self.seconds, 1)}


def _check_prompts(goldens: dict[str, Golden]) -> list[list[int]]:
    if not goldens:
        raise LoadGenError("the load generator needs the golden of every checkpoint of the rollout")
    first_label, first = next(iter(goldens.items()))
    prompts = [p.prompt_token_ids for p in first.prompts]
    for label, g in goldens.items():
        if [p.prompt_token_ids for p in g.prompts] != prompts or g.sampling != first.sampling:
            raise LoadGenError(f"the goldens of {first_label} and {label} ask different prompts or sampling; "
                               "record them with the same canary prompts (the default)")
    return prompts


class LoadGenerator:
    """Threads sending golden prompts to every replica until :meth:`stop`."""

    def __init__(self, urls: list[str], goldens: dict[str, Golden], per_replica: int = 1,
                 tolerance: float = DEFAULT_TOLERANCE, timeout_s: float = REQUEST_TIMEOUT_S,
                 rate: float = DEFAULT_RATE) -> None:
        self.prompts = _check_prompts(goldens)
        self.urls, self.goldens, self.tolerance, self.timeout_s = urls, goldens, tolerance, timeout_s
        self.interval_s = per_replica / rate if rate > 0 else 0.0
        self.sampling = next(iter(goldens.values())).sampling
        self.counts = LoadCounts(by_replica={u: Counter() for u in urls})
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(u, k), name=f"loadgen-{i}-{k}", daemon=True)
                         for i, u in enumerate(urls) for k in range(per_replica)]
        self._t0 = 0.0

    def start(self) -> LoadGenerator:
        self._t0 = time.monotonic()
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> LoadCounts:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 5)
        self.counts.seconds = time.monotonic() - self._t0
        return self.counts

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"answered": self.counts.answered, "refused": self.counts.refused, "wrong": self.counts.wrong}

    def _body(self, model: str, prompt: list[int]) -> bytes:
        s = self.sampling
        return json.dumps({
            "model": model, "prompt": [prompt], "max_tokens": s.max_tokens, "temperature": 0.0, "top_p": 1.0,
            "logprobs": s.top_logprobs, "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty, "repetition_penalty": s.repetition_penalty,
            "ignore_eos": s.ignore_eos, "return_tokens_as_token_ids": True,
        }).encode()

    def _post(self, url: str, path: str, body: bytes | None) -> Any:
        req = urllib.request.Request(url.rstrip("/") + path, data=body,
                                     headers={"Content-Type": "application/json"} if body else {})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:  # noqa: S310 (the operator's replica)
            return json.loads(r.read(4 << 20))

    def _model(self, url: str) -> str:
        data = self._post(url, "/v1/models", None).get("data") or []
        return str(data[0]["id"])

    def _loop(self, url: str, offset: int) -> None:
        model: str | None = None
        next_at = time.monotonic()
        for k in itertools.count(offset):
            next_at += self.interval_s
            if self._stop.wait(max(0.0, next_at - time.monotonic())):
                return
            i = k % len(self.prompts)
            try:
                model = model or self._model(url)
                answer = parse_completion(self._post(url, "/v1/completions", self._body(model, self.prompts[i])), 1)[0]
            except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, ReplicaFailure) as exc:
                model = None  # a restarted replica may serve under another name
                self._count(url, "refused", reason=type(exc).__name__)
                self._stop.wait(REFUSED_PAUSE_S)
                continue
            self._judge(url, i, answer)

    def _judge(self, url: str, i: int, answer: Any) -> None:
        for label, g in self.goldens.items():
            c = compare_answer(g.prompts[i], i, answer, self.tolerance)
            if c.ok:
                self._count(url, "answered", checkpoint=label, near_tie=bool(c.near_ties))
                return
        self._count(url, "wrong", example={"replica": url, "prompt": i, "tokens": answer.token_ids[:16]})

    def _count(self, url: str, outcome: str, checkpoint: str = "", near_tie: bool = False, reason: str = "",
               example: dict[str, Any] | None = None) -> None:
        with self._lock:
            c = self.counts
            setattr(c, outcome, getattr(c, outcome) + 1)
            c.by_replica[url][outcome] += 1
            if checkpoint:
                c.by_checkpoint[checkpoint] += 1
            if near_tie:
                c.near_ties += 1
            if reason:
                c.refused_reasons[reason] += 1
            if example is not None and len(c.wrong_examples) < 5:
                c.wrong_examples.append(example)
