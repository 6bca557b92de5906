"""Daemon loss seen by a real vLLM CPU engine (load format ``verified_cache``).

The daemon for the engine's digest crashed (kill -9) before the engine
loaded: its stale socket is still there, nobody answers.

- fallback on: the engine starts from disk, loudly (one ``miss`` event whose
  reason says the daemon is unavailable, the ``preload-gate load:`` line),
  and generates the same greedy tokens as an ``auto`` engine;
- fallback off: startup fails, naming the reason, and the loader gives up
  within a bound (the event's ``seconds``), not after a long timeout.

The client-library faults (kill during attach, hung daemon, engine killed,
restarts) are in tests/unit/test_faults_daemon.py; this is the one check
through vLLM itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from reliability_support import RawDaemon, short_tempdir

from fixtures.mutations import copy_checkpoint
from preload.events import read_events
from preload.promote import promote

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.xdist_group(name="reliability_engine_faults")]

ENGINE = Path(__file__).parent / "engine_run.py"
# The loader must give up on a dead daemon in about a connect attempt.
LOADER_GIVES_UP_S = 10.0


def run_engine(model: Path, cache: Path, events: Path | None = None, **spec: object) -> dict:
    env = dict(os.environ, PRELOAD_GATE_CACHE=str(cache), VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("PRELOAD_GATE_EVENTS", None)
    if events is not None:
        env["PRELOAD_GATE_EVENTS"] = str(events)
    proc = subprocess.run([sys.executable, str(ENGINE), json.dumps({"model": str(model), **spec})],
                          capture_output=True, text=True, env=env, timeout=600)
    out: dict = {"rc": proc.returncode, "log": proc.stdout + proc.stderr, "tokens": None}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            out["tokens"] = json.loads(line[len("RESULT "):])["tokens"]
    return out


@pytest.fixture(scope="module")
def env(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("engine-faults")
    root, cache = short_tempdir("pg-ef-"), base / "cache"
    ckpt = copy_checkpoint(tiny_ckpt, base / "ckpt")
    digest = promote(ckpt, socket_root=root, cache_dir=cache, progress=False).digest
    # A daemon for exactly this digest, crashed: its socket stays behind.
    d = RawDaemon(ckpt, root, cache, expected_digest=digest).start()
    d.kill()
    assert d.socket.is_socket(), "kill -9 should leave a stale socket"
    yield {"ckpt": ckpt, "root": root, "cache": cache, "digest": digest, "socket": d.socket}
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def auto(env: dict) -> list:
    r = run_engine(env["ckpt"], env["cache"])
    assert r["rc"] == 0 and r["tokens"], r["log"][-3000:]
    return r["tokens"]


def test_dead_daemon_fallback_on_is_a_loud_miss(env: dict, auto: list, tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    r = run_engine(env["ckpt"], env["cache"], events, load_format="verified_cache",
                   extra={"socket_root": str(env["root"]), "fallback": True})
    assert r["rc"] == 0, r["log"][-3000:]
    assert r["tokens"] == auto, "the disk fallback must serve the same weights"
    evs = read_events(events)
    assert len(evs) == 1, evs
    ev = evs[0]
    assert ev["outcome"] == "miss" and ev["source"] == "disk", ev
    assert "daemon unavailable" in ev["reason"] and str(env["socket"]) in ev["reason"], ev["reason"]
    assert ev["digest"] == env["digest"]
    assert any(ln.startswith("preload-gate load:") or "preload-gate load:" in ln for ln in r["log"].splitlines())
    assert ev["seconds"] < LOADER_GIVES_UP_S + 60  # includes the disk load itself


def test_dead_daemon_fallback_off_fails_fast_naming_it(env: dict, tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    r = run_engine(env["ckpt"], env["cache"], events, load_format="verified_cache",
                   extra={"socket_root": str(env["root"]), "fallback": False})
    assert r["rc"] != 0, "an engine with fallback off must not start without its daemon"
    assert r["tokens"] is None
    assert "with fallback off: daemon unavailable" in r["log"], r["log"][-3000:]
    evs = read_events(events)
    assert len(evs) == 1 and evs[0]["outcome"] == "miss", evs
    assert evs[0]["seconds"] < LOADER_GIVES_UP_S, f"the loader took {evs[0]['seconds']:.1f} s to give up"
