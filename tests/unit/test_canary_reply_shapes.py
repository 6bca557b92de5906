"""Every partial or malformed completion reply has a named reason, never drift.

One loopback server answers each row's reply body in turn (vLLM's completions
shape with ``return_tokens_as_token_ids``, edited by the row); ``check`` asks
it as it asks a real replica. A reply that lacks logprobs or was cut short
is CANNOT-JUDGE with its reason (``no_logprobs``, ``short_answer``), a reply
without the answers at all is a FAIL of its own (``no_choices``), and each
such row has a neighbour whose reply is complete and differs (or matches),
so the reason comes from the reply's shape and not from what it says. The
last test holds that every reply-shape reason has a row.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from canaries.check import check
from canaries.golden import Golden, GoldenPrompt, Sampling
from preload_gate.cli import main as cli_main

pytestmark = pytest.mark.unit

DIGEST = "ab" * 32
TOP_K = 2


def golden() -> Golden:
    prompts = []
    for i in range(2):
        ids = [10 + i, 20 + i, 30 + i, 40 + i]
        lps = [-0.5, -0.25, -1.0, -0.125]
        # 90+i sits 1e-3 nats under the choice at position 2: a near-tie pair.
        top = [{str(t): lp, str(t + 1): lp - 2.0} for t, lp in zip(ids, lps, strict=True)]
        top[2] = {str(ids[2]): -1.0, str(90 + i): -1.001}
        prompts.append(GoldenPrompt(f"prompt {i}", [1, 2, 3 + i], ids, "x", lps, top))
    return Golden(DIGEST, "0.32.0", Sampling(max_tokens=4, top_logprobs=TOP_K), prompts,
                  config_digest="c" * 64, tokenizer_digest="d" * 64)


def full_reply(g: Golden) -> dict[str, Any]:
    """What vLLM 0.32's completions endpoint sends for the golden's own answers."""
    choices = []
    for i, p in enumerate(g.prompts):
        choices.append({
            "index": i, "text": "x", "finish_reason": "length",
            "logprobs": {"tokens": [f"token_id:{t}" for t in p.token_ids],
                         "token_logprobs": list(p.token_logprobs),
                         "top_logprobs": [{f"token_id:{k}": v for k, v in s.items()} for s in p.top_logprobs],
                         "text_offset": [0] * len(p.token_ids)},
        })
    return {"id": "cmpl-1", "object": "text_completion", "model": "tiny", "choices": choices}


def lp(body: dict[str, Any], i: int = 1) -> dict[str, Any]:
    return body["choices"][i]["logprobs"]


def _null_step(b: dict[str, Any]) -> None:
    # vLLM's own shape for a position it has no logprobs for (serving.py
    # _create_completion_logprobs: token_logprob None, top_logprobs None).
    lp(b)["token_logprobs"][1] = None
    lp(b)["top_logprobs"][1] = None


def _cut(b: dict[str, Any], finish: str | None) -> None:
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        del lp(b)[key][2:]
    if finish is None:
        del b["choices"][1]["finish_reason"]
    else:
        b["choices"][1]["finish_reason"] = finish


def _swap(b: dict[str, Any], token: int, logprob: float | None) -> None:
    lp(b)["tokens"][2] = f"token_id:{token}"
    lp(b)["token_logprobs"][2] = logprob
    lp(b)["top_logprobs"][2] = None if logprob is None else {f"token_id:{token}": logprob, "token_id:31": -1.001}


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(b: dict[str, Any]) -> None:
        node: Any = b
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    return edit


def _delete(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def edit(b: dict[str, Any]) -> None:
        node: Any = b
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]
    return edit


L1 = ("choices", 1, "logprobs")
# (name, edit of the full reply, reason, verdict, words the replica's line must hold)
ROWS: list[tuple[str, Callable[[dict[str, Any]], None], str, str, str]] = [
    ("complete reply", lambda b: None, "match", "PASS", "match"),
    ("vLLM's null step: token and top logprobs null", _null_step, "no_logprobs", "CANNOT-JUDGE",
     "no logprobs for prompt 1 at position 1 (token_logprobs[1] is null"),
    ("top_logprobs: [null] at one position", _set(L1 + ("top_logprobs", 0), None), "no_logprobs",
     "CANNOT-JUDGE", "top_logprobs[0] is null"),
    ("top_logprobs entry empty", _set(L1 + ("top_logprobs", 3), {}), "no_logprobs", "CANNOT-JUDGE",
     "top_logprobs[3] is empty"),
    ("top_logprobs list empty", _set(L1 + ("top_logprobs",), []), "no_logprobs", "CANNOT-JUDGE",
     "top_logprobs[0] is null or missing"),
    ("top_logprobs absent", _delete(L1 + ("top_logprobs",)), "no_logprobs", "CANNOT-JUDGE",
     "top_logprobs[0] is null or missing"),
    ("fewer top logprobs than asked", _set(L1 + ("top_logprobs", 1), {"token_id:21": -0.25}), "no_logprobs",
     "CANNOT-JUDGE", f"top_logprobs[1] has 1 of the {TOP_K} asked"),
    ("token_logprobs all null", _set(L1 + ("token_logprobs",), [None] * 4), "no_logprobs", "CANNOT-JUDGE",
     "token_logprobs[0] is null"),
    ("choice logprobs null", _set(("choices", 1, "logprobs"), None), "no_logprobs", "CANNOT-JUDGE",
     "choice 1: the server returned no logprobs ('logprobs' is null)"),
    ("near-tie swap without the replica's logprob", lambda b: _swap(b, 91, None), "no_logprobs",
     "CANNOT-JUDGE", "token_logprobs[2] is null where the tokens swap"),
    ("cut short at max_tokens' place (finish_reason length)", lambda b: _cut(b, "length"), "short_answer",
     "CANNOT-JUDGE", "cut the answer to prompt 1 at position 2 (2 tokens where the golden has 4"),
    ("cut short, no finish_reason", lambda b: _cut(b, None), "short_answer", "CANNOT-JUDGE",
     "finish_reason None"),
    ("no choices (an error object with 200)", lambda b: b.clear() or b.update(error={"message": "x"}),
     "no_choices", "FAIL", "no 'choices' list (it has: error)"),
    ("one choice for two prompts", lambda b: b["choices"].pop(), "no_choices", "FAIL", "1 choices for 2 prompts"),
    ("a token that is not an id", _set(L1 + ("tokens", 0), "hello"), "malformed", "FAIL", "is not 'token_id:N'"),
    # Neighbours: complete replies that differ, and a difference beside a gap.
    ("the model ended early (finish_reason stop)", lambda b: _cut(b, "stop"), "token_mismatch", "FAIL",
     "token mismatch in prompt 1"),
    ("near-tie swap with the replica's logprob", lambda b: _swap(b, 91, -1.0005), "near_tie", "NEAR-TIE",
     "near-tie"),
    ("a token the golden never ranked, logprobs null", lambda b: (_null_step(b), _swap(b, 777, None)),
     "token_mismatch", "FAIL", "token mismatch in prompt 1 ('prompt 1') at position 2: expected 31"),
    ("drift beside a null step", lambda b: (_null_step(b), _set(L1 + ("token_logprobs", 3), -3.0)(b)),
     "logprob_drift", "FAIL", "logprob drift in prompt 1"),
    ("drift in another prompt than the gap", lambda b: (_null_step(b), _set(("choices", 0, "logprobs",
     "token_logprobs", 0), -3.0)(b)), "logprob_drift", "FAIL", "logprob drift in prompt 0"),
]


class Server:
    """One loopback replica; ``reply`` is the completions body it sends next."""

    def __init__(self) -> None:
        self.reply: dict[str, Any] = {}
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/v1/models":
                    self.send({"object": "list", "data": [{"id": "tiny", "object": "model"}]})
                elif self.path == "/version":
                    self.send({"version": "0.32.0"})
                else:
                    self.send({"error": "not found"}, 404)

            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(n) or b"{}")
                if self.path == "/detokenize":
                    return self.send({"prompt": f"<{body['tokens'][0]}>"})
                self.send(outer.reply)

            def send(self, obj: Any, code: int = 200) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def serve(self, edit: Callable[[dict[str, Any]], None]) -> None:
        body = copy.deepcopy(full_reply(golden()))
        edit(body)
        self.reply = body


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


@pytest.mark.parametrize(("name", "edit", "reason", "verdict", "words"), ROWS, ids=[r[0] for r in ROWS])
def test_reply_shape_table(server: Server, name: str, edit: Callable[[dict[str, Any]], None], reason: str,
                           verdict: str, words: str) -> None:
    server.serve(edit)
    report = check([server.url], golden(), timeout=5.0, retries=0)
    (r,) = report.results
    assert (r.reason, r.verdict) == (reason, verdict), (name, r.detail)
    assert words in r.detail, (name, r.detail)
    assert report.judged is (verdict != "CANNOT-JUDGE")
    if reason == "no_logprobs":  # what to enable, on every such line
        assert "must return them for every token" in r.detail and "--max-logprobs" in r.detail


def test_every_reply_shape_reason_has_a_row() -> None:
    from canaries.compare import GAP_KINDS
    from canaries.replica import UNJUDGED

    reasons = {row[2] for row in ROWS}
    assert set(GAP_KINDS) | {"no_choices", "malformed"} <= reasons
    assert UNJUDGED - {"cannot_judge"} <= reasons
    # Each CANNOT-JUDGE reason has a neighbour of the same answers judged.
    assert {"match", "token_mismatch", "logprob_drift", "near_tie"} <= reasons


def test_cli_unjudged_reply_is_exit_2_naming_the_replica_and_the_fix(server: Server, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "golden.json"
    path.write_text(json.dumps(golden().to_json()))
    args = ["canary", "check", "--golden", str(path), "--base-url", server.url, "--timeout", "5", "--retries", "0"]
    server.serve(_null_step)
    assert cli_main(args) == 2
    out, err = capsys.readouterr()
    assert f"CANNOT-JUDGE {server.url}: not judged: the server returned no logprobs" in out
    (line,) = err.strip().splitlines()
    assert f"error: cannot judge {server.url}: the server returned no logprobs" in line
    assert "--max-logprobs" in line and "config_digest" not in line
    assert "drift" not in out + err
    # Control: the complete reply from the same server passes.
    server.serve(lambda b: None)
    assert cli_main(args) == 0
    assert f"PASS {server.url}" in capsys.readouterr().out
