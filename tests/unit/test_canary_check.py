"""Canary check against tiny fake OpenAI servers on loopback (no vLLM).

Each fake is a ThreadingHTTPServer in a daemon thread; slow and dripping
handlers wait on a stop event with a bound, so every server stops by itself
when its test ends. Every failure case asserts two things: the verdict names
the replica and the reason, and it came within the stated time bound.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from canaries.check import check
from canaries.claims import Claim, from_events_file, parse_metrics
from canaries.completion import ReplicaFailure, parse_completion
from canaries.errors import GoldenError, GoldenRefusedError
from canaries.golden import Golden, GoldenPrompt, Sampling
from preload_gate.cli import main as cli_main

pytestmark = pytest.mark.unit

DIGEST = "ab" * 32
OTHER = "cd" * 32
TIMEOUT = 1.0
RETRIES = 1
# What check() promises: (retries + 1) attempts of at most `timeout` each,
# back-offs of 0.5 s x attempt between them (2.5 s here). The bound is ten
# times that, for a loaded 2-core machine; it still tells bounded from
# unbounded because a misbehaving replica here misbehaves until the test ends
# (HANG_S), far past it.
PROMISED_S = (RETRIES + 1) * TIMEOUT + 0.5 * RETRIES
BOUND_S = 10 * PROMISED_S
HANG_S = 300.0


def make_golden() -> Golden:
    prompts = []
    for i in range(3):
        ids = [10 + i, 20 + i, 30 + i, 40 + i]
        lps = [-0.5, -0.25, -1.0, -0.125]
        top = [{str(t): lp, str(t + 1): lp - 2.0} for t, lp in zip(ids, lps, strict=True)]
        prompts.append(GoldenPrompt(f"prompt {i}", [1, 2, 3 + i], ids, "x", lps, top))
    texts = {str(t): f"<{t}>" for p in prompts for t in p.token_ids}
    return Golden(DIGEST, "0.32.0", Sampling(max_tokens=4, top_logprobs=1), prompts, token_texts=texts,
                  config_digest="c" * 64, tokenizer_digest="d" * 64)


def completion_body(golden: Golden, edit: dict[tuple[int, int], int] | None = None) -> dict[str, Any]:
    """The body vLLM's completions endpoint returns with return_tokens_as_token_ids."""
    choices = []
    for i, p in enumerate(golden.prompts):
        ids = [edit.get((i, pos), t) if edit else t for pos, t in enumerate(p.token_ids)]
        top = [{f"token_id:{k}": v for k, v in step.items()} for step in p.top_logprobs]
        for pos, t in enumerate(ids):
            if t != p.token_ids[pos]:
                top[pos] = {f"token_id:{t}": -0.1}
        choices.append({
            "index": i, "text": "x", "finish_reason": "length",
            "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": list(p.token_logprobs),
                         "top_logprobs": top, "text_offset": [0] * len(ids)},
        })
    return {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": choices}


class FakeReplica:
    """An OpenAI-compatible server whose completions endpoint misbehaves on demand.

    ``mode``: ok | wrong | wrong_slow_detokenize | slow | drip | garbage |
    bad_tokens | error500 | version.
    """

    def __init__(self, golden: Golden, mode: str = "ok", log: list[tuple[str, str]] | None = None) -> None:
        self.golden, self.mode = golden, mode
        self.stop = threading.Event()
        self.requests: list[tuple[str, str, Any]] = []
        # (replica url, path) of every request, in arrival order, shared
        # between the replicas of one test: shows who was asked before whom.
        self.log: list[tuple[str, str]] = [] if log is None else log
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                outer.requests.append(("GET", self.path, None))
                outer.log.append((outer.url, self.path))
                if self.path == "/v1/models":
                    self.send_json({"object": "list", "data": [{"id": "tiny", "object": "model"}]})
                elif self.path == "/version":
                    self.send_json({"version": "0.31.0" if outer.mode == "version" else "0.32.0"})
                elif self.path == "/metrics":
                    body = f'preload_gate_rank_up{{socket="s",rank="0",digest="{DIGEST}"}} 1\n'
                    self.send_raw(200, body.encode(), "text/plain")
                else:
                    self.send_raw(404, b"{}", "application/json")

            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(n) or b"null")
                outer.requests.append(("POST", self.path, body))
                outer.log.append((outer.url, self.path))
                if self.path == "/detokenize":
                    if outer.mode == "wrong_slow_detokenize":
                        outer.stop.wait(HANG_S)
                        return
                    self.send_json({"prompt": f"<tok{body['tokens'][0]}>"})
                    return
                mode = outer.mode
                if mode == "slow":
                    outer.stop.wait(HANG_S)  # far beyond the bound; ends when the test does
                    if outer.stop.is_set():
                        return
                if mode == "drip":
                    data = json.dumps(completion_body(outer.golden)).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    for i in range(len(data)):  # one byte every 0.2 s: each read is quick, the whole is not
                        if outer.stop.wait(0.2):
                            return
                        try:
                            self.wfile.write(data[i:i + 1])
                            self.wfile.flush()
                        except OSError:
                            return
                    return
                if mode == "garbage":
                    self.send_raw(200, b"<html>definitely not json", "application/json")
                elif mode == "bad_tokens":
                    bad = completion_body(outer.golden)
                    bad["choices"][0]["logprobs"]["tokens"][0] = "hello"
                    self.send_json(bad)
                elif mode == "error500":
                    self.send_raw(500, b'{"error": "engine dead"}', "application/json")
                elif mode in ("wrong", "wrong_slow_detokenize"):
                    self.send_json(completion_body(outer.golden, edit={(1, 2): 777}))
                else:
                    self.send_json(completion_body(outer.golden))

            def send_json(self, obj: Any) -> None:
                self.send_raw(200, json.dumps(obj).encode(), "application/json")

            def send_raw(self, code: int, data: bytes, ctype: str) -> None:
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def completions(self) -> int:
        return sum(1 for m, p, _ in self.requests if m == "POST" and p == "/v1/completions")


@pytest.fixture
def replicas() -> Iterator[Any]:
    made: list[FakeReplica] = []
    golden = make_golden()
    log: list[tuple[str, str]] = []

    def make(mode: str = "ok") -> FakeReplica:
        r = FakeReplica(golden, mode, log)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def closed_port_url() -> str:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def run_check(urls: list[str], **kw: Any):
    t0 = time.monotonic()
    report = check(urls, make_golden(), timeout=TIMEOUT, retries=RETRIES, **kw)
    return report, time.monotonic() - t0


def test_matching_replica_passes_and_sends_token_ids(replicas) -> None:
    r = replicas("ok")
    report, _ = run_check([r.url])
    assert report.ok, report.results[0].detail
    res = report.results[0]
    assert (res.reason, res.model, res.vllm_version, res.attempts) == ("match", "tiny", "0.32.0", 1)
    (body,) = [b for m, p, b in r.requests if p == "/v1/completions"]
    golden = make_golden()
    assert body["prompt"] == [p.prompt_token_ids for p in golden.prompts]
    assert body["temperature"] == 0.0 and body["max_tokens"] == 4 and body["logprobs"] == 1
    assert body["return_tokens_as_token_ids"] is True and body["ignore_eos"] is True
    assert body["repetition_penalty"] == 1.0 and body["model"] == "tiny"


def test_wrong_replica_fails_naming_prompt_position_and_both_tokens(replicas) -> None:
    r = replicas("wrong")
    report, _ = run_check([r.url])
    assert not report.ok
    res = report.results[0]
    assert res.reason == "token_mismatch" and res.base_url == r.url
    d = res.first_difference
    assert (d["prompt_index"], d["position"], d["expected_id"], d["got_id"]) == (1, 2, 31, 777)
    assert d["expected_text"] == "<31>"  # from the golden's own token texts
    assert d["got_text"] == "<tok777>"  # asked of the replica's /detokenize
    assert "prompt 1" in res.detail and "position 2" in res.detail
    assert res.attempts == 1  # a wrong answer is deterministic: no retry


def test_one_right_one_wrong_at_once(replicas) -> None:
    good, bad = replicas("ok"), replicas("wrong")
    report, _ = run_check([good.url, bad.url])
    assert [r.ok for r in report.results] == [True, False]
    assert [r.base_url for r in report.results] == [good.url, bad.url]
    assert not report.ok


@pytest.mark.parametrize(
    ("mode", "reason", "retried"),
    [
        ("slow", "timeout", True),
        ("drip", "timeout", True),
        ("garbage", "malformed", False),
        ("bad_tokens", "malformed", False),
        ("error500", "http_error", True),
        ("version", "version_mismatch", False),
    ],
)
def test_misbehaving_replica_is_a_clear_bounded_failure(replicas, mode, reason, retried) -> None:
    r = replicas(mode)
    report, elapsed = run_check([r.url])
    res = report.results[0]
    assert not report.ok and not res.ok
    assert res.reason == reason, res.detail
    assert res.base_url == r.url and res.line().startswith(f"FAIL {r.url}")
    assert elapsed < BOUND_S, f"{mode}: took {elapsed:.1f} s, bound {BOUND_S:.1f} s"
    assert res.attempts == (RETRIES + 1 if retried else 1)


def test_down_replica_is_unreachable_within_bound() -> None:
    url = closed_port_url()
    report, elapsed = run_check([url])
    res = report.results[0]
    assert (res.ok, res.reason, res.base_url, res.attempts) == (False, "unreachable", url, RETRIES + 1)
    assert elapsed < BOUND_S


def test_healthy_replica_is_not_delayed_past_bound_by_a_slow_one(replicas) -> None:
    slow, good = replicas("slow"), replicas("ok")
    report, elapsed = run_check([slow.url, good.url])
    assert [r.reason for r in report.results] == ["timeout", "match"]
    # Asked concurrently, not after the slow one: the healthy replica got its
    # completion request before the slow one got its retry (one after the other,
    # it would come after every attempt on the slow replica).
    posts = [url for url, path in slow.log if path == "/v1/completions"]
    assert posts.count(slow.url) == RETRIES + 1, posts
    assert posts.index(good.url) < [i for i, u in enumerate(posts) if u == slow.url][1], posts
    assert elapsed < BOUND_S


def test_golden_refused_when_expected_digest_differs(replicas) -> None:
    r = replicas("ok")
    with pytest.raises(GoldenRefusedError, match=f"{r.url}.*{OTHER[:16]}"):
        run_check([r.url], expect_digest=OTHER)
    assert r.requests == []  # refused before asking anything
    # Control: the right digest is accepted and the claim is reported.
    report, _ = run_check([r.url], expect_digest=DIGEST)
    assert report.ok and report.results[0].claim == {"digest": DIGEST, "source": "--expect-digest"}


def test_golden_refused_for_one_replica_claim(replicas) -> None:
    a, b = replicas("ok"), replicas("ok")
    claims = {a.url: Claim(DIGEST, "events a"), b.url: Claim(OTHER, "events b")}
    with pytest.raises(GoldenRefusedError, match=f"{b.url}.*events b"):
        run_check([a.url, b.url], claims=claims)


def test_empty_replica_list_is_an_error_not_a_pass() -> None:
    with pytest.raises(ValueError):
        check([], make_golden())


def _event(outcome: str, digest: str = OTHER, daemon: str = DIGEST) -> str:
    return json.dumps({"outcome": outcome, "reason": "r", "digest": digest, "daemon_digest": daemon}) + "\n"


def test_claim_from_events_file(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    p.write_text(_event("miss") + _event("hit"))
    assert from_events_file(p).digest == DIGEST  # last event, a hit: the daemon's content
    p.write_text(_event("hit") + _event("miss"))
    assert from_events_file(p).digest == OTHER  # last event, a miss: the disk's content
    for text, msg in ((_event("error"), "serves nothing"), ("", "no load event"), ("{x\n", "not JSON"),
                      (_event("hit") + "[1]\n", "not a JSON object"), (b"\xff\n", "not UTF-8"),
                      (_event("hit", daemon="zz"), "daemon_digest 'zz' is not a SHA-256 digest"),
                      (_event("hit", daemon=""), "has no daemon_digest")):
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(GoldenError, match=msg):
            from_events_file(p)
    with pytest.raises(GoldenError, match="cannot read events file"):
        from_events_file(tmp_path / "absent.jsonl")  # named by the operator: absent is not "no events"


def test_claim_from_metrics() -> None:
    up = f'preload_gate_rank_up{{socket="/s/rank0.sock",rank="0",digest="{DIGEST}"}} 1\n'
    down = 'preload_gate_rank_up{socket="/s/rank1.sock"} 0\n'
    assert parse_metrics("# HELP x\n" + up + down, "m").digest == DIGEST
    with pytest.raises(GoldenError, match="no serving rank"):
        parse_metrics(down, "m")
    other = up.replace(DIGEST, OTHER).replace("rank0", "rank1").replace('"0"', '"1"')
    with pytest.raises(GoldenError, match="different digests"):
        parse_metrics(up + other, "m")
    # A malformed line is an error, not a line to skip (the same text well formed passes above).
    with pytest.raises(GoldenError, match="not Prometheus text exposition"):
        parse_metrics(up + down.replace("} 0", "} zero"), "m")
    with pytest.raises(GoldenError, match="not Prometheus text exposition"):
        parse_metrics("<html>not metrics</html>\n", "m")


def test_parse_completion_rejects_wrong_shapes() -> None:
    golden = make_golden()
    good = completion_body(golden)
    assert [a.token_ids for a in parse_completion(good, 3)] == [p.token_ids for p in golden.prompts]
    with pytest.raises(ReplicaFailure, match="3 prompts"):
        parse_completion({"choices": good["choices"][:2]}, 3)
    dup = json.loads(json.dumps(good))
    dup["choices"][1]["index"] = 0
    with pytest.raises(ReplicaFailure, match="repeated index"):
        parse_completion(dup, 3)
    bad_lp = json.loads(json.dumps(good))
    bad_lp["choices"][0]["logprobs"]["top_logprobs"][0] = {"token_id:10": "high"}
    with pytest.raises(ReplicaFailure, match="not a number"):
        parse_completion(bad_lp, 3)


def _write_golden(tmp_path: Path) -> str:
    p = tmp_path / "golden.json"
    p.write_text(json.dumps(make_golden().to_json()))
    return str(p)


def test_unkeyed_golden_never_blames_the_weights(replicas, tmp_path: Path, capsys) -> None:
    """r02: a golden with no config digest passes a replica that answers as it
    recorded, and where answers differ the check cannot judge (exit 2, one line
    naming the missing key), never a weights failure (exit 1)."""
    good, bad = replicas("ok"), replicas("wrong")
    keyed = tmp_path / "keyed.json"
    keyed.write_text(json.dumps(make_golden().to_json()))
    unkeyed = tmp_path / "unkeyed.json"
    doc = make_golden().to_json()
    doc["config_digest"] = None
    unkeyed.write_text(json.dumps(doc))
    base = ["canary", "check", "--timeout", str(TIMEOUT), "--retries", "0"]
    assert cli_main(base + ["--base-url", good.url, "--golden", str(unkeyed)]) == 0
    capsys.readouterr()
    assert cli_main(base + ["--base-url", bad.url, "--golden", str(unkeyed)]) == 2
    got = capsys.readouterr()
    err = [ln for ln in got.err.strip().splitlines() if "config_digest" in ln]
    assert len(err) == 1 and "cannot judge" in err[0] and "canary record" in err[0]
    # The replica's own line says so too: its verdict is CANNOT-JUDGE, never
    # FAIL printed beside "cannot judge" (new-user F12).
    (line,) = [ln for ln in got.out.splitlines() if bad.url in ln]
    assert line.startswith("CANNOT-JUDGE ") and "FAIL" not in got.out and "PASS" not in got.out
    assert cli_main(base + ["--base-url", bad.url, "--golden", str(unkeyed), "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["judged"] is False and doc["ok"] is False
    assert [(r["verdict"], r["reason"]) for r in doc["replicas"]] == [("CANNOT-JUDGE", "cannot_judge")]
    # Control: the keyed golden against the same wrong replica is a real failure.
    assert cli_main(base + ["--base-url", bad.url, "--golden", str(keyed)]) == 1
    out = capsys.readouterr().out
    assert any(ln.startswith("FAIL ") and bad.url in ln for ln in out.splitlines()) and "CANNOT-JUDGE" not in out
    # Failures that are not differing answers are failures whatever the golden
    # records (r06: a router's own /version; a replica nobody answers for):
    # exit 1 with the replica's reason, never "cannot judge ... answers differ".
    capsys.readouterr()
    old_vllm = replicas("version")
    assert cli_main(base + ["--base-url", old_vllm.url, "--golden", str(unkeyed)]) == 1
    assert "cannot judge" not in capsys.readouterr().err
    assert cli_main(base + ["--base-url", "http://127.0.0.1:9", "--golden", str(unkeyed)]) == 1
    assert "cannot judge" not in capsys.readouterr().err


def test_cli_exit_codes(replicas, tmp_path: Path, capsys) -> None:
    golden = _write_golden(tmp_path)
    good, bad = replicas("ok"), replicas("wrong")
    base = ["canary", "check", "--golden", golden, "--timeout", str(TIMEOUT), "--retries", "0"]
    assert cli_main(base + ["--base-url", good.url]) == 0
    got = capsys.readouterr()
    assert f"PASS {good.url}" in got.out
    # A pass without --checkpoint says what it did not compare (an edited chat template passes tokens).
    assert "passed on tokens alone" in got.err and "chat template" in got.err and "--checkpoint DIR" in got.err
    assert cli_main(base + ["--base-url", good.url, "--base-url", bad.url, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and [r["ok"] for r in out["replicas"]] == [True, False]
    assert out["replicas"][1]["first_difference"]["got_id"] == 777
    # Refusal via the daemon's /metrics (the fake serves DIGEST there): accepted...
    assert cli_main(base + ["--base-url", good.url, "--metrics-url", good.url + "/metrics"]) == 0
    capsys.readouterr()
    # ...and refused when the operator expects other content: exit 2, one line.
    assert cli_main(base + ["--base-url", good.url, "--expect-digest", OTHER]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refusing golden" in err[0]
    events = tmp_path / "events.jsonl"
    events.write_text(_event("hit", daemon=OTHER))
    assert cli_main(base + ["--base-url", good.url, "--events-file", str(events)]) == 2
    assert "load event (hit)" in capsys.readouterr().err
    assert cli_main(base + ["--base-url", good.url, "--base-url", bad.url,
                            "--events-file", str(events), "--events-file", str(events),
                            "--events-file", str(events)]) == 2
    assert "one per --base-url" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text("[]")
    assert cli_main(["canary", "check", "--golden", str(tmp_path / "broken.json"), "--base-url", good.url]) == 2
    assert "not a golden record" in capsys.readouterr().err


def test_control_client_timeout_alone_does_not_bound_a_dripping_server(replicas) -> None:
    """Why check() wraps each attempt in asyncio.wait_for: the openai client's
    own timeout (1 s here) bounds each socket read, and a server that drips a
    byte every 0.2 s never trips it. Without the outer deadline the drip case
    above would take minutes instead of failing within the bound."""
    import asyncio

    from openai import AsyncOpenAI

    r = replicas("drip")

    async def plain() -> None:
        client = AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        try:
            await client.completions.create(model="tiny", prompt=[1, 2], max_tokens=4)
        finally:
            await client.close()

    async def bounded() -> str:
        try:
            await asyncio.wait_for(plain(), timeout=4 * TIMEOUT)
        except asyncio.TimeoutError:
            return "still reading after 4x the client timeout"
        return "finished"

    assert asyncio.run(bounded()) == "still reading after 4x the client timeout"


def test_token_verdict_survives_a_replica_that_hangs_on_detokenize(replicas) -> None:
    """Naming tokens in words is best effort under its own deadline; the
    verdict (token_mismatch, with ids) never turns into a timeout."""
    r = replicas("wrong_slow_detokenize")
    report, elapsed = run_check([r.url])
    res = report.results[0]
    assert res.reason == "token_mismatch" and res.attempts == 1
    assert res.first_difference["got_id"] == 777 and res.first_difference["got_text"] == "<id 777>"
    assert res.first_difference["expected_text"] == "<31>"
    assert elapsed < BOUND_S  # the detokenize hangs for HANG_S


@pytest.mark.parametrize(("url", "reason", "cause"), [
    # The URL the CLI refuses (http_url), asked through the API: anyio's connect
    # raises an ExceptionGroup around the OverflowError, past the client's mapping.
    ("http://127.0.0.1:99999", "error", "OverflowError: connect(): port must be 0-65535"),
])
def test_an_exception_group_from_the_client_is_named_by_its_cause(url, reason, cause) -> None:
    report, elapsed = run_check([url])
    res = report.results[0]
    assert (res.ok, res.reason) == (False, reason), res.detail
    assert cause in res.detail and "ExceptionGroup" not in res.detail and "TaskGroup" not in res.detail, res.detail
    assert elapsed < BOUND_S


def test_surprise_unwraps_nested_groups_and_a_connection_error_is_unreachable() -> None:
    import builtins

    from canaries.replica import _surprise

    # A builtin from Python 3.11; before it, the backport anyio raises.
    group = getattr(builtins, "ExceptionGroup", None) or pytest.importorskip("exceptiongroup").ExceptionGroup
    nested = group("outer", [group("inner", [ConnectionRefusedError(111, "refused")])])
    f = _surprise(nested)
    assert (f.reason, f.retryable) == ("unreachable", True) and "ConnectionRefusedError" in str(f), str(f)
    # Control: a plain surprise keeps its own name.
    assert str(_surprise(KeyError("x"))) == "KeyError: 'x'"
