"""``verified_cache`` inside real CUDA vLLM engines, each behaviour with its control.

One session: the tiny fixture (base), a copy whose first norm is zeroed with
its header untouched (the mutant vLLM's header-only key cannot tell apart),
three daemons started with the platform's defaults (no ``--stage`` or
``--transport``: what a GPU user types), and eight engines run side by side
(their starts take turns on the GPU). Then an OpenAI server whose daemon
is killed under it. The memory story is test_vllm_cuda_memory.py (alone on
the GPU).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_support import REPO, Daemon, repo_pythonpath, short_dir
from vllm_gpu_support import (
    UNSAFE,
    engine_env,
    engine_log,
    engine_spec,
    record,
    run_all,
    stats,
    why_failed,
)

from fixtures.mutations import by_name, copy_checkpoint
from fixtures.tiny import write_tiny
from harness.engine import EngineResult, EngineSpec, run_engine
from pgbase.ports import free_port
from preload.promote import promote

pytestmark = [pytest.mark.gpu_vllm, pytest.mark.timeout(1800)]

GIB = 1 << 30


@dataclasses.dataclass
class Stack:
    work: Path
    cache: Path
    base: Path
    mutant: Path
    roots: dict[str, Path]
    daemons: dict[str, Daemon]
    runs: dict[str, EngineResult] = dataclasses.field(default_factory=dict)

    def spec(self, ckpt: Path, load_format: str = "auto", extra: dict | None = None, **kw) -> EngineSpec:
        return engine_spec(self.cache, ckpt, load_format, extra, **kw)

    def events(self, name: str) -> list[dict]:
        return self.runs[name].events


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("gpu-vllm")
    cache = work / "cache"
    base = write_tiny(work / "base")
    mutant = copy_checkpoint(base, work / "mutant")
    by_name("zeroed_norm").transform(mutant)  # type: ignore[misc]
    roots = {k: short_dir(f"pg-gv{k}-") for k in ("zero", "copy", "header", "none")}
    for ckpt in (base, mutant):
        promote(ckpt, socket_root=roots["zero"], cache_dir=cache, progress=False)
    daemons = {
        "zero": Daemon(base, roots["zero"], cache, args=()),
        "copy": Daemon(base, roots["copy"], cache, args=()),
        # vLLM's key (header-only, no byte proof): the wrong hit, for controls
        "header": Daemon(base, roots["header"], cache, args=("--unsafe-identity", "header_only"), env=UNSAFE),
    }
    s = Stack(work, cache, base, mutant, roots, daemons)
    try:
        for d in daemons.values():  # one after another: each builds vLLM's model on the GPU
            d.start(timeout=600)
        vc = "verified_cache"
        s.runs = run_all({
            "auto_base": s.spec(base),
            "auto_mutant": s.spec(mutant),
            "zero": s.spec(base, vc, {"socket_root": str(roots["zero"]), "fallback": False}),
            "copy": s.spec(base, vc, {"socket_root": str(roots["copy"]), "fallback": False, "mode": "copy"}),
            "mutant_miss": s.spec(mutant, vc, {"socket_root": str(roots["zero"]), "fallback": True}),
            "mutant_header": s.spec(mutant, vc, {"socket_root": str(roots["header"]), "fallback": False,
                                                 "unsafe_identity": "header_only"}),
            "none_strict": s.spec(base, vc, {"socket_root": str(roots["none"]), "fallback": False}),
            "none_loose": s.spec(base, vc, {"socket_root": str(roots["none"]), "fallback": True}),
        }, work / "engines")
        record("tiny_engine_timings", {k: {**r.timings, **r.vllm_figures} for k, r in s.runs.items()})
        yield s
    finally:
        for d in daemons.values():
            d.stop()
        for r in roots.values():
            shutil.rmtree(r, ignore_errors=True)


def _one(stack: Stack, name: str) -> dict:
    events = stack.events(name)
    assert len(events) == 1, f"{name}: expected one load event, got {events}\n{why_failed(stack.runs[name])}"
    return events[0]


def test_a_gpu_users_daemon_is_the_stage_cuda_engines_attach(stack: Stack) -> None:
    key = stats(stack.daemons["zero"].socket_dir)["key"]
    assert (key["export_stage"], key["transport"]) == ("processed", "cuda"), key
    plan = subprocess.run([sys.executable, "-m", "preload_gate", "preload", str(stack.base), "--dry-run", "--json",
                           "--socket-root", str(short_dir("pg-gvdry-"))],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": repo_pythonpath(),
                                                              "PRELOAD_GATE_CACHE": str(stack.cache)},
                          cwd=str(REPO), timeout=300)
    assert plan.returncode == 0, plan.stderr
    body = json.loads(plan.stdout)
    assert (body["stage"], body["transport"]) == ("processed", "cuda"), body
    # Control: the CPU defaults (what `preload` started here before) are refused on this host in one line.
    old = subprocess.run([sys.executable, "-m", "preload_gate", "preload", str(stack.base), "--stage", "loaded",
                          "--transport", "shm", "--dry-run"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": repo_pythonpath()}, cwd=str(REPO), timeout=300)
    assert old.returncode == 2, old.stdout + old.stderr
    assert len(old.stderr.strip().splitlines()) == 1 and "processed" in old.stderr, old.stderr


def test_zero_copy_hit_answers_autos_tokens(stack: Stack) -> None:
    r, auto = stack.runs["zero"], stack.runs["auto_base"]
    assert r.ok and auto.ok, why_failed(r if not r.ok else auto)
    ev = _one(stack, "zero")
    assert (ev["outcome"], ev["source"], ev["mode"]) == ("hit", "daemon", "zero_copy"), ev
    assert r.token_ids == auto.token_ids
    record("tiny_hit_phases", ev.get("phases"))


def test_copy_mode_hit_answers_autos_tokens_and_the_daemon_releases(stack: Stack) -> None:
    r = stack.runs["copy"]
    assert r.ok, why_failed(r)
    ev = _one(stack, "copy")
    assert (ev["outcome"], ev["mode"]) == ("hit", "copy"), ev
    assert r.token_ids == stack.runs["auto_base"].token_ids
    assert stats(stack.daemons["copy"].socket_dir)["resident_bytes"] == 0
    # Control: the zero-copy daemon keeps its arena (its engine maps it).
    assert stats(stack.daemons["zero"].socket_dir)["resident_bytes"] > 0


def test_a_header_preserving_mutant_is_a_recorded_miss_and_answers_like_its_auto(stack: Stack) -> None:
    auto_base, auto_mutant = stack.runs["auto_base"], stack.runs["auto_mutant"]
    assert auto_mutant.ok, why_failed(auto_mutant)
    assert auto_mutant.token_ids != auto_base.token_ids, "the zeroed norm must change the answers"
    r = stack.runs["mutant_miss"]
    assert r.ok, why_failed(r)
    ev = _one(stack, "mutant_miss")
    assert (ev["outcome"], ev["source"]) == ("miss", "disk") and ev["reason"], ev
    assert ev["digest"] != stats(stack.daemons["zero"].socket_dir)["digest"]
    assert r.token_ids == auto_mutant.token_ids
    # Control: keyed as vLLM keys (headers only), the same mutant is a hit on the
    # base's weights and answers the base's tokens: the token check sees it.
    wrong = stack.runs["mutant_header"]
    assert wrong.ok, why_failed(wrong)
    assert _one(stack, "mutant_header")["outcome"] == "hit"
    assert wrong.token_ids == auto_base.token_ids != auto_mutant.token_ids


def test_no_daemon_with_fallback_off_fails_the_start_naming_why(stack: Stack) -> None:
    r = stack.runs["none_strict"]
    assert not r.ok
    ev = _one(stack, "none_strict")
    assert ev["outcome"] == "miss" and "daemon" in ev["reason"], ev
    assert "fallback off" in engine_log(stack.work / "engines", "none_strict")
    # Control: with fallback on the same engine starts from disk, loudly.
    loose = stack.runs["none_loose"]
    assert loose.ok, why_failed(loose)
    ev = _one(stack, "none_loose")
    assert (ev["outcome"], ev["source"]) == ("miss", "disk"), ev
    assert loose.token_ids == stack.runs["auto_base"].token_ids


def _complete(port: int, prompt: str) -> list[int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": 16, "temperature": 0.0, "logprobs": 1}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        tokens = json.loads(r.read())["choices"][0]["logprobs"]["tokens"]
    return [int(t.split(":", 1)[1]) for t in tokens]


def test_kill_9_of_the_daemon_leaves_a_zero_copy_engine_answering_the_same(stack: Stack) -> None:
    d = stack.daemons["zero"]  # the last test that needs it: the kill ends it
    port = free_port()
    log = stack.work / "serve-kill.log"
    extra = json.dumps({"socket_root": str(stack.roots["zero"]), "fallback": False})
    env = {**os.environ, **engine_env(stack.cache), "PRELOAD_GATE_EVENTS": str(stack.work / "kill.jsonl")}
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(stack.base),
             "--host", "127.0.0.1", "--port", str(port), "--load-format", "verified_cache",
             "--model-loader-extra-config", extra, "--max-model-len", "256", "--enforce-eager",
             "--gpu-memory-utilization", "0.1", "--served-model-name", "m", "--return-tokens-as-token-ids"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 420
        while True:
            assert server.poll() is None, log.read_text(errors="replace")[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
                time.sleep(1)
        prompts = list(EngineSpec(checkpoint="x").prompts)
        before = [_complete(port, p) for p in prompts]
        assert before == stack.runs["auto_base"].token_ids
        d.kill_hard()
        time.sleep(2)
        after = [_complete(port, p) for p in prompts]
        assert after == before
        assert "went away" in log.read_text(errors="replace"), "the engine's watch did not see the loss"
    finally:
        os.killpg(server.pid, 15)
        server.wait(60)
    # Control: the daemon really is gone: a new engine with fallback off cannot start.
    r = run_engine(stack.spec(stack.base, "verified_cache", {"socket_root": str(stack.roots["zero"]),
                                                             "fallback": False}), stack.work / "after-kill")
    assert not r.ok and r.events and r.events[0]["outcome"] in ("miss", "error"), r.events
