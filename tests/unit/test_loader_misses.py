"""The loader's misses before a connect lead to the right act (new-user review).

- No socket in the engine's root while a live daemon of this user serves
  the digest under another registered root (``preload --socket-root X``, an
  engine without it): the miss names that root and how to point the engine
  there (``socket_root``, ``PRELOAD_GATE_SOCKET_ROOT``), not "start: preload-gate
  preload" (a second resident copy). Controls: no registry entry, a dead
  one, and entries or roots the registry's trust rule refuses (group
  writable, another owner) keep the old line: an untrusted entry is never
  followed.
- A checkpoint vLLM loads from ``.bin`` with no promotion manifest is a miss
  saying the cache serves safetensors only and the engine loads it from
  disk, not "run: preload-gate promote" (promote refuses it). Control: a
  safetensors checkpoint with no manifest still says promote.

Decision functions only (:mod:`preload.loader.misses`): no engine, no vLLM.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon_support import short_dir
from reliability_support import NOBODY, skip_privileged

from fixtures.mutations import copy_checkpoint
from pgbase.errors import CacheKeyMismatchError, DaemonBusyError
from preload.daemon import registry
from preload.events import LoadEvent
from preload.identity.key import WeightCacheKey
from preload.loader import LoaderOptions
from preload.loader.misses import (
    Miss,
    attach_failed,
    bad_answer,
    daemon_unavailable,
    key_mismatch,
    no_socket,
    resolve,
    unresolved,
    wrong_digest,
)
from preload.loader.misses import socket_path as socket_path_miss
from preload.promote import promote
from preload.sockets import SOCKET_ROOT_ENV, socket_dir, socket_path

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("no_vllm")]

DIGEST = "b74f04e7f9a4e431" + "0" * 48


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The engine's cache dir (manifests, daemon registry), empty."""
    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PRELOAD_GATE_SOCKET_ROOT", raising=False)
    return tmp_path / "cache"


@pytest.fixture
def roots() -> Iterator[tuple[Path, Path]]:
    """(the engine's socket root, with no daemon; a daemon's root, with a
    listening rank-0 socket for DIGEST in its 0700 socket directory)."""
    engine_root, daemon_root = short_dir(), short_dir()
    sdir = socket_dir(DIGEST, daemon_root)
    sdir.mkdir(0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_path(sdir, 0)))
    listener.listen()
    try:
        yield engine_root, daemon_root
    finally:
        listener.close()
        shutil.rmtree(engine_root, ignore_errors=True)
        shutil.rmtree(daemon_root, ignore_errors=True)


def _entry(cache: Path, daemon_root: Path) -> Path:
    path = registry.register(daemon_root, DIGEST, cache_dir=cache)  # this (live) process
    assert path is not None
    return path


def _chown_other(path: Path) -> None:
    if os.getuid() != 0:
        skip_privileged("giving a file to another owner needs root")
    os.chown(path, NOBODY, NOBODY)


def _dead(path: Path) -> None:
    path.write_text(path.read_text().replace(f'"pid": {os.getpid()}', '"pid": 999999999'))


def _miss(engine_root: Path, **extra: str) -> Miss:
    opts = LoaderOptions.from_extra({"socket_root": str(engine_root), **extra})
    return no_socket(opts, socket_dir(DIGEST, engine_root), 0, DIGEST, "/tmp/rv2/m")


# One row per registry state: does the miss name the daemon's root?
REGISTRY_ROWS = [
    pytest.param(lambda cache, root: _entry(cache, root), True, id="live-trusted-entry"),
    pytest.param(lambda cache, root: None, False, id="control-no-entry"),
    pytest.param(lambda cache, root: _dead(_entry(cache, root)), False, id="dead-entry"),
    pytest.param(lambda cache, root: os.chmod(_entry(cache, root), 0o620), False, id="group-writable-entry"),
    pytest.param(lambda cache, root: _chown_other(_entry(cache, root)), False, id="entry-of-another-owner"),
    pytest.param(lambda cache, root: (_entry(cache, root), os.chmod(root, 0o770)), False,
                 id="group-writable-socket-root"),
]


@pytest.mark.parametrize(("arrange", "names_root"), REGISTRY_ROWS)
def test_no_socket_names_a_registered_root_that_serves_the_digest(
    cache: Path, roots: tuple[Path, Path], arrange: Callable[[Path, Path], object], names_root: bool,
) -> None:
    engine_root, daemon_root = roots
    arrange(cache, daemon_root)
    miss = _miss(engine_root)
    assert miss.outcome == "miss" and miss.reason.startswith("no daemon for this digest")
    assert f"no socket for rank 0 in {socket_dir(DIGEST, engine_root)}" in miss.reason
    if names_root:
        assert f"socket root {daemon_root}" in miss.reason
        assert '"socket_root"' in miss.reason and f"PRELOAD_GATE_SOCKET_ROOT={daemon_root}" in miss.reason
        assert "preload-gate preload" not in miss.reason and miss.fields == ["socket_root"]
    else:
        assert str(daemon_root) not in miss.reason
        assert "start one: preload-gate preload /tmp/rv2/m" in miss.reason and miss.fields == ["content_digest"]


def test_no_socket_ignores_a_daemon_for_another_rank_or_digest(cache: Path, roots: tuple[Path, Path]) -> None:
    engine_root, daemon_root = roots
    _entry(cache, daemon_root)
    opts = LoaderOptions.from_extra({"socket_root": str(engine_root)})
    rank1 = no_socket(opts, socket_dir(DIGEST, engine_root), 1, DIGEST, "/m")
    other = "c" * 64
    other_digest = no_socket(opts, socket_dir(other, engine_root), 0, other, "/m")
    for miss in (rank1, other_digest):
        assert f"{daemon_root}/" not in miss.reason and "start one: preload-gate preload /m" in miss.reason


def test_an_explicit_socket_dir_is_not_second_guessed(cache: Path, roots: tuple[Path, Path]) -> None:
    engine_root, daemon_root = roots
    _entry(cache, daemon_root)
    miss = _miss(engine_root, socket_dir=str(engine_root / "mine"))
    assert str(daemon_root) not in miss.reason and miss.fields == []


def test_the_registry_lookup_never_raises(cache: Path, roots: tuple[Path, Path]) -> None:
    engine_root, daemon_root = roots
    _entry(cache, daemon_root)
    assert registry.roots_serving("not a digest", 0) == []
    assert registry.roots_serving(DIGEST, 0) == [daemon_root]  # control: the same registry, a real digest


# ------------------------------------------------------------------ .bin checkpoints


def _resolve_miss(ckpt: Path, **extra: object) -> Miss:
    with pytest.raises(Miss) as info:
        resolve(LoaderOptions.from_extra(extra), str(ckpt), LoadEvent(outcome="error", reason=""))
    return info.value


def test_bin_only_checkpoint_is_a_safetensors_only_miss_not_promote(cache: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "bin"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    (ckpt / "pytorch_model.bin").write_bytes(b"\0" * 64)
    miss = _resolve_miss(ckpt)
    assert miss.outcome == "miss"
    assert "serves safetensors only" in miss.reason and "pytorch_model.bin" in miss.reason
    assert "no *.safetensors" in miss.reason and "loads it from disk (fallback)" in miss.reason
    assert "promote" not in miss.reason
    # With fallback off the engine does not load it at all: no disk promise.
    assert "from disk" not in _resolve_miss(ckpt, fallback=False).reason


def test_control_safetensors_checkpoint_without_manifest_still_says_promote(
    cache: Path, tmp_path: Path, tiny_ckpt: Path,
) -> None:
    ckpt = copy_checkpoint(tiny_ckpt, tmp_path / "st")
    miss = _resolve_miss(ckpt)
    assert miss.outcome == "miss" and "no promotion manifest" in miss.reason
    assert "run: preload-gate promote" in miss.reason and "safetensors only" not in miss.reason


# ------------------------------------------------------------------ every reason ends with its act

ENGINE = WeightCacheKey(content_digest=DIGEST, config_digest="c" * 64, architecture="Qwen3ForCausalLM",
                        dtype="bfloat16", rope_digest="r" * 64, kernel_backend="cpu", export_stage="loaded",
                        transport="shm", vllm_version="0.32.0")
RAW = WeightCacheKey(content_digest=DIGEST, config_digest="c" * 64, architecture="Qwen3ForCausalLM",
                     export_stage="raw", transport="shm")  # what preload/daemon/raw.py keys
SDIR = Path("/tmp/rv2/root") / DIGEST[:16]
CKPT = "/tmp/rv2/m"


def _mismatch(daemon: WeightCacheKey, engine: WeightCacheKey = ENGINE, rank: int = 0, **kw: object) -> Miss:
    exc = CacheKeyMismatchError(engine.mismatched_fields(daemon), "daemon holds another key")
    exc.daemon_key = daemon.to_json()  # type: ignore[attr-defined]  # as DaemonClient.get_state sets it
    return key_mismatch(exc, engine, CKPT, SDIR, 4242, rank, **kw)


def _bin(tmp: Path) -> str:
    (tmp / "bin").mkdir()
    (tmp / "bin" / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    (tmp / "bin" / "pytorch_model.bin").write_bytes(b"\0" * 64)
    return str(tmp / "bin")


def _loose_manifests(tmp: Path, tiny: Path) -> Miss:
    from preload.identity.manifest import default_cache_dir

    ckpt = copy_checkpoint(tiny, tmp / "st")
    promote(ckpt, socket_root=tmp / "sock", progress=False)
    os.chmod(default_cache_dir() / "manifests", 0o755)  # as an older release made it
    return _resolve_miss(ckpt)


def _no_manifest(tmp: Path, tiny: Path) -> Miss:
    return _resolve_miss(copy_checkpoint(tiny, tmp / "st"))


STOP = f"stop the daemon on {SDIR} (pid 4242, rank 0; preload-gate status lists every rank)"
# (id, the miss, its kind, the words it must hold, the act it must end with); the
# command is the one an operator pastes, so it is compared whole.
ACT_ROWS: list[tuple[str, Callable[[Path, Path, Path], Miss], str, list[str], Callable[[Path, Path], str]]] = [
    ("no manifest", lambda tmp, tiny, root: _no_manifest(tmp, tiny), "stale_manifest", ["no promotion manifest"],
     lambda tmp, cache: f"run: preload-gate promote {tmp / 'st'} --cache-dir {cache}"),
    ("loose manifest directory", lambda tmp, tiny, root: _loose_manifests(tmp, tiny), "untrusted_cache",
     ["refusing the manifest cache: manifest directory", "is group/world accessible (mode 0755)"],
     lambda tmp, cache: f"run: chmod 700 {cache / 'manifests'}"),
    (".bin weights", lambda tmp, tiny, root: _resolve_miss(Path(_bin(tmp))), "cannot_serve",
     ["this engine loads it from disk (fallback): vLLM loads .bin weights"],
     lambda tmp, cache: "serve it with --load-format auto"),
    ("a hub id, not a folder", lambda tmp, tiny, root: _resolve_miss(Path("Qwen/Qwen3-0.6B"), identity="full"),
     "cannot_serve", ["does not exist"], lambda tmp, cache: "promote DIR and give the engine DIR"),
    ("unreadable expected digest", lambda tmp, tiny, root: unresolved(ValueError("expected_digest is 3 characters"),
                                                                       CKPT), "unresolved",
     ["cannot resolve the checkpoint digest: expected_digest is 3 characters"],
     lambda tmp, cache: f"or promote again: preload-gate promote {CKPT} --cache-dir {cache}"),
    ("socket path too long", lambda tmp, tiny, root: socket_path_miss("socket path /x is 120 bytes"), "socket_path",
     ["is 120 bytes"], lambda tmp, cache: f"{SOCKET_ROOT_ENV}=DIR for both"),
    ("no daemon", lambda tmp, tiny, root: no_socket(LoaderOptions.from_extra({"socket_root": str(root)}),
                                                    socket_dir(DIGEST, root), 0, DIGEST, CKPT), "no_daemon",
     ["no daemon for this digest"],
     lambda tmp, cache: f"start one: preload-gate preload {CKPT} --cache-dir {cache} --socket-root {tmp / 'er'}"),
    ("a daemon under another root", None, "other_root", ["but a live daemon serves it under socket root"],
     lambda tmp, cache: f"{SOCKET_ROOT_ENV}={tmp / 'dr'}"),
    ("daemon unavailable", lambda tmp, tiny, root: daemon_unavailable(ConnectionRefusedError("refused"), SDIR, 0,
                                                                      CKPT), "daemon_unavailable",
     ["daemon unavailable: refused", f"whether a daemon serves {SDIR}"],
     lambda tmp, cache: f"start one: preload-gate preload {CKPT} --cache-dir {cache} --socket-root /tmp/rv2/root"),
    # A full listen backlog is a live daemon: no "start one" (its rank lock refuses a second).
    ("daemon busy", lambda tmp, tiny, root: daemon_unavailable(DaemonBusyError(
        f"the daemon at {SDIR}/rank0.sock is busy: its listen backlog is full"), SDIR, 0, CKPT), "daemon_busy",
     ["daemon busy: the daemon at", "its listen backlog is full", "it is alive: do not start another"],
     lambda tmp, cache: "raise connect_timeout_s in the loader extra config (--model-loader-extra-config "
                        "'{\"connect_timeout_s\": 30}'), or start fewer engines at once"),
    # The field case: a raw-stage daemon, an engine that attaches the loaded stage.
    ("raw-stage daemon", lambda tmp, tiny, root: _mismatch(RAW), "key_mismatch",
     ["export_stage: engine loaded, daemon raw", "a raw-stage daemon serves checkpoint tensors"],
     lambda tmp, cache: f"{STOP} and start it with this engine's settings: preload-gate preload {CKPT} "
                        f"--cache-dir {cache} --socket-root /tmp/rv2/root --stage loaded"),
    ("dtype", lambda tmp, tiny, root: _mismatch(dataclasses.replace(ENGINE, dtype="float16")), "key_mismatch",
     ["dtype: engine bfloat16, daemon float16"],
     lambda tmp, cache: f"preload-gate preload {CKPT} --cache-dir {cache} --socket-root /tmp/rv2/root --dtype bfloat16"),
    ("quantization dropped", lambda tmp, tiny, root: _mismatch(dataclasses.replace(ENGINE, quantization="fp8")),
     "key_mismatch", ["quantization: engine none, daemon fp8"],
     lambda tmp, cache: f"preload-gate preload {CKPT} --cache-dir {cache} --socket-root /tmp/rv2/root"),
    ("TP=2 engine, TP=1 daemon", lambda tmp, tiny, root: _mismatch(
        ENGINE, dataclasses.replace(ENGINE, tp_size=2, tp_rank=1), serving=[0]), "key_mismatch",
     ["serves ranks [0], not rank 0", "tp_size: engine 2, daemon 1"],
     lambda tmp, cache: "--socket-root /tmp/rv2/root -tp 2"),
    ("config.json edited", lambda tmp, tiny, root: _mismatch(dataclasses.replace(ENGINE, rope_digest="e" * 64)),
     "key_mismatch", ["rope_digest comes from config.json, which changed since the daemon started"],
     lambda tmp, cache: f"preload-gate preload {CKPT} --cache-dir {cache} --socket-root /tmp/rv2/root"),
    ("config.json edited, the effective config with it", lambda tmp, tiny, root: _mismatch(
        dataclasses.replace(ENGINE, config_digest="e" * 64, hf_config_digest="f" * 64),
        dataclasses.replace(ENGINE, hf_config_digest="a" * 64)), "key_mismatch",
     ["config_digest, hf_config_digest come from config.json, which changed"],
     lambda tmp, cache: f"preload-gate preload {CKPT} --cache-dir {cache} --socket-root /tmp/rv2/root"),
    ("model_impl", lambda tmp, tiny, root: _mismatch(ENGINE, dataclasses.replace(ENGINE, model_impl="transformers")),
     "key_mismatch", ["model_impl: engine transformers, daemon auto"],
     lambda tmp, cache: f"preload-gate preload {CKPT} --cache-dir {cache} --socket-root /tmp/rv2/root "
                        "--model-impl transformers"),
    ("engine overrides of config.json", lambda tmp, tiny, root: _mismatch(
        dataclasses.replace(ENGINE, hf_config_digest="f" * 64), dataclasses.replace(ENGINE, hf_config_digest="a" * 64)),
     "key_mismatch", ["run this engine without hf_config_digest=aaaaaaaa", "(--hf-overrides/--hf-config-path"],
     lambda tmp, cache: "or load from disk (fallback: true)"),
    ("vLLM version", lambda tmp, tiny, root: _mismatch(dataclasses.replace(ENGINE, vllm_version="0.31.0")),
     "key_mismatch", ["the daemon runs vLLM 0.31.0, this engine 0.32.0: start it from the engine's Python"],
     lambda tmp, cache: f"preload-gate preload {CKPT} --cache-dir {cache} --socket-root /tmp/rv2/root"),
    ("engine-only setting", lambda tmp, tiny, root: _mismatch(
        ENGINE, dataclasses.replace(ENGINE, moe_backend="triton")), "key_mismatch",
     ["preload-gate preload keys vLLM's defaults (moe_backend=auto)", "run this engine without moe_backend=triton"],
     lambda tmp, cache: "or load from disk (fallback: true)"),
    ("protocol broken", lambda tmp, tiny, root: bad_answer(ValueError("get_state reply is malformed"), SDIR, 4242, 0,
                                                           CKPT), "bad_answer", ["get_state reply is malformed"],
     lambda tmp, cache: f"{STOP} and start it from this engine's environment: preload-gate preload {CKPT} "
                        f"--cache-dir {cache} --socket-root /tmp/rv2/root"),
    ("other content in this digest's directory", lambda tmp, tiny, root: wrong_digest(SDIR, "e" * 64, DIGEST, 4242,
                                                                                      0, CKPT), "wrong_digest",
     ["serves digest eeeeeeeeeeeeeeee, not b74f04e7f9a4e431"],
     lambda tmp, cache: f"{STOP} and start the right one: preload-gate preload {CKPT} --cache-dir {cache} "
                        "--socket-root /tmp/rv2/root"),
    ("attach failed", lambda tmp, tiny, root: attach_failed(KeyError("model.norm.weight")), "attach_failed",
     ["attach failed: KeyError: 'model.norm.weight'"], lambda tmp, cache: "or --load-format auto)"),
]


@pytest.mark.parametrize(("name", "make", "kind", "words", "act"), ACT_ROWS, ids=[r[0] for r in ACT_ROWS])
def test_every_miss_ends_with_the_act_that_fixes_it(cache: Path, roots: tuple[Path, Path], tmp_path: Path,
                                                    tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                                    make: Callable[[Path, Path, Path], Miss] | None, kind: str,
                                                    words: list[str], act: Callable[[Path, Path], str]) -> None:
    engine_root, daemon_root = roots
    # Short names for the two roots in the expected lines.
    (tmp_path / "er").symlink_to(engine_root)
    (tmp_path / "dr").symlink_to(daemon_root)
    if make is None:  # the registered-root row: a live daemon of this user elsewhere
        _entry(cache, daemon_root)
        miss = _miss(engine_root)
        expected = f"{SOCKET_ROOT_ENV}={daemon_root}"
    else:
        miss = make(tmp_path, tiny_ckpt, tmp_path / "er")
        expected = act(tmp_path, cache)
    assert miss.kind == kind, (name, miss.reason)
    for w in words:
        assert w in miss.reason, (name, miss.reason)
    assert miss.reason.endswith(expected), (name, miss.reason)
    assert "\n" not in miss.reason


def test_every_miss_reason_has_a_row() -> None:
    from preload.loader.misses import REASONS

    assert {r[2] for r in ACT_ROWS} == set(REASONS)


def test_every_key_field_is_placed_once() -> None:
    """A new key field must say how a mismatch on it is fixed."""
    from preload.daemon import key_flags as kf

    groups = [set(kf.FLAGS), kf.FOLLOW, kf.FROM_FOLDER, kf.SOFTWARE, kf.ENGINE_ONLY, kf.CONTENT]
    placed = [f for g in groups for f in g]
    assert sorted(placed) == sorted(WeightCacheKey.__dataclass_fields__)


def test_printed_flags_set_the_field_in_the_preload_verb() -> None:
    """Every flag a key-mismatch miss can print parses with ``preload``'s own
    parser into the engine's value (a renamed flag fails here, not at 3 a.m.)."""
    import argparse

    from preload.daemon import cli as daemon_cli
    from preload.daemon.key_flags import FLAGS, flags_for

    parser = argparse.ArgumentParser()
    daemon_cli.register(parser.add_subparsers(dest="verb"))
    engine = dataclasses.replace(ENGINE, export_stage="raw", transport="shm", dtype="float16", quantization="fp8",
                                 kv_cache_dtype="fp8_e4m3", tp_size=2, pp_size=3, dp_size=4,
                                 enable_expert_parallel=True, model_impl="transformers")
    where = {  # field -> where the verb's options hold it
        "export_stage": lambda o: o.stage, "transport": lambda o: o.transport,
        "dtype": lambda o: o.engine["dtype"], "quantization": lambda o: o.engine["quantization"],
        "kv_cache_dtype": lambda o: o.engine["kv_cache_dtype"], "tp_size": lambda o: o.parallel.tp_size,
        "pp_size": lambda o: o.parallel.pp_size, "dp_size": lambda o: o.parallel.dp_size,
        "enable_expert_parallel": lambda o: o.engine["enable_expert_parallel"],
        "model_impl": lambda o: o.engine["model_impl"],
    }
    assert set(where) == set(FLAGS)
    for field, got in where.items():
        flags = flags_for([field], engine)
        assert flags, field
        args = parser.parse_args(["preload", CKPT, *" ".join(flags).split()])
        assert got(daemon_cli._options(args)) == getattr(engine, field), (field, flags)
