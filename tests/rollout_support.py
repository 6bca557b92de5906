"""Fake replicas and daemons for the rollout's unit tests (no vLLM).

- :class:`FakeReplica`: a loopback HTTP server speaking what a rollout asks
  a vLLM OpenAI server (``/health``, ``/v1/models``, ``/version``,
  ``POST /v1/completions`` with token-id prompts and
  ``return_tokens_as_token_ids``); it answers each prompt as the golden it
  is set to serve, or refuses (503) while "restarting";
- :class:`FakeDriver`: restarts a fake replica onto a target by script:
  ``ok`` (a hit event on the target's key, answers as its golden),
  ``wrong`` (a hit event, answers as another golden: the wrong hit the
  canary exists for), ``miss`` (a miss event, then gone), ``exit`` (gone
  without an event), ``no_event`` (serves, records nothing), ``wrong_event`` (a hit event
  on another digest), ``hang``
  (never serves), ``ties`` (answers with near-ties at every prompt);
- :class:`FakeDaemons`: the residency functions the runner calls, in memory;
- :func:`write_gate`: a passing promotion gate report in the gate's own
  shape, with its golden, for the evidence tests to forge from.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from canaries.golden import Golden, GoldenPrompt, Sampling
from harness.gate.references import vllm_version
from harness.rollout.replicas import StartFailedError, Target
from harness.rollout.state import DaemonRecord, ReplicaRecord
from pgbase.ports import free_port
from preload.deployment import DeploymentSettings

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]


def golden(seed: int, digest: str, ties: bool = False) -> Golden:
    """A golden whose tokens are distinct per ``seed``; ``ties``: the second-best
    token at position 0 of each prompt sits 1e-4 nats below the best."""
    prompts = []
    for i, ids in enumerate(PROMPTS):
        toks = [100 * seed + 10 * i + k for k in range(4)]
        lps = [-0.1, -0.2, -0.3, -0.4]
        tops = [{str(t): lp, str(t + 500): lp - (1e-4 if (ties and k == 0) else 2.0)}
                for k, (t, lp) in enumerate(zip(toks, lps, strict=True))]
        prompts.append(GoldenPrompt(f"p{i}", ids, toks, "", lps, tops))
    return Golden(digest, "0.32.0", Sampling(max_tokens=4, top_logprobs=2), prompts,
                  engine={"load_format": "auto", "dtype": "bfloat16", "resolved_dtype": "bfloat16"},
                  config_digest="c" * 64, tokenizer_digest="d" * 64)


def answer(g: Golden, i: int, tie_flip: bool = False) -> dict[str, Any]:
    p = g.prompts[i]
    toks = list(p.token_ids)
    lps = list(p.token_logprobs)
    tops = [dict(s) for s in p.top_logprobs]
    if tie_flip:  # the near-tied token chosen at position 0; the continuation then differs
        other = str(toks[0] + 500)
        toks = [toks[0] + 500, 9000, 9001, 9002]
        lps = [tops[0][other] + 5e-5, -0.5, -0.5, -0.5]
        tops = [{other: lps[0], str(p.token_ids[0]): lps[0] - 1e-5}] + [{str(t): -0.5} for t in toks[1:]]
    return {"index": i, "text": "", "finish_reason": "length", "logprobs": {
        "tokens": [f"token_id:{t}" for t in toks], "token_logprobs": lps,
        "top_logprobs": [{f"token_id:{k}": v for k, v in s.items()} for s in tops],
        "text_offset": [0] * len(toks)}}


class FakeReplica:
    """A fake vLLM OpenAI server; ``serving`` is the golden it answers as (None: 503)."""

    def __init__(self) -> None:
        self.serving: Golden | None = None
        self.tie_flip = False
        self.requests = 0
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def send(self, code: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                g = fake.serving
                if g is None:
                    return self.send(503, {"error": "starting"})
                if self.path == "/health":
                    return self.send(200, {})
                if self.path == "/version":
                    return self.send(200, {"version": "0.32.0"})
                if self.path == "/v1/models":
                    return self.send(200, {"object": "list", "data": [{"id": "m", "object": "model", "root": "/m"}]})
                return self.send(404, {})

            def do_POST(self) -> None:  # noqa: N802
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                g = fake.serving
                fake.requests += 1
                if g is None:
                    return self.send(503, {"error": "starting"})
                choices = []
                for n, ids in enumerate(req["prompt"]):
                    i = PROMPTS.index(ids)
                    c = answer(g, i, fake.tie_flip)
                    c["index"] = n
                    choices.append(c)
                return self.send(200, {"id": "c", "object": "text_completion", "model": "m", "choices": choices})

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), H)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class FakeDriver:
    """Restarts fake replicas by script: ``script[(replica, label)]`` (default ``ok``)."""

    replicas: dict[str, FakeReplica]
    goldens: dict[str, Golden]  # by key
    script: dict[tuple[int, str], str] = field(default_factory=dict)
    kind: str = "supervised"
    restarts: list[tuple[int, str]] = field(default_factory=list)
    gone: set[int] = field(default_factory=set)
    on_restart: Callable[[ReplicaRecord, Target], None] | None = None

    def describe(self) -> dict[str, Any]:
        return {"kind": "fake"}

    def _event(self, record: ReplicaRecord, **e: Any) -> None:
        import os

        fd = os.open(record.events_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(json.dumps({"rank": 0, **e}) + "\n")

    def restart(self, record: ReplicaRecord, target: Target, saved: Callable[[], None]) -> None:
        self.restarts.append((record.index, target.label))
        if self.on_restart is not None:
            self.on_restart(record, target)
        how = self.script.get((record.index, target.label), "ok")
        fake = self.replicas[record.url]
        fake.serving, fake.tie_flip = None, False
        self.gone.discard(record.index)
        record.pid = 1000 + len(self.restarts)
        saved()
        if how == "restart_fails":
            raise StartFailedError("restart_command_failed", "the fake command exited 1")
        if how in ("ok", "wrong", "ties"):
            self._event(record, outcome="hit", digest=target.key, daemon_digest=target.key, source="daemon")
            if how == "wrong":
                other = next(g for k, g in self.goldens.items() if k != (target.handle or target.key))
                fake.serving = other
            else:
                fake.serving = self.goldens[target.handle or target.key]
                fake.tie_flip = how == "ties"
        elif how == "miss":
            self._event(record, outcome="miss", reason="no daemon for this digest", digest=target.key, source="none")
            self.gone.add(record.index)
        elif how == "exit":
            self.gone.add(record.index)
        elif how == "wrong_event":
            self._event(record, outcome="hit", digest="c" * 64, daemon_digest="c" * 64, source="daemon")
            fake.serving = self.goldens[target.handle or target.key]
        elif how == "no_event":
            fake.serving = self.goldens[target.handle or target.key]

    def alive(self, record: ReplicaRecord) -> bool | None:
        return record.index not in self.gone

    def log_tail(self, record: ReplicaRecord) -> str:
        return "fake log"

    def stop(self, record: ReplicaRecord) -> None:
        self.replicas[record.url].serving = None


@dataclass
class FakeDaemons:
    """In-memory daemons standing in for :mod:`harness.rollout.residency`."""

    sizes: dict[str, int] = field(default_factory=dict)  # by checkpoint path
    live: dict[str, DaemonRecord] = field(default_factory=dict)  # by key
    started: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)

    def install(self, monkeypatch: Any) -> None:
        import harness.rollout.runner as runner

        monkeypatch.setattr(runner, "find_daemon", self.find)
        monkeypatch.setattr(runner, "start_daemon", self.start)
        monkeypatch.setattr(runner, "release_daemon", self.release)
        monkeypatch.setattr(runner, "resident_estimate", lambda path, settings: self.sizes.get(str(path), 100))
        monkeypatch.setattr(runner, "socket_dir_gone", lambda d: d.digest not in self.live)

    base_root: str = ""  # daemons under another root are kept as "digest@root"

    def _name(self, digest: str, root: str) -> str:
        return digest if not self.base_root or root == self.base_root else f"{digest}@{root}"

    def find(self, key: str, root: Any, fits: Any = None, roots: Any = ()) -> DaemonRecord | None:
        for r in (str(root), *map(str, roots)):
            d = self.live.get(self._name(key, r)) if self.base_root else self.live.get(key)
            if d is not None and (fits is None or not fits(getattr(d, "fake_key", {}))):
                return DaemonRecord(**{**d.__dict__, "started_here": False})
        return None

    def start(self, req: Any, timeout_s: float = 0.0) -> DaemonRecord:
        d = DaemonRecord(req.key, req.checkpoint, 5000 + len(self.started), 1, str(req.socket_root), True,
                         self.sizes.get(req.checkpoint, 100))
        name = self._name(req.key, str(req.socket_root))
        self.live[name] = d
        self.started.append(name)
        return d

    def release(self, d: DaemonRecord, timeout_s: float = 0.0) -> bool:
        name = self._name(d.digest, d.socket_root)
        self.live.pop(name, None)
        self.released.append(name)
        return True


DIGEST, BASE, OTHER = "d" * 64, "a" * 64, "e" * 64
D = DIGEST  # the short name the evidence tests use
SETTINGS = DeploymentSettings(dtype="bfloat16", max_model_len=256)


def _engine(tokens: list[list[int]], events: list[dict[str, Any]]) -> dict[str, Any]:
    return {"ok": True, "token_ids": tokens, "texts": [""] * len(tokens),
            "logprobs": [[{str(t): -0.1} for t in p] for p in tokens], "events": events, "timings": {},
            "error": None, "log_tail": "", "returncode": 0, "timed_out": False, "vllm_version": "0.32.0",
            "resolved_dtype": "bfloat16"}


def _case(name: str, digest: str, daemon: str, events: list[dict[str, Any]], tokens: list[list[int]]) -> dict[str, Any]:
    settings = {"dtype": "bfloat16", "tensor_parallel_size": 1, "data_parallel_size": 1, **SETTINGS.to_json()}
    same = daemon == digest
    return {"name": name, "description": "", "expect": "hit" if same else "miss", "weights_equal": same,
            "settings": settings, "status": "PASS", "candidate": "/m/B", "candidate_digest": digest,
            "daemon_digest": daemon, "verdict": {"status": "PASS"}, "not_run_reason": "", "notes": [],
            "key_check": None, "fingerprints": {}, "reference": _engine(tokens, []), "cached": _engine(tokens, events),
            "reference_reused": False}


def write_gate(tmp: Path, digest: str = DIGEST) -> Path:
    """A passing promotion report of ``digest``, with its golden, in ``tmp/gate``."""
    out = tmp / "gate"
    out.mkdir()
    g = golden(1, digest)
    g = replace(g, settings=SETTINGS)
    (out / "golden.json").write_text(json.dumps(g.to_json()))
    tokens = [list(p.token_ids[:3]) for p in g.prompts]  # the auto reference stopped at EOS after 3
    hit = [{"outcome": "hit", "digest": digest, "daemon_digest": digest, "rank": 0, "identity": "content"}]
    miss = [{"outcome": "miss", "reason": "no daemon for this digest", "digest": digest, "rank": 0,
             "fields": ["content_digest"]}]
    report = {"schema_version": 1, "tool": "preload-gate", "mode": "promotion", "target": "verified_cache",
              "candidate": "/m/B", "base": "/m/A", "verdict": "PASS", "exit_code": 0,
              "counts": {"PASS": 2, "BLOCK": 0, "NOT_RUN": 0},
              "controls": {"unsafe_identity": None, "unsafe_silent_fallback": False, "run_tp": False},
              "logprob_tolerance": 1e-3, "vllm_version": vllm_version(), "seconds": 1.0, "error": None,
              "daemon": {"digest": digest, "independent_digest": digest},
              "golden": {"recorded": True, "path": str(out / "golden.json"), "settings": SETTINGS.to_json(),
                         "sha256": hashlib.sha256((out / "golden.json").read_bytes()).hexdigest()},
              "cases": [_case("promotion", digest, digest, hit, tokens), _case("switch_from_base", digest, BASE, miss, tokens)]}
    (out / "report.json").write_text(json.dumps(report))
    return out
