"""Every refusal of a cache says how to use another: PRELOAD_GATE_CACHE, the one name engines read.

Verbs take ``--cache-dir``; engines take no flag, only the environment. So a
line about a read-only, foreign, symlinked or missing-manifest cache that
says only "use a directory of your own" or "run promote" leaves an engine's
operator without the act. Rows: each way a cache is refused, met where it is
met (a verb's preflight, an engine's restart check), and the words its line
must hold; the manifest found in the user's other cache is named by path.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from reliability_support import NOBODY, skip_privileged

from fixtures.mutations import copy_checkpoint
from preload.events import LoadEvent
from preload.loader import LoaderOptions
from preload.loader.misses import Miss, resolve
from preload.preflight import PreflightError, check_cache_dir
from preload.promote import promote

pytestmark = pytest.mark.unit

ENV = "PRELOAD_GATE_CACHE="


@pytest.fixture
def world(tmp_path: Path, tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A checkpoint, the user's default cache (XDG_CACHE_HOME under tmp) and an env cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(tmp_path / "envcache"))
    return {"ckpt": copy_checkpoint(tiny_ckpt, tmp_path / "ckpt"), "tmp": tmp_path,
            "default": tmp_path / "xdg" / "preload-gate", "env": tmp_path / "envcache"}


def _engine_line(ckpt: Path) -> str:
    with pytest.raises(Miss) as info:
        resolve(LoaderOptions.from_extra({}), str(ckpt), LoadEvent(outcome="error", reason=""))
    return info.value.reason


def _verb_line(cache: Path) -> str:
    with pytest.raises(PreflightError) as info:
        check_cache_dir(cache)
    return str(info.value)


def _foreign(path: Path) -> None:
    if os.getuid() != 0:
        skip_privileged("giving a directory to another owner needs root")
    os.chown(path, NOBODY, NOBODY)


def _read_only(path: Path) -> None:
    path.mkdir(parents=True)
    if os.getuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,mode=0755,size=1m", "tmpfs", str(path)],
                                          capture_output=True).returncode != 0:
        skip_privileged("a read-only mount needs root")


def _promoted_manifests(world: dict[str, Path]) -> Path:
    promote(world["ckpt"], socket_root=world["tmp"] / "sock", cache_dir=world["env"], progress=False)
    return world["env"] / "manifests"


# (name, what to break, whose line: "verb" (preflight of the env cache) or "engine", words the line holds)
ROWS: list[tuple[str, Callable[[dict[str, Path]], None], str, list[str]]] = [
    ("cache dir of another user", lambda w: (w["env"].mkdir(), _foreign(w["env"])), "verb",
     ["is owned by uid 65534", "use a cache of your own: --cache-dir DIR, or PRELOAD_GATE_CACHE=DIR"]),
    ("symlinked cache dir", lambda w: (w["tmp"].joinpath("real").mkdir(), w["env"].symlink_to(w["tmp"] / "real")),
     "verb", ["refusing symlinked cache dir", "or use a cache of your own", ENV]),
    ("read-only cache", lambda w: _read_only(w["env"]), "verb", ["read-only filesystem", "PRELOAD_GATE_CACHE"]),
    ("cache under a file", lambda w: w["env"].write_text("x"), "verb", ["is not a directory", "PRELOAD_GATE_CACHE"]),
    ("manifest directory of another user", lambda w: _foreign(_promoted_manifests(w)), "engine",
     ["refusing the manifest cache: manifest directory", "owned by uid 65534", ENV]),
    ("symlinked manifest directory", lambda w: (_promoted_manifests(w).rename(w["tmp"] / "m"),
                                                (w["env"] / "manifests").symlink_to(w["tmp"] / "m")), "engine",
     ["refusing symlinked manifest directory", ENV]),
    ("manifest in the user's default cache only",
     lambda w: promote(w["ckpt"], socket_root=w["tmp"] / "sock", cache_dir=w["default"], progress=False), "engine",
     ["but the cache {default} holds one", "PRELOAD_GATE_CACHE={default}", "promote into this one"]),
    ("no manifest anywhere", lambda w: None, "engine",
     ["(PRELOAD_GATE_CACHE names it;", "promoted into another cache? give that one as PRELOAD_GATE_CACHE=DIR"]),
]


@pytest.mark.parametrize(("name", "breaks", "whose", "words"), ROWS, ids=[r[0] for r in ROWS])
def test_every_cache_refusal_names_how_to_use_another(world: dict[str, Path], name: str,
                                                      breaks: Callable[[dict[str, Path]], None], whose: str,
                                                      words: list[str]) -> None:
    breaks(world)
    try:
        line = _verb_line(world["env"]) if whose == "verb" else _engine_line(world["ckpt"])
    finally:
        if name == "read-only cache":
            subprocess.run(["umount", str(world["env"])], check=False)
    for w in words:
        assert w.format(default=world["default"]) in line, (name, line)
    assert "\n" not in line


def test_control_a_manifest_in_the_engines_cache_resolves(world: dict[str, Path]) -> None:
    _promoted_manifests(world)
    digest = resolve(LoaderOptions.from_extra({}), str(world["ckpt"]), LoadEvent(outcome="error", reason=""))
    assert len(digest) == 64 and int(digest, 16) >= 0  # the digest, not a refusal


def _ro_bind(path: Path) -> None:
    """``path`` (with what it holds) made read-only where it is: a bind mount remounted ro."""
    if os.getuid() != 0:
        skip_privileged("a read-only bind mount needs root")
    if subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode != 0:
        skip_privileged("mount --bind is refused here")
    if subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", str(path)], check=False)
        skip_privileged("a read-only remount is refused here")


def _stale(w: dict[str, Path]) -> None:
    _promoted_manifests(w)
    shard = next(w["ckpt"].glob("*.safetensors"))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))


# (name, what to break, whether the engine's cache is then read-only). The miss's
# promote command: into the engine's cache while it is writable (as it always was);
# into a writable one, named, with PRELOAD_GATE_CACHE for the engines, once it is not.
PROMOTE_ROWS: list[tuple[str, Callable[[dict[str, Path]], None], bool]] = [
    ("no manifest, read-only cache", lambda w: _read_only(w["env"]), True),
    ("no manifest, writable cache (control)", lambda w: None, False),
    ("stale manifest, read-only cache", lambda w: (_stale(w), _ro_bind(w["env"])), True),
    ("stale manifest, writable cache (control)", _stale, False),
]


@pytest.mark.parametrize(("name", "breaks", "read_only"), PROMOTE_ROWS, ids=[r[0] for r in PROMOTE_ROWS])
def test_the_promote_hint_names_a_writable_cache(world: dict[str, Path], name: str,
                                                 breaks: Callable[[dict[str, Path]], None], read_only: bool) -> None:
    try:
        breaks(world)
        line = _engine_line(world["ckpt"])
    finally:
        if os.path.ismount(world["env"]):
            subprocess.run(["umount", str(world["env"])], check=False)
    ckpt, env, default = world["ckpt"], world["env"], world["default"]
    assert "\n" not in line
    if not read_only:
        assert line.endswith(f"run: preload-gate promote {ckpt} --cache-dir {env}"), line
        assert "read-only" not in line
        return
    assert f"--cache-dir {env}" not in line, f"a promote into the read-only cache cannot work: {line}"
    assert f"run: preload-gate promote {ckpt} --cache-dir {default} (the cache {env} is on a read-only " \
           f"filesystem; engines read the new one with PRELOAD_GATE_CACHE={default})" in line, line


def test_with_no_writable_cache_known_the_hint_says_dir(world: dict[str, Path]) -> None:
    """The user's default cache read-only too: DIR, said to be a writable directory of theirs."""
    from preload.identity.manifest import promote_command

    _read_only(world["env"])
    try:
        _read_only(world["default"])
        try:
            cmd = promote_command(world["ckpt"], world["env"])
        finally:
            subprocess.run(["umount", str(world["default"])], check=False)
    finally:
        subprocess.run(["umount", str(world["env"])], check=False)
    assert cmd == (f"preload-gate promote {world['ckpt']} --cache-dir DIR (the cache {world['env']} is on a "
                   "read-only filesystem; DIR: a writable directory of yours; engines read it with "
                   "PRELOAD_GATE_CACHE=DIR)"), cmd
    # Control: a writable cache is named as it always was.
    assert promote_command(world["ckpt"], world["tmp"]) == f"preload-gate promote {world['ckpt']} --cache-dir " \
                                                          f"{world['tmp']}"


def test_a_manifest_in_the_other_cache_with_this_one_read_only(world: dict[str, Path]) -> None:
    """Use the other cache; no "promote into this one" for a cache that cannot be written."""
    promote(world["ckpt"], socket_root=world["tmp"] / "sock", cache_dir=world["default"], progress=False)
    _read_only(world["env"])
    try:
        line = _engine_line(world["ckpt"])
    finally:
        subprocess.run(["umount", str(world["env"])], check=False)
    assert f"PRELOAD_GATE_CACHE={world['default']}" in line and "promote into this one" not in line, line
    assert line.endswith("; this one is on a read-only filesystem"), line
