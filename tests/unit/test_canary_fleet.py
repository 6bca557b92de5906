"""Canaries as a fleet meets them (field cases r02, r05, r06, r12), on fake
OpenAI servers on loopback (no vLLM):

- near-ties: a swap of two tokens the golden recorded within the tolerance
  is a distinct ``near_tie`` outcome; a real change still fails;
- gateways: a path prefix with a key, a router answering ``/version``
  itself, an HTML front, a gateway that guards everything outside ``/v1``,
  a LoRA server listing adapters beside its base;
- a golden recorded under other settings, config.json or tokenizer than
  the replica serves is refused by name, exit 2, before any request.

Each behaviour has its control: the same replica or golden with the one
thing changed that the behaviour is about, which must then fail.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from canaries.check import check
from canaries.compare import Answer, compare_answer
from canaries.golden import Golden, GoldenPrompt, Sampling
from preload.deployment import DeploymentSettings, answer_identity, parse_engine_args
from preload_gate.cli import main as cli_main

pytestmark = pytest.mark.unit

DIGEST = "ab" * 32
KEY = "sk-test"


def tie_golden(settings: DeploymentSettings | None = None, **identity: Any) -> Golden:
    """r05's golden: at prompt 0 position 1 the two best tokens are 1e-4 nats apart."""
    p0 = GoldenPrompt("p0", [1, 2, 3], [5, 10, 20, 21], "", [-0.1, -0.69310, -0.2, -0.3],
                      [{"5": -0.1, "6": -2.4}, {"10": -0.69310, "11": -0.69320},
                       {"20": -0.2, "22": -1.8}, {"21": -0.3, "23": -1.5}])
    p1 = GoldenPrompt("p1", [4, 5], [7, 8, 9, 7], "", [-0.05, -0.4, -0.3, -0.2],
                      [{"7": -0.05, "9": -3.1}, {"8": -0.4, "3": -1.2}, {"9": -0.3, "2": -1.4},
                       {"7": -0.2, "1": -1.9}])
    return Golden(DIGEST, "0.32.0", Sampling(max_tokens=4, top_logprobs=2), [p0, p1], settings=settings,
                  engine={"load_format": "auto", "dtype": "bfloat16", "resolved_dtype": "bfloat16"},
                  config_digest=identity.get("config_digest", "c" * 64),
                  answer_files=identity.get("answer_files"), tokenizer_digest=identity.get("tokenizer_digest"))


def same(g: Golden) -> list[Answer]:
    return [Answer(list(p.token_ids), list(p.token_logprobs),
                   [{int(k): v for k, v in s.items()} for s in p.top_logprobs]) for p in g.prompts]


def tieflip() -> Answer:
    """Numeric noise of 2e-5 nats swaps the tied pair; the continuation then differs."""
    return Answer([5, 11, 30, 31], [-0.1, -0.69312, -0.25, -0.4],
                  [{5: -0.1, 6: -2.4}, {11: -0.69312, 10: -0.69318}, {30: -0.25, 31: -1.7}, {31: -0.4, 33: -1.2}])


def realflip() -> Answer:
    """A token the golden ranked 2.3 nats below its choice: a real change."""
    return Answer([6, 40, 41, 42], [-0.09, -0.3, -0.3, -0.3],
                  [{6: -0.09, 5: -2.5}, {40: -0.3, 41: -1.5}, {41: -0.3, 42: -1.5}, {42: -0.3, 40: -1.5}])


# ------------------------------------------------------------------ near-ties (pure)

@pytest.mark.parametrize(("name", "answer", "tolerance", "tie", "reason"), [
    ("same", None, 0.05, False, None),
    ("tie flip within tolerance", tieflip(), 0.05, True, None),
    # controls: the same flip is a mismatch when the tolerance is below the golden's gap...
    ("tie flip, tolerance below the gap", tieflip(), 5e-5, False, "token"),
    # ...and a token the golden ranked far below is a mismatch at any sane tolerance.
    ("real flip", realflip(), 0.05, False, "token"),
    # the tied token at a very different probability is not noise: a mismatch.
    ("tie token at another probability", Answer([5, 11, 30, 31], [-0.1, -0.9, -0.25, -0.4],
                                                tieflip().top_logprobs), 0.05, False, "token"),
    # drift before the tie still fails as drift.
    ("drift before the tie", Answer([5, 11, 30, 31], [-0.3, -0.69312, -0.25, -0.4],
                                    tieflip().top_logprobs), 0.05, False, "logprob"),
])
def test_near_tie_table(name: str, answer: Answer | None, tolerance: float, tie: bool, reason: str | None) -> None:
    g = tie_golden()
    a = answer or same(g)[0]
    c = compare_answer(g.prompts[0], 0, a, tolerance)
    assert bool(c.near_ties) is tie, name
    if reason is None:
        assert c.ok, (name, c.difference)
    else:
        assert not c.ok and c.difference is not None and c.difference.kind == reason, (name, c)


def test_near_tie_needs_the_token_in_the_goldens_top_logprobs() -> None:
    """A golden that did not record the replica's token cannot call it a tie."""
    g = tie_golden()
    p = g.prompts[0]
    narrow = GoldenPrompt(p.prompt, p.prompt_token_ids, p.token_ids, p.text, p.token_logprobs,
                          [{k: v for k, v in s.items() if k != "11"} for s in p.top_logprobs])
    c = compare_answer(narrow, 0, tieflip(), 0.05)
    assert not c.ok and c.difference is not None and c.difference.kind == "token"


# ------------------------------------------------------------------ fake servers

class Fake:
    """An HTTP server in a thread; ``route(handler, method, path)`` answers."""

    def __init__(self, route: Callable[[Any, str, str], None]) -> None:
        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def send(self, code: int, obj: Any, ctype: str = "application/json") -> None:
                data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                route(self, "GET", self.path.split("?")[0])

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                route(self, "POST", self.path.split("?")[0])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def body(answers: list[Answer]) -> dict[str, Any]:
    return {"id": "c", "object": "text_completion", "model": "m", "choices": [
        {"index": i, "text": "", "finish_reason": "length", "logprobs": {
            "tokens": [f"token_id:{t}" for t in a.token_ids], "token_logprobs": a.token_logprobs,
            "top_logprobs": [{f"token_id:{k}": v for k, v in s.items()} for s in a.top_logprobs],
            "text_offset": [0] * len(a.token_ids)}} for i, a in enumerate(answers)]}


def models(*ids: str, parent: str | None = None) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": i, "object": "model", "parent": parent if n else None}
                                       for n, i in enumerate(ids)]}


def vllm_like(answers: list[Answer], kind: str = "plain") -> Callable[[Any, str, str], None]:
    def route(h: Any, method: str, path: str) -> None:
        if kind == "prefix_key":
            if h.headers.get("Authorization") != f"Bearer {KEY}":
                return h.send(401, {"error": "missing key"})
            if not path.startswith("/llm/"):
                return h.send(404, {"error": "not found"})
            path = path[len("/llm"):]
        if kind == "version401" and not path.startswith("/v1/"):
            return h.send(401, {"error": "login required"})
        if path == "/version":
            if kind == "router":
                return h.send(200, {"version": "0.1.9"})
            if kind == "spa":
                return h.send(200, b"<!doctype html><html>app</html>", "text/html")
            return h.send(200, {"version": "0.32.0"})
        if path == "/v1/models":
            if kind == "lora":
                return h.send(200, models("base", "sql-adapter", "chat-adapter", parent="base"))
            if kind == "two":
                return h.send(200, models("a", "b"))
            return h.send(200, models("base"))
        if path == "/v1/completions" and method == "POST":
            return h.send(200, body(answers))
        return h.send(404, {"error": "not found"})
    return route


@pytest.fixture
def fakes() -> Iterator[Callable[..., Fake]]:
    made: list[Fake] = []

    def make(answers: list[Answer], kind: str = "plain") -> Fake:
        made.append(Fake(vllm_like(answers, kind)))
        return made[-1]
    yield make
    for f in made:
        f.close()


def write(tmp_path: Path, g: Golden) -> Path:
    p = tmp_path / "golden.json"
    p.write_text(json.dumps(g.to_json()))
    return p


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli_main(["canary", "check", "--timeout", "5", "--retries", "0", *args])
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------ near-ties over HTTP (r05)

def test_near_tie_replica_is_reported_apart_and_real_flip_fails(tmp_path, fakes, capsys) -> None:
    g = tie_golden()
    golden = write(tmp_path, g)
    tie = fakes([tieflip(), same(g)[1]])
    rc, out, _ = cli(capsys, "--base-url", tie.url, "--golden", str(golden), "--json")
    res = json.loads(out)["replicas"][0]
    assert rc == 0 and res["reason"] == "near_tie" and res["ok"] is True
    assert res["near_ties"] == [{"prompt_index": 0, "position": 1, "expected_id": 10, "got_id": 11,
                                 "gap": pytest.approx(1e-4), "recorded": False}]  # a float32 golden: not a recorded tie
    # control: the real change fails, in the words of a token mismatch
    real = fakes([realflip(), same(g)[1]])
    rc, out, _ = cli(capsys, "--base-url", real.url, "--golden", str(golden))
    assert rc == 1 and out.startswith(f"FAIL {real.url}: token mismatch in prompt 0") and "position 0" in out
    # control: the tie replica under a tolerance below the gap is a mismatch again
    rc, out, _ = cli(capsys, "--base-url", tie.url, "--golden", str(golden), "--tolerance", "0.00005")
    assert rc == 1 and "token mismatch in prompt 0" in out and "position 1" in out
    # the rest of the prompt after the tie is not compared, but other prompts are: a change there fails
    broken = same(g)[1]
    other = fakes([tieflip(), Answer([7, 3, 9, 7], broken.token_logprobs, broken.top_logprobs)])
    rc, out, _ = cli(capsys, "--base-url", other.url, "--golden", str(golden))
    assert rc == 1 and "prompt 1" in out


# ------------------------------------------------------------------ gateways (r06)

@pytest.mark.parametrize(("kind", "suffix", "extra"), [
    ("prefix_key", "/llm", ["--api-key", KEY]),
    ("router", "", ["--no-version-probe"]),
    ("spa", "", []),
    ("version401", "", []),
    ("lora", "", []),
    ("lora", "", ["--model", "base"]),
])
def test_correct_replica_behind_a_gateway_passes(tmp_path, fakes, capsys, kind, suffix, extra) -> None:
    g = tie_golden()
    f = fakes(same(g), kind)
    rc, out, err = cli(capsys, "--base-url", f.url + suffix, "--golden", str(write(tmp_path, g)), "--json", *extra)
    res = json.loads(out)["replicas"][0]
    assert rc == 0 and res["reason"] == "match", (res, err)
    assert res["model"] == "base"
    if kind in ("router", "spa", "version401"):
        assert res["vllm_version"] is None and res["version_source"] != "probe"


@pytest.mark.parametrize(("kind", "suffix", "extra", "reason"), [
    ("prefix_key", "/llm", [], "http_error"),           # no key: the gateway says 401
    ("prefix_key", "", ["--api-key", KEY], "http_error"),  # no prefix: 404 on /v1/models
    ("router", "", [], "version_mismatch"),             # the router's own /version, probed
    ("two", "", [], "no_model"),                         # two unrelated models: name one
])
def test_gateway_controls_fail_naming_why(tmp_path, fakes, capsys, kind, suffix, extra, reason) -> None:
    g = tie_golden()
    f = fakes(same(g), kind)
    rc, out, _ = cli(capsys, "--base-url", f.url + suffix, "--golden", str(write(tmp_path, g)), "--json", *extra)
    res = json.loads(out)["replicas"][0]
    assert rc == 1 and res["reason"] == reason, res
    if reason == "version_mismatch":
        assert "--no-version-probe" in res["detail"]


def test_version_from_the_completion_response_when_not_probed(tmp_path, capsys) -> None:
    g = tie_golden()
    for fp, code in (("vllm-0.32.0", 0), ("vllm-0.31.0", 1)):
        answer = body(same(g))
        answer["system_fingerprint"] = fp

        def route(h: Any, method: str, path: str, answer: dict[str, Any] = answer) -> None:
            if path == "/v1/models":
                return h.send(200, models("base"))
            if path == "/v1/completions":
                return h.send(200, answer)
            return h.send(404, {})
        f = Fake(route)
        try:
            rc, out, _ = cli(capsys, "--base-url", f.url, "--golden", str(write(tmp_path, g)), "--json",
                             "--no-version-probe")
        finally:
            f.close()
        res = json.loads(out)["replicas"][0]
        assert rc == code and res["vllm_version"] == fp.removeprefix("vllm-"), res
        assert res["version_source"] == "the completion response"


# ------------------------------------------------------------------ settings, config, tokenizer (r12, r02)

def test_golden_under_other_settings_is_refused_by_name(tmp_path, fakes, capsys) -> None:
    g = tie_golden(settings=DeploymentSettings(dtype="bfloat16", max_model_len=256))
    f = fakes(same(g))
    golden = str(write(tmp_path, g))
    rc, out, err = cli(capsys, "--base-url", f.url, "--golden", golden, "--dtype", "float16")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and out == "" and len(lines) == 1
    assert "dtype=bfloat16" in lines[0] and "dtype=float16" in lines[0] and "refusing golden" in lines[0]
    rc, _, err = cli(capsys, "--base-url", f.url, "--golden", golden, "-tp", "2")
    assert rc == 2 and "tensor_parallel_size=1" in err and "tensor_parallel_size=2" in err
    rc, _, err = cli(capsys, "--base-url", f.url, "--golden", golden, "--kv-cache-dtype", "fp8")
    assert rc == 2 and "kv_cache_dtype" in err
    # control: the settings it was recorded under (vLLM's alias too) pass to the replica
    for flags in (["--dtype", "bfloat16"], ["--dtype", "bfloat16", "--max-model-len", "256", "-tp", "1"], []):
        rc, out, err = cli(capsys, "--base-url", f.url, "--golden", golden, *flags)
        assert rc == 0 and out.startswith(f"PASS {f.url}"), (flags, err)


def test_golden_dtype_auto_is_compared_by_what_it_resolved_to(tmp_path, fakes, capsys) -> None:
    g = tie_golden(settings=DeploymentSettings(dtype="auto"))
    f = fakes(same(g))
    golden = str(write(tmp_path, g))
    assert cli(capsys, "--base-url", f.url, "--golden", golden, "--dtype", "bfloat16")[0] == 0
    assert cli(capsys, "--base-url", f.url, "--golden", golden, "--dtype", "auto")[0] == 0
    assert cli(capsys, "--base-url", f.url, "--golden", golden, "--dtype", "half")[0] == 2


def test_golden_for_another_config_or_tokenizer_is_refused(tmp_path, fakes, capsys, tiny_ckpt) -> None:
    """r02: a RoPE fix edits only config.json; the weights digest cannot see it."""
    base = tmp_path / "base"
    shutil.copytree(tiny_ckpt, base)
    ident = answer_identity(base)
    g = tie_golden(**ident)
    f = fakes(same(g))
    golden = str(write(tmp_path, g))
    # control first: the checkpoint the golden was recorded from passes
    rc, out, err = cli(capsys, "--base-url", f.url, "--golden", golden, "--checkpoint", str(base))
    assert rc == 0, err
    edited = tmp_path / "edited"
    shutil.copytree(base, edited)
    cfg = json.loads((edited / "config.json").read_text())
    cfg["rope_theta"] = 1000000.0
    (edited / "config.json").write_text(json.dumps(cfg, indent=2))
    rc, out, err = cli(capsys, "--base-url", f.url, "--golden", golden, "--checkpoint", str(edited))
    assert rc == 2 and out == "" and "config_digest" in err and "config.json" in err
    tok = tmp_path / "tok"
    shutil.copytree(base, tok)
    t = json.loads((tok / "tokenizer_config.json").read_text())
    t["model_max_length"] = 512
    (tok / "tokenizer_config.json").write_text(json.dumps(t))
    rc, _, err = cli(capsys, "--base-url", f.url, "--golden", golden, "--checkpoint", str(tok))
    assert rc == 2 and "answer_files" in err and "tokenizer_config.json changed" in err


def test_reference_cache_key_covers_config_and_tokenizer(tmp_path, tiny_ckpt) -> None:
    from harness.engine import EngineSpec
    from harness.gate import ReferenceCache

    rc = ReferenceCache(tmp_path / "refs")
    copy = tmp_path / "copy"
    shutil.copytree(tiny_ckpt, copy)
    # control: the same files in another directory are the same reference
    assert rc.key(DIGEST, EngineSpec(checkpoint=str(tiny_ckpt)), "0.32.0") == \
        rc.key(DIGEST, EngineSpec(checkpoint=str(copy)), "0.32.0")
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rope_theta"] = 1000000.0
    (copy / "config.json").write_text(json.dumps(cfg))
    assert rc.key(DIGEST, EngineSpec(checkpoint=str(tiny_ckpt)), "0.32.0") != \
        rc.key(DIGEST, EngineSpec(checkpoint=str(copy)), "0.32.0")
    # and the settings: float16 is another reference than bfloat16
    assert rc.key(DIGEST, EngineSpec(checkpoint=str(tiny_ckpt), dtype="float16"), "0.32.0") != \
        rc.key(DIGEST, EngineSpec(checkpoint=str(tiny_ckpt)), "0.32.0")
    # and the executor the answers were computed under (harness.engine.engine_executor)
    mp = EngineSpec(checkpoint=str(tiny_ckpt), env={"PRELOAD_GATE_ENGINE_EXECUTOR": "mp"})
    uni = EngineSpec(checkpoint=str(tiny_ckpt), env={"PRELOAD_GATE_ENGINE_EXECUTOR": "uni"})
    assert rc.key(DIGEST, mp, "0.32.0") != rc.key(DIGEST, uni, "0.32.0")


def test_check_settings_are_checked_before_any_request(tmp_path, capsys) -> None:
    g = tie_golden(settings=DeploymentSettings(dtype="bfloat16"))
    rc, out, err = cli(capsys, "--base-url", "http://127.0.0.1:9", "--golden", str(write(tmp_path, g)),
                       "--dtype", "float16")
    assert rc == 2 and out == "" and "unreachable" not in err


def test_report_level_ok_requires_every_replica(tmp_path, fakes) -> None:
    g = tie_golden()
    good, bad = fakes(same(g)), fakes([realflip(), same(g)[1]])
    report = check([good.url, bad.url], g, timeout=5, retries=0)
    assert not report.ok and [r.reason for r in report.results] == ["match", "token_mismatch"]


# ------------------------------------------------------------------ settings parsing

def test_engine_args_parse_as_vllm_names_them() -> None:
    s = parse_engine_args(["--dtype", "float16", "-tp", "2", "--max-model-len=512", "--port", "8000",
                           "--kv-cache-dtype", "fp8", "--enable-expert-parallel", "-q", "fp8"])
    assert s == DeploymentSettings(dtype="float16", tensor_parallel_size=2, max_model_len=512,
                                   kv_cache_dtype="fp8", enable_expert_parallel=True, quantization="fp8")
    assert parse_engine_args(s.engine_args()) == s
    assert DeploymentSettings.from_json(s.to_json()) == s


def test_gate_and_record_take_the_deployment_flags() -> None:
    from preload_gate.cli import build_parser

    p = build_parser()
    a = p.parse_args(["gate", "C", "--dtype", "float16", "-tp", "2", "--max-model-len", "128"])
    assert (a.dtype, a.tensor_parallel_size, a.max_model_len) == ("float16", 2, 128)
    r = p.parse_args(["canary", "record", "--model", "m", "--out", "o", "--dtype", "float16", "-pp", "2"])
    assert (r.dtype, r.pipeline_parallel_size) == ("float16", 2)
    # vLLM's default, as `vllm serve` without --dtype: not bfloat16
    assert p.parse_args(["canary", "record", "--model", "m", "--out", "o"]).dtype == "auto"


def test_gate_refuses_deployment_flags_in_the_self_test(capsys, tiny_ckpt) -> None:
    rc = cli_main(["gate", str(tiny_ckpt), "--mutations", "zeroed_norm", "--dtype", "float16"])
    err = capsys.readouterr().err
    assert rc == 2 and "--dtype applies to the promotion gate" in err
