"""Engine runners: one vLLM engine per subprocess, results as JSON.

Isolation is the point. An engine that crashes, aborts in a kernel or hangs
is a verdict with its log tail, never a hung or dead gate: the worker runs
in its own session (process group), has a wall-clock limit, and the whole
group is killed when it ends, however it ended (vLLM leaves engine-core
children behind on CPU).

>>> spec = EngineSpec(checkpoint="/models/tiny")  # doctest: +SKIP
>>> run_engine(spec, workdir="/tmp/run1").token_ids[0][:4]  # doctest: +SKIP
[17, 305, 12, 88]
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from canaries.prompts import DEFAULT_PROMPTS
from harness.engine_log import vllm_start_figures
from pgbase import atomic
from pgbase.errors import PreloadGateError
from pgbase.procs import stop_group
from preload.daemon.parent import PARENT_PID_ENV
from preload.events import read_events
from preload.trust import UntrustedPathError

DEFAULT_TIMEOUT_S = 300.0
LOG_TAIL_CHARS = 4000
_WEIGHTS_LOG = re.compile(r"Loading weights took ([0-9.]+) seconds")
_MODEL_LOG = re.compile(r"Model loading took [0-9.]+ \w+ (?:memory )?and ([0-9.]+) seconds")
# vLLM's check that no other process released GPU memory while it profiled
# (gpu_worker.py determine_available_memory): engines sharing a GPU trip it.
PROFILE_RACE = "Error in memory profiling"


@dataclass(frozen=True)
class EngineSpec:
    """What one engine runs: checkpoint, load format, parallelism, dtype, prompts."""

    checkpoint: str
    load_format: str = "auto"
    extra_config: dict[str, Any] | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    dtype: str = "bfloat16"
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    max_tokens: int = 16
    top_logprobs: int = 5
    max_model_len: int = 256
    seed: int = 0
    env: dict[str, str] = field(default_factory=dict)
    # The rest of the deployment's settings (preload.deployment); defaults are vLLM's.
    pipeline_parallel_size: int = 1
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    # Serve through vLLM's OpenAI server instead of the offline LLM (for
    # settings the offline engine cannot run, e.g. data parallelism on CPU).
    server: bool = False
    # vLLM's own knobs that change memory and start-up, not answers: the
    # share of the GPU the engine may budget, and eager (no compile, no CUDA graphs).
    gpu_memory_utilization: float = 0.1
    enforce_eager: bool = True

    def settings(self) -> dict[str, Any]:
        """The settings that decide an `auto` engine's output (not where the
        checkpoint lives, not how the cached engine finds its daemon)."""
        return {
            "dtype": self.dtype,
            "tensor_parallel_size": self.tensor_parallel_size,
            "data_parallel_size": self.data_parallel_size,
            "prompts": list(self.prompts),
            "max_tokens": self.max_tokens,
            "top_logprobs": self.top_logprobs,
            "max_model_len": self.max_model_len,
            "seed": self.seed,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "quantization": self.quantization,
            "kv_cache_dtype": self.kv_cache_dtype,
        }

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["prompts"] = list(self.prompts)
        return d


@dataclass
class EngineResult:
    """Greedy tokens, top logprobs, load events and phase timings of one run.

    ``ok`` is False when the engine failed to start or answer; ``error`` then
    says why and ``log_tail`` holds the end of its log.
    """

    ok: bool
    token_ids: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    # Per prompt, per position: {token_id (str): logprob}.
    logprobs: list[list[dict[str, float]]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    log_tail: str = ""
    returncode: int | None = None
    timed_out: bool = False
    vllm_version: str | None = None
    resolved_dtype: str | None = None
    # What vLLM's own log said of the start (:func:`vllm_start_figures`).
    vllm_figures: dict[str, float] = field(default_factory=dict)
    # The content digest of the checkpoint as the machine that ran the engine saw it.
    weights_digest: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> EngineResult:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in obj.items() if k in names})


# How a single-rank offline engine runs: "uni" (the engine core and its one
# worker in the engine's own process) or "mp" (vLLM's default: an engine-core
# process and a worker process, each importing vLLM again). Both load weights
# through the same loader with the same config, so the comparison of cached and
# `auto` engines is unchanged; "uni" starts in about a third of the time on 2
# cores (tiny fixture, measured side by side: 60 s mp, 21 s uni, same tokens).
# Multi-rank and server engines always use vLLM's own executors.
EXECUTOR_ENV = "PRELOAD_GATE_ENGINE_EXECUTOR"
EXECUTORS = ("uni", "mp")


class EngineSpecError(PreloadGateError):
    """An engine cannot be started as asked (a bad executor choice)."""


def engine_executor(spec: EngineSpec) -> str:
    """``uni`` or ``mp`` for ``spec`` (see ``EXECUTORS``); ``$PRELOAD_GATE_ENGINE_EXECUTOR``
    chooses for single-rank offline engines (default ``uni``). Raises EngineSpecError
    for another value."""
    if spec.server or spec.tensor_parallel_size * spec.pipeline_parallel_size * spec.data_parallel_size != 1:
        return "mp"
    chosen = (spec.env.get(EXECUTOR_ENV) or os.environ.get(EXECUTOR_ENV) or "uni").strip()
    if chosen not in EXECUTORS:
        raise EngineSpecError(f"{EXECUTOR_ENV}={chosen!r} is not one of {', '.join(EXECUTORS)}")
    return chosen


def engine_env(spec: EngineSpec) -> dict[str, str]:
    """The environment vLLM's CPU build needs to start on a small shared machine."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    if spec.tensor_parallel_size == 2 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    env.update(spec.env)
    env[EXECUTOR_ENV] = engine_executor(spec)
    if env[EXECUTOR_ENV] == "uni":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs in the worker's process
    return env


def omp_bind(spec: EngineSpec, cores: Sequence[str]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` that runs ``spec`` on ``cores``: one
    ``|``-separated entry per rank of the engine (DP x PP x TP), rank ``i`` on
    ``cores[i % len(cores)]``. vLLM's rule (``OMPProcessManager.
    _parse_omp_threads_bind_env``, vllm/utils/ompmultiprocessing.py): each
    data-parallel engine core takes its slice ``[dp_rank * world, (dp_rank + 1)
    * world]`` of the list, so a one-entry bind leaves DP rank 1 none and its
    engine core fails to start ("Given number of CPU id list [] doesn't match
    local world size 1").

    >>> omp_bind(EngineSpec(checkpoint="/m", data_parallel_size=2), ["1"])
    '1|1'
    """
    ranks = spec.data_parallel_size * spec.pipeline_parallel_size * spec.tensor_parallel_size
    return "|".join(cores[i % len(cores)] for i in range(ranks))


class CorePool:
    """The cores engines run on when several run side by side.

    vLLM's CPU worker pins its OpenMP threads to one core (core 0 unless
    told otherwise): engines run side by side only on different cores. With
    ``jobs`` > 1 each single-rank engine is bound to a core of its own while
    it runs (``VLLM_CPU_OMP_THREADS_BIND``), unless the caller's environment
    already binds them.

    >>> pool = CorePool(jobs=2)
    >>> with pool.pinned(EngineSpec(checkpoint="/models/tiny")) as spec:  # doctest: +SKIP
    ...     run_engine(spec, "/tmp/run1")
    """

    def __init__(self, jobs: int, cores: Sequence[int] | None = None) -> None:
        """``cores``: bind to these (``jobs`` of them), even when jobs is 1 (two
        pools side by side); None: the process's first ``jobs`` cores, bound
        only when jobs > 1."""
        self.jobs = max(1, jobs)
        self._bind = cores is not None or self.jobs > 1
        self._free: queue.Queue[str] = queue.Queue()
        for c in (list(cores) if cores is not None else sorted(os.sched_getaffinity(0)))[: self.jobs]:
            self._free.put(str(c))

    @contextlib.contextmanager
    def pinned(self, spec: EngineSpec, env: Mapping[str, str] | None = None) -> Iterator[EngineSpec]:
        """Take a free core (waiting for one) and yield ``spec`` with ``env``
        and the core binding added; the core is free again on exit."""
        core = self._free.get()
        try:
            extra = dict(env or {})
            if self._bind and spec.tensor_parallel_size == 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                extra["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind(spec, [core])
            yield dataclasses.replace(spec, env={**spec.env, **extra}) if extra else spec
        finally:
            self._free.put(core)


# Engines this process runs now, so that a gate told to stop (SIGTERM) can
# stop them: each runs in its own session, out of reach of a signal to ours.
_live: set[subprocess.Popen[bytes]] = set()
_live_lock = threading.RLock()  # re-entrant: the signal handler may run on a thread holding it
_stopping = threading.Event()


def stop_all_engines() -> int:
    """Stop every engine this process runs (whole process groups) and refuse
    new ones: a stopping gate must not leave engines behind, nor start more
    from its queue. Returns how many were running."""
    with _live_lock:
        _stopping.set()
        procs = list(_live)
    for proc in procs:
        _kill_group(proc)
    return len(procs)


def unwind_on_signals(verb: str) -> None:
    """Make SIGTERM (a cancelled CI job, ``systemctl stop``, ``kill``) and
    SIGINT stop a long verb cleanly: its engines are stopped at once (they sit
    in their own sessions, which neither signal reaches), then the exception
    raised here unwinds every ``finally``, which stops the daemon and removes
    temporary directories. Without this SIGTERM ends Python with no
    ``finally`` at all, and Ctrl-C waits for the running engines to finish.
    Exit status: 143 for SIGTERM, 130 for SIGINT. Call from the main thread."""
    def handler(signum: int, frame: Any) -> None:
        # One unwinding: a second signal must not cut the clean-up short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        name = signal.Signals(signum).name
        print(f"preload-gate {verb}: {name}: stopping its engines and daemon", file=sys.stderr, flush=True)
        stop_all_engines()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the worker's whole process group, then SIGKILL what is left (5 s each)."""
    stop_group(proc, term_s=5.0, kill_s=5.0)


def _tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chars))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def run_engine(
    spec: EngineSpec,
    workdir: str | os.PathLike[str],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    worker: str = "harness.engine_worker",
) -> EngineResult:
    """:func:`run_engine_once`, again (twice at most) where vLLM refused to
    start because another process on the GPU released memory while it
    profiled (``PROFILE_RACE``): a start-up race of engines sharing a GPU,
    not a verdict on the weights. The retry is said in ``timings["retries"]``."""
    result = run_engine_once(spec, workdir, timeout_s, worker)
    retries = 0
    while not result.ok and retries < 2 and PROFILE_RACE in (result.log_tail or ""):
        retries += 1
        result = run_engine_once(spec, workdir, timeout_s, worker)
        result.timings["retries"] = retries
    return result


def run_engine_once(
    spec: EngineSpec,
    workdir: str | os.PathLike[str],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    worker: str = "harness.engine_worker",
) -> EngineResult:
    """Run ``spec`` in a fresh worker process; never raises for engine failures.

    ``worker`` is the module run as ``python -m WORKER SPEC OUT``; a bench
    wraps :mod:`harness.engine_worker` to time a phase the marks do not cover.

    ``workdir`` receives spec.json, result.json, events.jsonl and engine.log.
    A cached engine's ``events_file`` is pointed into ``workdir`` unless the
    spec names one.
    """
    wd = Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    events_path = wd / "events.jsonl"
    if events_path.exists():
        events_path.unlink()
    body = spec.to_json()
    # Only our loader takes an events file; vLLM's loaders refuse unknown keys.
    if spec.extra_config is not None and spec.load_format == "verified_cache":
        extra = dict(spec.extra_config)
        extra.setdefault("events_file", str(events_path))
        events_path = Path(extra["events_file"])
        body["extra_config"] = extra
    spec_path, out_path, log_path = wd / "spec.json", wd / "result.json", wd / "engine.log"
    atomic.write_json(spec_path, body)
    if out_path.exists():
        out_path.unlink()
    env = engine_env(spec)
    env.setdefault("PRELOAD_GATE_EVENTS", str(events_path))
    env[PARENT_PID_ENV] = str(os.getpid())  # the worker ends with us (harness.engine_worker)
    t0 = time.monotonic()
    with open(log_path, "wb") as log, _live_lock:
        if _stopping.is_set():
            return EngineResult(ok=False, error="not started: the gate is stopping (SIGTERM)")
        proc = subprocess.Popen(
            [sys.executable, "-m", worker, str(spec_path), str(out_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        _live.add(proc)
    timed_out = False
    rc: int | None = None
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        _kill_group(proc)
        if rc is None:
            rc = proc.wait()
        with _live_lock:
            _live.discard(proc)
    wall = time.monotonic() - t0
    log_text = log_path.read_text(encoding="utf-8", errors="replace")
    result = _collect(out_path, rc, timed_out, timeout_s, log_text)
    try:
        result.events = read_events(events_path)
    except UntrustedPathError as exc:  # not what our loader writes: its lines prove nothing
        result.ok = False
        result.error = "; ".join(e for e in (result.error, f"load events not read: {exc}") if e)
    result.timings["wall"] = round(wall, 3)
    result.vllm_figures = vllm_start_figures(log_text)
    loads = [float(e["seconds"]) for e in result.events if isinstance(e.get("seconds"), (int, float))]
    if loads:  # the loader's own measure of its load, slowest rank
        result.timings["weights_load"] = round(max(loads), 4)
    elif m := _WEIGHTS_LOG.search(log_text):
        result.timings["weights_load"] = float(m.group(1))
    elif m := _MODEL_LOG.search(log_text):
        result.timings["weights_load"] = float(m.group(1))
    if not result.ok:
        result.log_tail = _tail(log_path)
    return result


def _collect(out_path: Path, rc: int | None, timed_out: bool, timeout_s: float, log: str) -> EngineResult:
    if timed_out:
        return EngineResult(ok=False, error=f"engine timed out after {timeout_s:.0f} s", returncode=rc, timed_out=True)
    try:
        obj = json.loads(out_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return EngineResult(ok=False, error=f"engine exited with code {rc} and wrote no result", returncode=rc)
    except ValueError as exc:
        return EngineResult(ok=False, error=f"engine result is not JSON: {exc}", returncode=rc)
    if not obj.get("ok"):
        return EngineResult(ok=False, error=obj.get("error") or f"engine failed (code {rc})", returncode=rc)
    marks = {k: round(float(v), 3) for k, v in obj.get("marks", {}).items()}
    return EngineResult(
        ok=True,
        token_ids=obj["token_ids"],
        texts=obj["texts"],
        logprobs=obj["logprobs"],
        timings=marks,
        returncode=rc,
        vllm_version=obj.get("vllm_version"),
        resolved_dtype=obj.get("resolved_dtype"),
    )
