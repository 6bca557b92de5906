"""``status`` finds every daemon of the user; socket roots print absolute
(new-user trial C2, C3).

C2: a daemon under a custom ``--socket-root`` registers its root in the
user's private registry (preload.daemon.registry); a plain ``status`` scans
the default root and every registered live root, prunes dead entries, and
refuses (by name, never following) an entry or root that fails the trust
rule of socket directories.

C3: ``--socket-root rel/dir`` is made absolute at the CLI boundary, so every
printed socket path names the same directory from any working directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_support import REPO, Daemon, repo_pythonpath, short_dir

from pgbase import atomic
from preload.client import DaemonClient
from preload.daemon import registry
from preload.promote import promote
from preload.sockets import default_socket_root

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="daemon_raw")]


def _cli(env: dict[str, str], *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "preload_gate.cli", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=180)


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PRELOAD_GATE_SOCKET_ROOT"}
    return {**env, "PRELOAD_GATE_CACHE": str(cache), "PYTHONPATH": repo_pythonpath()}


def _ours(doc: dict, sdir: Path) -> list[dict]:
    # The default root is shared by every test run of this user: look at ours only.
    return [r for r in doc["ranks"] if Path(r["socket"]).parent == sdir and r["serving"]]


# ------------------------------------------------------------------ C2: status finds custom roots

def test_plain_status_lists_a_daemon_under_a_custom_root(tiny_ckpt: Path, tmp_path: Path) -> None:
    root, cache = short_dir(), tmp_path / "cache"
    env = _env(cache)
    promote(tiny_ckpt, socket_root=root, cache_dir=cache, progress=False)
    d = Daemon(tiny_ckpt, root, cache).start()
    sdir = d.socket_dir
    try:
        p = _cli(env, "status", "--json")
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        (row,) = _ours(doc, sdir)
        assert row["digest"] == d.ready["digest"] and row["socket_root"] == str(root)
        assert str(root) in doc["socket_roots"] and doc["refused"] == []
        text = _cli(env, "status")
        assert f"socket_root={root}" in text.stdout, text.stdout
        # Control: without its registry entry (what status had before), plain status misses it.
        (entry,) = (cache / "daemons").iterdir()
        saved = entry.read_bytes()
        entry.unlink()
        blind = json.loads(_cli(env, "status", "--json").stdout)
        assert _ours(blind, sdir) == [] and str(root) not in blind["socket_roots"]
        atomic.write_bytes(entry, saved, mode=0o600)
    finally:
        d.stop()
    # A stopped daemon takes its entry (and its socket directory) with it.
    assert list((cache / "daemons").iterdir()) == []
    assert not sdir.exists()
    p = _cli(env, "status", "--json")
    assert _ours(json.loads(p.stdout), sdir) == []


def _entry(cache: Path, name: str, obj: dict, mode: int = 0o600) -> Path:
    d = registry.registry_dir(cache)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = d / f"{name}.json"
    path.write_text(json.dumps(obj))
    os.chmod(path, mode)
    return path


def _live(root: Path) -> dict:
    return {"socket_root": str(root), "pid": os.getpid(), "start_ticks": registry.start_ticks(os.getpid())}


def test_registry_keeps_live_prunes_dead_and_refuses_untrusted(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    good = tmp_path / "good"
    good.mkdir(mode=0o700)
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)
    link = tmp_path / "link"
    link.symlink_to(good)
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    live = _entry(cache, "live", _live(good))
    dead = _entry(cache, "dead", {"socket_root": str(good), "pid": dead_pid, "start_ticks": 1})
    # Our own pid, another start time: a reused pid is not the daemon that wrote the entry.
    reused = _entry(cache, "reused", {**_live(good), "start_ticks": -1})
    symlinked = _entry(cache, "symlinked", _live(link))
    group_root = _entry(cache, "group_root", _live(loose))
    readable = _entry(cache, "readable", _live(good), mode=0o644)
    relative = _entry(cache, "relative", {**_live(good), "socket_root": "rel/dir"})

    roots, refused = registry.live_roots(cache)
    assert roots == [good]  # the control: a live, private entry is followed
    assert live.exists() and not dead.exists() and not reused.exists()  # dead ones pruned
    why = {Path(r["path"]).stem: r["error"] for r in refused}
    assert set(why) == {"symlinked", "group_root", "readable", "relative"}
    assert "symlinked" in why["symlinked"] and "group/world accessible" in why["group_root"]
    assert "group/world accessible" in why["readable"] and "not absolute" in why["relative"]
    # Refused entries are reported, never removed: they are not provably ours to remove.
    assert symlinked.exists() and group_root.exists() and readable.exists() and relative.exists()

    # A registry directory others can write is not read at all.
    os.chmod(registry.registry_dir(cache), 0o755)
    roots, refused = registry.live_roots(cache)
    assert roots == [] and "group/world accessible" in refused[0]["error"]


def test_status_names_a_refused_entry_and_does_not_scan_it(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    other = tmp_path / "theirs"
    other.mkdir()
    os.chmod(other, 0o777)
    _entry(cache, "planted", _live(other))
    p = _cli(_env(cache), "status")
    assert p.returncode == 0, p.stderr
    assert f"not following {registry.registry_dir(cache)}/planted.json" in p.stdout
    doc = json.loads(_cli(_env(cache), "status", "--json").stdout)
    assert str(other) not in doc["socket_roots"]


# ------------------------------------------------------------------ C3: absolute socket roots

def test_relative_socket_root_prints_absolute_everywhere(tiny_ckpt: Path, tmp_path: Path, monkeypatch) -> None:
    work = short_dir("pg-rel-")
    (work / "rel").mkdir()
    cache = tmp_path / "cache"
    env = _env(cache)
    want_root = work / "rel" / "dir"

    p = _cli(env, "promote", str(tiny_ckpt), "--socket-root", "rel/dir", "--json", cwd=work)
    assert p.returncode == 0, p.stderr
    promoted = json.loads(p.stdout)
    sdir = Path(promoted["socket_dir"])
    assert sdir.is_absolute() and sdir.parent == want_root

    plan = _cli(env, "preload", str(tiny_ckpt), "--socket-root", "rel/dir", "--dry-run", "--json", cwd=work)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["socket_dir"] == str(sdir)

    d = Daemon(tiny_ckpt, Path("rel/dir"), cache, cwd=work).start()
    try:
        assert d.ready["socket_dir"] == str(sdir)
        assert d.ready["ranks"][0]["socket"] == str(sdir / "rank0.sock")
        # What an engine does from another directory with the printed path.
        other = tmp_path / "elsewhere"
        other.mkdir()
        monkeypatch.chdir(other)
        DaemonClient.connect(d.ready["socket_dir"], 0).close()
        # Control: the path as given names another place from here.
        assert not Path("rel/dir").exists()
        st = _cli(env, "status", "--socket-root", "rel/dir", "--json", cwd=work)
        doc = json.loads(st.stdout)
        assert doc["socket_root"] == str(want_root)
        assert [r["socket"] for r in doc["ranks"]] == [str(sdir / "rank0.sock")]
    finally:
        d.stop()


def test_empty_socket_root_is_one_line_exit_2(tmp_path: Path) -> None:
    p = _cli(_env(tmp_path / "cache"), "status", "--socket-root", "")
    assert p.returncode == 2 and "--socket-root needs a directory" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_relative_socket_root_variable_is_made_absolute(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PRELOAD_GATE_SOCKET_ROOT", "rel")
    assert default_socket_root() == tmp_path / "rel"


# ------------------------------------------------------------------ --cache-dir on preload and status

def test_cache_dir_flag_names_the_cache_promote_wrote(tiny_ckpt: Path, tmp_path: Path) -> None:
    """`promote --cache-dir A` then `preload --cache-dir A` finds A's manifest
    (and `status --cache-dir A` follows A's registry), whatever
    PRELOAD_GATE_CACHE says. Control: without the flag, the environment's
    empty cache has no manifest, so the plan has no digest."""
    a, b = tmp_path / "A", tmp_path / "B"
    root = short_dir()
    digest = promote(tiny_ckpt, socket_root=root, cache_dir=a, progress=False).digest
    env = _env(b)
    plan = ["preload", str(tiny_ckpt), "--stage", "raw", "--socket-root", str(root), "--dry-run", "--json"]
    p = _cli(env, *plan, "--cache-dir", str(a))
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert (doc["digest_source"], doc["expected_digest"]) == ("manifest", digest)
    control = json.loads(_cli(env, *plan).stdout)
    assert (control["digest_source"], control["expected_digest"]) == ("none", None)
    assert json.loads(_cli(env, "status", "--json", "--cache-dir", str(a)).stdout)["registry"] == str(a / "daemons")
    assert json.loads(_cli(env, "status", "--json").stdout)["registry"] == str(b / "daemons")
    bad = _cli(env, "status", "--cache-dir", str(tiny_ckpt / "config.json"))
    assert bad.returncode == 2 and "is not a directory" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    # A typo'd or missing cache would serve with no manifest: refused (new-user F3); an empty one likewise (F4).
    for argv, why in ((["preload", str(tiny_ckpt), "--cache-dir", str(tmp_path / "typo"), "--dry-run"], "does not exist"),
                      (["status", "--cache-dir", str(tmp_path / "typo")], "does not exist"),
                      (["promote", str(tiny_ckpt), "--cache-dir", ""], "is empty")):
        r = _cli(env, *argv)
        assert r.returncode == 2 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1, (argv, r.stderr)
    assert not (tmp_path / "typo").exists()


# ------------------------------------------------------------------ what stands in a socket's place

@pytest.mark.parametrize("kind", ["a regular file", "a symlink", "control: a stale socket"])
def test_status_says_what_stands_where_a_socket_should(kind: str, tmp_path: Path) -> None:
    import socket as socketlib

    root = short_dir("pg-nsock-")
    sdir = root / ("ab" * 8)
    sdir.mkdir(mode=0o700)
    path = sdir / "rank0.sock"
    if kind == "a regular file":
        path.write_text("x")
    elif kind == "a symlink":
        path.symlink_to(tmp_path / "elsewhere")
    else:  # a socket whose daemon is gone: bound, closed, left on disk
        s = socketlib.socket(socketlib.AF_UNIX)
        s.bind(str(path))
        s.close()
    p = _cli(_env(tmp_path / "cache"), "status", "--socket-root", str(root))
    assert p.returncode == 0, p.stderr
    if kind.startswith("control"):
        assert f"{path}: not answering and its lock is free (stale socket)" in p.stdout, p.stdout
    else:
        assert f"{path}: {kind}, not a socket: nothing serves here; remove it" in p.stdout, p.stdout
        assert "stale socket" not in p.stdout
