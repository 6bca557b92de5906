"""One vLLM engine in its own process: load, greedy-decode, write JSON, exit.

Run by :mod:`harness.engine` as ``python -m harness.engine_worker SPEC OUT``.
The spec and the result are JSON files (never pickle): the harness and the
engine share no Python objects, so a crash, an abort in a C++ kernel or a
hang inside vLLM costs this process, not the gate.

The result records wall-clock phase marks measured from this process's
start (``process_start`` is the harness's spawn, measured by the harness):
``imported`` (vLLM importable), ``ready`` (the ``LLM`` constructor
returned: weights loaded and the engine warmed up), ``first_token`` (a
one-token greedy request answered) and ``done``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from canaries.worker import worker_main
from harness.engine import EXECUTOR_ENV

T0 = time.monotonic()


def _end_with_the_harness() -> None:
    """A harness killed without clean-up (SIGKILL of the gate) must not leave
    its engines running for minutes. When the parent is gone (the daemon's
    own check, :mod:`preload.daemon.parent`), end this worker's whole
    process group, vLLM's engine-core children included: the harness starts
    the worker as the leader of its own session. Run by hand in someone
    else's group, it ends only itself."""
    from preload.daemon.parent import INTERVAL_S, ParentWatch

    watch = ParentWatch.from_env()

    def loop() -> None:
        while not watch.gone():
            time.sleep(INTERVAL_S)
        print(f"engine worker: the harness (pid {watch.parent}) is gone; stopping", file=sys.stderr, flush=True)
        if os.getpgid(0) == os.getpid():
            os.killpg(0, signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


# Engines that share a GPU start one at a time: vLLM asserts that no other
# process released GPU memory while it profiled (gpu_worker.py
# determine_available_memory), so an engine's start (the LLM constructor) and
# its exit (which frees its memory) hold one lock per GPU host. Imports and
# decoding run side by side. CPU engines take no lock.
GPU_LOCK_ENV = "PRELOAD_GATE_GPU_START_LOCK"
_held_lock: list[int] = []


def _gpu_lock_path() -> str | None:
    from vllm.platforms import current_platform

    if current_platform.device_type != "cuda":
        return None
    return os.environ.get(GPU_LOCK_ENV) or f"/tmp/preload-gate-gpu-start-{os.getuid()}.lock"


@contextlib.contextmanager
def gpu_start_lock() -> Iterator[None]:
    """Hold the host's GPU start lock (flock) for the block; none on CPU."""
    path = _gpu_lock_path()
    if path is None:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def hold_gpu_lock_until_exit() -> None:
    """Take the GPU start lock and keep it until this process exits, so its
    memory is freed while no other engine profiles."""
    path = _gpu_lock_path()
    if path is None or _held_lock:
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _held_lock.append(fd)


def _top_logprobs(step: Any) -> dict[str, float]:
    """``{token_id: logprob}`` for one position; JSON keys are strings."""
    if not step:
        return {}
    return {str(int(tid)): float(lp.logprob) for tid, lp in step.items()}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm import __version__ as vllm_version

    from preload.deployment import resolved_dtype

    marks: dict[str, float] = {"imported": time.monotonic() - T0}
    kwargs: dict[str, Any] = {
        "model": spec["checkpoint"],
        "load_format": spec["load_format"],
        "dtype": spec["dtype"],
        "tensor_parallel_size": spec["tensor_parallel_size"],
        "max_model_len": spec["max_model_len"],
        "enforce_eager": bool(spec.get("enforce_eager", True)),
        "gpu_memory_utilization": spec.get("gpu_memory_utilization", 0.1),
        "seed": spec.get("seed", 0),
    }
    # Deployment settings beyond dtype/TP (preload.deployment); left to vLLM's defaults when unset.
    if spec.get("pipeline_parallel_size", 1) != 1:
        kwargs["pipeline_parallel_size"] = spec["pipeline_parallel_size"]
    if spec.get("quantization"):
        kwargs["quantization"] = spec["quantization"]
    if spec.get("kv_cache_dtype", "auto") != "auto":
        kwargs["kv_cache_dtype"] = spec["kv_cache_dtype"]
    if spec.get("data_parallel_size", 1) != 1:
        kwargs["data_parallel_size"] = spec["data_parallel_size"]
    if spec.get("extra_config") is not None:
        kwargs["model_loader_extra_config"] = spec["extra_config"]
    # harness.engine.engine_executor chose it (and set vLLM's multiprocessing switch to match).
    if os.environ.get(EXECUTOR_ENV) == "uni":
        kwargs["distributed_executor_backend"] = "uni"
    with gpu_start_lock():
        llm = LLM(**kwargs)
    marks["ready"] = time.monotonic() - T0
    params = SamplingParams(
        temperature=0.0, max_tokens=spec["max_tokens"], logprobs=spec["top_logprobs"], seed=0
    )
    prompts = list(spec["prompts"])
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    marks["first_token"] = time.monotonic() - T0
    outputs = llm.generate(prompts, params, use_tqdm=False)
    marks["done"] = time.monotonic() - T0
    token_ids, texts, logprobs = [], [], []
    for out in outputs:
        comp = out.outputs[0]
        token_ids.append([int(t) for t in comp.token_ids])
        texts.append(comp.text)
        logprobs.append([_top_logprobs(step) for step in (comp.logprobs or [])])
    hold_gpu_lock_until_exit()
    return {
        "ok": True,
        "token_ids": token_ids,
        "texts": texts,
        "logprobs": logprobs,
        "marks": marks,
        "vllm_version": vllm_version,
        # What "auto" resolved to: the dtype the answers were computed in.
        "resolved_dtype": resolved_dtype(llm),
    }


def run_server(spec: dict[str, Any], out: str) -> dict[str, Any]:
    """The same run through ``python -m vllm.entrypoints.openai.api_server``:
    greedy completions over HTTP on 127.0.0.1, token ids from the server's
    ``--return-tokens-as-token-ids``. The server is this worker's child, in
    its process group, so the harness's group kill ends it."""
    import socket
    import subprocess
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", spec["checkpoint"],
           "--host", "127.0.0.1", "--port", str(port), "--load-format", spec["load_format"],
           "--dtype", spec["dtype"], "--tensor-parallel-size", str(spec["tensor_parallel_size"]),
           "--data-parallel-size", str(spec.get("data_parallel_size", 1)),
           "--max-model-len", str(spec["max_model_len"]), "--enforce-eager", "--seed", str(spec.get("seed", 0)),
           "--return-tokens-as-token-ids", "--served-model-name", "model"]
    if spec.get("extra_config") is not None:
        cmd += ["--model-loader-extra-config", json.dumps(spec["extra_config"])]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    marks: dict[str, float] = {}
    deadline = time.monotonic() + float(spec.get("server_timeout_s", 600))
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the OpenAI server exited with code {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the OpenAI server did not answer /health in time")
        time.sleep(1.0)
    marks["ready"] = time.monotonic() - T0

    def complete(prompt: str, max_tokens: int, logprobs: int | None) -> dict[str, Any]:
        body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "seed": 0, "logprobs": logprobs}
        req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return dict(json.loads(r.read())["choices"][0])

    def tid(tok: str) -> int:
        return int(tok.split(":", 1)[1])

    complete(spec["prompts"][0], 1, None)
    marks["first_token"] = time.monotonic() - T0
    token_ids, texts, logprobs = [], [], []
    for prompt in spec["prompts"]:
        choice = complete(prompt, spec["max_tokens"], spec["top_logprobs"])
        lp = choice.get("logprobs") or {}
        token_ids.append([tid(t) for t in lp.get("tokens") or []])
        texts.append(choice.get("text", ""))
        logprobs.append([{str(tid(k)): float(v) for k, v in (step or {}).items()}
                         for step in lp.get("top_logprobs") or []])
    marks["done"] = time.monotonic() - T0
    from vllm import __version__ as vllm_version

    result = {"ok": True, "token_ids": token_ids, "texts": texts, "logprobs": logprobs, "marks": marks,
              "vllm_version": vllm_version}
    # The result goes to disk before the server is told to stop: its shutdown
    # may signal the whole process group, this worker included.
    from pgbase import atomic

    atomic.write_json(out, result)
    proc.terminate()
    return result


def _run_spec(spec: dict[str, Any], out: str) -> dict[str, Any]:
    for k, v in spec.get("env", {}).items():
        os.environ[k] = str(v)
    return run_server(spec, out) if spec.get("server") else run(spec)


def main(argv: list[str]) -> int:
    return worker_main("harness.engine_worker", argv, _run_spec)


if __name__ == "__main__":
    _end_with_the_harness()
    main(sys.argv[1:])
