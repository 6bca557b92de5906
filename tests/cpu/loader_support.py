"""Shared pieces of the loader engine tests: engines in subprocesses and
session fixtures (one promoted tiny checkpoint, one ``auto`` baseline), so
the expensive parts run once per pytest worker. Tests that share them are
grouped with ``xdist_group("loader_engines")``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_support import copy_checkpoint, short_dir

from preload.promote import promote

HERE = Path(__file__).parent


def run_engine(model: Path, cache: Path, events: Path | None = None, timeout: float = 600,
               env_extra: dict[str, str] | None = None, **spec) -> dict:
    """One engine in a subprocess: {"rc", "tokens", "texts", "log"}."""
    env = dict(os.environ, PRELOAD_GATE_CACHE=str(cache), VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("PRELOAD_GATE_EVENTS", None)
    env.update(env_extra or {})
    if events is not None:
        env["PRELOAD_GATE_EVENTS"] = str(events)
    proc = subprocess.run(
        [sys.executable, str(HERE / "engine_run.py"), json.dumps({"model": str(model), **spec})],
        capture_output=True, text=True, env=env, timeout=timeout,
    )
    out = {"rc": proc.returncode, "log": proc.stdout + proc.stderr, "tokens": None, "texts": None}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            out["tokens"], out["texts"] = result["tokens"], result["texts"]
    return out


@pytest.fixture(scope="session")
def loader_env(tiny_ckpt, tmp_path_factory):
    base = tmp_path_factory.mktemp("loader")
    root, cache = short_dir("pg-l-"), base / "cache"
    ckpt = copy_checkpoint(tiny_ckpt, base / "ckpt")
    promote(ckpt, socket_root=root, cache_dir=cache)
    yield {"root": root, "cache": cache, "ckpt": ckpt, "base": base}
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def auto_tokens(loader_env):
    r = run_engine(loader_env["ckpt"], loader_env["cache"])
    assert r["rc"] == 0 and r["tokens"], r["log"][-3000:]
    return r["tokens"]
