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
