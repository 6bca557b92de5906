"""Golden records: what a checkpoint answers, greedily, to the canary prompts.

A golden file is keyed by everything that decides the answers, and means
nothing outside it: the checkpoint's content digest (``preload.identity``),
its config.json digest (a RoPE fix edits only config.json) and the digest of
every other file that decides answers (tokenizer, chat templates, generation
defaults, processors: ``preload.identity.answer_files``), file by file,
the deployment settings the engine ran with (dtype, parallelism, max model
length, quantization, KV-cache dtype: ``preload.deployment``), the sampling
settings, and the vLLM version that produced it. ``record`` captures one
from an ``auto`` engine (weights read from disk, no cache involved) in a
subprocess; ``check`` (``canaries.check``) later asks serving replicas the
same questions over the OpenAI API and compares.

It stores the prompt's token ids, not only its text, so that the check sends
exactly the tokens the golden engine saw (a replica's tokenizer settings
cannot move the comparison), and the generated token ids with their text,
so a difference can be named in words.

>>> g = record("/models/smollm2", "/srv/golden.json", max_tokens=16)  # doctest: +SKIP
>>> g.digest[:12], len(g.prompts)  # doctest: +SKIP
('3f5c0a1b2c3d', 5)
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from canaries.errors import GoldenError, read_digest
from canaries.prompts import DEFAULT_PROMPTS
from pgbase import atomic
from pgbase.errors import PreloadGateError
from pgbase.procs import stop_group
from pgbase.shards import shard_paths
from preload.deployment import DeploymentSettings, SettingsError, answer_identity
from preload.identity.answer_files import valid_name
from preload.identity.digest import content_digest
from preload.identity.filestat import FileStat

PROGRESS_S = 10.0  # canary record: a line this often while its engine runs (issue 39)

FORMAT = "preload-gate-golden/1"
DEFAULT_MAX_TOKENS = 16
DEFAULT_TOP_LOGPROBS = 5
DEFAULT_RECORD_TIMEOUT_S = 600.0
# The recording engine, after ``sys.executable``; SPEC and OUT paths follow.
_WORKER_ARGS: tuple[str, ...] = ("-m", "canaries._record_worker")


@dataclass(frozen=True)
class Sampling:
    """Everything in a request that decides the tokens and logprobs.

    Penalties and ``ignore_eos`` are stated, not left to defaults, because
    ``vllm serve`` applies a checkpoint's generation_config.json to requests
    that leave them out, while an offline engine given explicit
    ``SamplingParams`` does not: the two would then answer different
    questions. ``ignore_eos`` keeps every answer ``max_tokens`` long, so a
    model that says EOS early still gives a full-length canary.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    top_logprobs: int = DEFAULT_TOP_LOGPROBS
    temperature: float = 0.0
    ignore_eos: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise GoldenError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.top_logprobs <= 20:
            raise GoldenError(f"top_logprobs must be in 0..20, got {self.top_logprobs}")
        if self.temperature != 0.0:
            raise GoldenError("golden records are greedy: temperature must be 0")


@dataclass(frozen=True)
class GoldenPrompt:
    """One prompt and the engine's greedy answer to it.

    ``top_logprobs[i]`` maps token id (a string, as JSON keys are) to its
    logprob at position ``i``; ``token_logprobs[i]`` is the chosen token's.
    """

    prompt: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]


@dataclass(frozen=True)
class Golden:
    digest: str
    vllm_version: str
    sampling: Sampling
    prompts: list[GoldenPrompt]
    checkpoint: str = ""
    engine: dict[str, Any] = field(default_factory=dict)
    # Decoded text of every token id that appears above, so a check can name
    # a differing token in words without loading a tokenizer.
    token_texts: dict[str, str] = field(default_factory=dict)
    recorded_at: str = ""
    format: str = FORMAT
    # None in goldens written before these were recorded: then not compared.
    settings: DeploymentSettings | None = None
    config_digest: str | None = None
    # {relative path: sha256 hex} of the answer files (answer_identity).
    # None in goldens written before it: canaries.fit refuses those by name
    # wherever it compares files, since what they cover cannot be told.
    answer_files: dict[str, str] | None = None
    # What goldens before answer_files recorded (a digest over a fixed list
    # of tokenizer file names, no chat_template.jinja): read, never written.
    tokenizer_digest: str | None = None

    def key(self) -> dict[str, Any]:
        """What this golden is valid for: content, config, answer files, settings, sampling, vLLM version."""
        return {"digest": self.digest, "config_digest": self.config_digest,
                "answer_files": self.answer_files, "tokenizer_digest": self.tokenizer_digest,
                "settings": self.settings.to_json() if self.settings else None,
                "sampling": asdict(self.sampling), "vllm_version": self.vllm_version}

    def token_text(self, token_id: int) -> str | None:
        return self.token_texts.get(str(token_id))

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["settings"] = self.settings.to_json() if self.settings else None
        return out

    @classmethod
    def from_json(cls, obj: Any, source: str = "golden") -> Golden:
        """Parse and validate; a malformed file is one GoldenError line naming
        what is wrong: the format, msgspec's path to a mistyped or missing
        field (``$.prompts[0].token_ids[2]``), a digest that is not 64 hex
        characters, or an answer that does not fit the sampling settings."""
        if not isinstance(obj, dict):
            raise GoldenError(f"{source}: not a golden record (top level is not an object)")
        if obj.get("format") != FORMAT:
            raise GoldenError(f"{source}: format is {obj.get('format')!r}, expected {FORMAT!r}")
        settings = obj.get("settings")
        try:
            # Settings by their own reader: it refuses unknown fields by name.
            golden = msgspec.convert({**obj, "settings": None}, cls)
            golden = replace(
                golden, settings=DeploymentSettings.from_json(settings) if settings is not None else None)
        except msgspec.ValidationError as exc:
            raise GoldenError(f"{source}: malformed golden record ({exc})") from exc
        except SettingsError as exc:
            raise GoldenError(f"{source}: {exc}") from exc
        golden = replace(
            golden, digest=read_digest(golden.digest, f"{source}: digest"),
            config_digest=_optional_digest(golden.config_digest, "config_digest", source),
            tokenizer_digest=_optional_digest(golden.tokenizer_digest, "tokenizer_digest", source),
            answer_files=_answer_files(golden.answer_files, source),
        )
        for i, gp in enumerate(golden.prompts):
            _check_prompt(gp, golden.sampling, f"{source}: prompt {i}")
        if not golden.prompts:
            raise GoldenError(f"{source}: holds no prompt")
        return golden


def _optional_digest(value: str | None, name: str, source: str) -> str | None:
    return None if value is None else read_digest(value, f"{source}: {name}")


def _answer_files(value: dict[str, str] | None, source: str) -> dict[str, str] | None:
    """Each recorded name a path inside a checkpoint folder, each value a digest."""
    if value is None:
        return None
    out = {}
    for name, digest in value.items():
        if not valid_name(name):
            raise GoldenError(f"{source}: answer_files names {name!r}, not a path inside a checkpoint folder")
        out[name] = read_digest(digest, f"{source}: answer_files[{name!r}]")
    return out


def _prompt_from_json(p: Any, sampling: Sampling, where: str) -> GoldenPrompt:
    """One prompt the recording engine answered; GoldenError names ``where``."""
    try:
        gp = msgspec.convert(p, GoldenPrompt)
    except msgspec.ValidationError as exc:
        raise GoldenError(f"{where}: malformed ({exc})") from exc
    _check_prompt(gp, sampling, where)
    return gp


def _check_prompt(gp: GoldenPrompt, sampling: Sampling, where: str) -> None:
    """What msgspec cannot say: the answer fits the sampling settings."""
    if not gp.prompt_token_ids:
        raise GoldenError(f"{where}: no prompt tokens")
    n = len(gp.token_ids)
    if n != sampling.max_tokens:
        raise GoldenError(f"{where}: {n} tokens, but sampling says max_tokens={sampling.max_tokens} with ignore_eos")
    if len(gp.token_logprobs) != n or (sampling.top_logprobs and len(gp.top_logprobs) != n):
        raise GoldenError(f"{where}: logprobs do not cover every generated token")


def load_golden(path: str | os.PathLike[str]) -> Golden:
    """Read a golden file written by :func:`record`."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise GoldenError(f"cannot read golden file {p}: {exc.strerror or exc}") from exc
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise GoldenError(f"golden file {p} is not JSON: {exc}") from exc
    return Golden.from_json(obj, source=str(p))


def _shard_stats(checkpoint: Path) -> dict[str, FileStat]:
    return {p.name: FileStat.of(p) for p in shard_paths(checkpoint)}


def _digest(ckpt: Path) -> str:
    """The promotion's digest with its proof (manifest + stat check), else a hash."""
    from preload.identity.manifest import resolve_digest

    try:
        return resolve_digest(ckpt, mode="stat").digest
    except PreloadGateError:  # none, stale, stat-blind, unreadable or not ours: never trusted
        return content_digest(ckpt)


def record(
    model: str | os.PathLike[str],
    out: str | os.PathLike[str],
    prompts: tuple[str, ...] | list[str] | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    top_logprobs: int = DEFAULT_TOP_LOGPROBS,
    dtype: str = "bfloat16",
    max_model_len: int = 256,
    timeout_s: float = DEFAULT_RECORD_TIMEOUT_S,
    settings: DeploymentSettings | None = None,
    progress: Callable[[str], None] | None = None,
) -> Golden:
    """Record a golden file for ``model`` from an ``auto`` engine and write it atomically.
    ``progress`` is told what happens, in lines (the engine's start takes about a minute on CPU).

    The digest is the promotion's when its manifest still describes the
    folder (the stat check every restarting engine makes,
    :func:`preload.identity.manifest.resolve_digest`; no byte is read for
    it), else hashed from the shards before the engine starts; the shards are
    stat-ed before and after (size, mtime, ctime, inode): a checkpoint edited
    while the engine read it is an error, so the digest always names the
    bytes the answers came from.

    ``settings`` (the deployment's) wins over ``dtype`` and ``max_model_len``;
    without it they make the settings. ``max_model_len`` still bounds the
    engine when the settings leave it to vLLM (it does not change the answers
    to short prompts, and keeps the engine small).
    """
    if settings is None:
        settings = DeploymentSettings(dtype=dtype, max_model_len=max_model_len)
    ckpt = Path(model).resolve()
    sampling = Sampling(max_tokens=max_tokens, top_logprobs=top_logprobs)
    prompt_list = list(prompts if prompts is not None else DEFAULT_PROMPTS)
    if not prompt_list:
        raise GoldenError("no prompts to record")
    before = _shard_stats(ckpt)
    digest = _digest(ckpt)
    spec = {
        "model": str(ckpt),
        "prompts": prompt_list,
        "sampling": asdict(sampling),
        **settings.to_json(),
        "max_model_len": settings.max_model_len or max_model_len,
    }
    identity = answer_identity(ckpt)
    say = progress or (lambda _line: None)
    say(f"starting an auto engine on {ckpt} ({len(prompt_list)} prompts x {max_tokens} tokens; up to "
        f"{timeout_s:.0f} s)")
    result = _run_worker(spec, timeout_s, say)
    if _shard_stats(ckpt) != before or answer_identity(ckpt) != identity:
        raise GoldenError(f"{ckpt} changed while the golden was being recorded; record again")
    golden = Golden(
        digest=digest,
        vllm_version=result["vllm_version"],
        sampling=sampling,
        prompts=[_prompt_from_json(p, sampling, f"recorded prompt {i}") for i, p in enumerate(result["prompts"])],
        checkpoint=str(ckpt),
        engine={"load_format": "auto", "dtype": settings.dtype, "max_model_len": spec["max_model_len"],
                "resolved_dtype": result.get("resolved_dtype")},
        settings=settings,
        config_digest=identity["config_digest"],
        answer_files=identity["answer_files"],
        token_texts={str(k): str(v) for k, v in result["token_texts"].items()},
        recorded_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    atomic.write_json(out, golden.to_json())
    return golden


def record_env() -> dict[str, str]:
    """The environment vLLM's CPU build needs to start on a small machine."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _wait_reporting(proc: subprocess.Popen, timeout_s: float, say: Callable[[str], None], log: Path) -> int | None:
    """``proc``'s exit code, None after ``timeout_s``; a line every :data:`PROGRESS_S` meanwhile."""
    start = time.monotonic()
    while True:
        left = timeout_s - (time.monotonic() - start)
        if left <= 0:
            return None
        try:
            rc = proc.wait(timeout=min(PROGRESS_S, left))
        except subprocess.TimeoutExpired:
            say(f"engine running, {time.monotonic() - start:.0f} s of up to {timeout_s:.0f} s (its log: {log})")
            continue
        say(f"engine done in {time.monotonic() - start:.0f} s (exit code {rc})")
        return rc


def _run_worker(spec: dict[str, Any], timeout_s: float,
                say: Callable[[str], None] = lambda _line: None) -> dict[str, Any]:
    """Run the engine in its own process group; kill the whole group after.

    vLLM leaves engine-core children behind on CPU; killing the group is
    what makes a hung or crashed engine cost a bounded time.
    """
    with tempfile.TemporaryDirectory(prefix="pg-golden-") as work:
        spec_path, out_path, log_path = Path(work, "spec.json"), Path(work, "result.json"), Path(work, "engine.log")
        atomic.write_json(spec_path, spec)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, *_WORKER_ARGS, str(spec_path), str(out_path)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=record_env(), start_new_session=True,
            )
            try:
                rc = _wait_reporting(proc, timeout_s, say, log_path)
            finally:
                stop_group(proc, term_s=5.0, kill_s=5.0, reap_s=None)
        tail = log_path.read_bytes()[-3000:].decode("utf-8", "replace")
        if rc is None:
            raise GoldenError(f"recording engine timed out after {timeout_s:.0f} s; log tail:\n{tail}")
        try:
            result = json.loads(out_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise GoldenError(f"recording engine exited with code {rc} and wrote no result; log tail:\n{tail}") from None
    if not result.get("ok"):
        raise GoldenError(f"recording engine failed: {result.get('error')}")
    return result
