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

import os
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon_support import short_dir
from reliability_support import NOBODY, skip_privileged

from fixtures.mutations import copy_checkpoint
from preload.daemon import registry
from preload.events import LoadEvent
from preload.loader import LoaderOptions
from preload.loader.misses import Miss, no_socket, resolve
from preload.sockets import socket_dir, socket_path

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
        assert "start: preload-gate preload /tmp/rv2/m" in miss.reason and miss.fields == ["content_digest"]


def test_no_socket_ignores_a_daemon_for_another_rank_or_digest(cache: Path, roots: tuple[Path, Path]) -> None:
    engine_root, daemon_root = roots
    _entry(cache, daemon_root)
    opts = LoaderOptions.from_extra({"socket_root": str(engine_root)})
    rank1 = no_socket(opts, socket_dir(DIGEST, engine_root), 1, DIGEST, "/m")
    other = "c" * 64
    other_digest = no_socket(opts, socket_dir(other, engine_root), 0, other, "/m")
    for miss in (rank1, other_digest):
        assert str(daemon_root) not in miss.reason and "start: preload-gate preload /m" in miss.reason


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
