"""What ``preload`` (and its ``--dry-run``), ``status`` and ``promote`` refuse
before they read a weight byte or a manifest (new-user trial F2, F3).

F2: a manifest that no longer describes the checkpoint (a shard touched
after ``promote``: same bytes, new stat) is refused by the real start and by
the dry run alike, with one identical line: the very line an engine's stat
check raises (``resolve_digest``). Before, both started, and every engine
then missed on the daemon. Control: after ``promote`` again both go ahead.

F3: a cache dir that exists but is unreadable, not ours, group/world
writable or a symlink is refused by all three verbs with one line and exit
2, nothing written (before, ``preload`` served with no manifest and
``status`` found no registry). Unreadable is tested honestly as root too:
the command runs as uid 0 without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH
(setpriv), which a probe shows cannot list the directory. Controls: the same
directory at 0755 and 0700 passes every verb.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_support import REPO, copy_checkpoint, repo_pythonpath, short_dir
from reliability_support import NOBODY, skip_privileged

from preload.identity.manifest import StaleManifestError, resolve_digest
from preload.promote import promote

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="daemon_raw")]

# Root reads any directory; without these two capabilities it reads by the mode bits, as everyone else.
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
          "--inh-caps=-dac_override,-dac_read_search"]


def _cli(env: dict[str, str], *args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "preload_gate", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=180)


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PRELOAD_GATE_SOCKET_ROOT"}
    return {**env, "PRELOAD_GATE_CACHE": str(cache), "PYTHONPATH": repo_pythonpath()}


def _one_line(p: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, f"exit {p.returncode}: {p.stdout[-500:]} {p.stderr[-2000:]}"
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    return lines[0]


def _tree(*roots: Path) -> set[str]:
    return {str(p) for r in roots if r.exists() for p in [r, *r.rglob("*")]}


@pytest.fixture
def promoted(tiny_checkpoint, tmp_path):
    ckpt = copy_checkpoint(tiny_checkpoint(shards=2), tmp_path / "ckpt")
    cache, root = tmp_path / "cache", short_dir()
    digest = promote(ckpt, socket_root=root, cache_dir=cache, progress=False).digest
    yield ckpt, cache, root, digest
    shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------ F2: the stat check in the dry run

def test_dry_run_refuses_a_stale_manifest_with_the_real_starts_line(promoted) -> None:
    ckpt, cache, root, digest = promoted
    env = _env(cache)
    argv = ["preload", str(ckpt), "--stage", "raw", "--socket-root", str(root)]
    fresh = _cli(env, *argv, "--dry-run", "--json")
    assert fresh.returncode == 0, fresh.stderr  # control: the fresh manifest passes
    assert (json.loads(fresh.stdout)["digest_source"], json.loads(fresh.stdout)["expected_digest"]) == (
        "manifest", digest)
    shard = ckpt / "model-00002-of-00002.safetensors"
    st = os.stat(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: the same bytes, a new stat
    line = _one_line(_cli(env, *argv, "--dry-run"))
    assert f"is stale: shard {shard.name} changed (mtime_ns, ctime_ns)" in line, line
    assert f"run: preload-gate promote {ckpt} --cache-dir {cache}" in line, line
    with pytest.raises(StaleManifestError) as engine:  # what an engine's stat check says
        resolve_digest(ckpt, "stat", cache_dir=cache)
    assert line == f"preload-gate preload: error: {engine.value}"
    before = _tree(cache, root)
    assert _one_line(_cli(env, *argv)) == line  # the real start: the same line, before a rank starts
    assert _tree(cache, root) == before, "nothing made: no socket dir, no registry entry"
    # Control: promoting again makes the same dry run go ahead.
    promote(ckpt, socket_root=root, cache_dir=cache, progress=False)
    assert _cli(env, *argv, "--dry-run").returncode == 0


# ------------------------------------------------------------------ F3: the cache dir's trust

VERBS = {
    "preload": lambda ckpt, root: ["preload", str(ckpt), "--stage", "raw", "--socket-root", str(root),
                                   "--dry-run"],
    "status": lambda ckpt, root: ["status"],
    "promote": lambda ckpt, root: ["promote", str(ckpt), "--socket-root", str(root)],
}


def _bad_cache(problem: str, cache: Path, tmp_path: Path) -> tuple[Path, tuple[str, ...], str]:
    """Make ``cache`` bad in one way: (the path to name, the command prefix, what the line says)."""
    if problem == "group-writable":
        os.chmod(cache, 0o770)
        return cache, (), f"cache dir {cache} is group/world writable (mode 0770); run: chmod go-w {cache}"
    if problem == "world-writable":
        os.chmod(cache, 0o777)
        return cache, (), "is group/world writable (mode 0777)"
    if problem == "symlink":
        link = tmp_path / "cache-link"
        link.symlink_to(cache)
        return link, (), f"refusing symlinked cache dir {link}"
    if problem == "not-ours":
        if os.geteuid() != 0:
            skip_privileged("chown to another uid needs root")
        os.chown(cache, NOBODY, NOBODY)
        return cache, (), f"cache dir {cache} is owned by uid {NOBODY}"
    assert problem == "unreadable"
    os.chmod(cache, 0o000)
    prefix: tuple[str, ...] = ()
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            skip_privileged("setpriv(1) is not installed: root would read a 0000 directory")
        prefix = tuple(NO_DAC)
    probe = subprocess.run([*prefix, sys.executable, "-c", "import os, sys; os.listdir(sys.argv[1])", str(cache)],
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "PermissionError" in probe.stderr, "the directory must really be unreadable"
    return cache, prefix, f"cache dir {cache} is not readable (mode 0000); run: chmod u+rwx {cache}"


@pytest.mark.parametrize("problem", ["group-writable", "world-writable", "symlink", "not-ours", "unreadable"])
@pytest.mark.parametrize("verb", list(VERBS))
def test_an_untrusted_or_unreadable_cache_is_refused(promoted, tmp_path, verb, problem) -> None:
    ckpt, cache, root, _ = promoted
    named, prefix, needle = _bad_cache(problem, cache, tmp_path)
    before = _tree(cache, root)
    try:
        line = _one_line(_cli(_env(named), *VERBS[verb](ckpt, root), prefix=prefix))
        assert needle in line, line
    finally:
        os.chown(cache, os.getuid(), os.getgid())
        os.chmod(cache, 0o755)
    assert _tree(cache, root) == before, f"new on disk: {sorted(_tree(cache, root) - before)}"


@pytest.mark.parametrize("mode", [0o755, 0o700], ids=["0755", "0700"])
def test_a_cache_of_ours_passes_every_verb(promoted, mode) -> None:
    """Control for the refusals above: the same cache, ours and not writable by others."""
    ckpt, cache, root, _ = promoted
    os.chmod(cache, mode)
    for verb, argv in VERBS.items():
        p = _cli(_env(cache), *argv(ckpt, root))
        assert p.returncode == 0, (verb, p.stderr[-2000:])


def test_cache_dir_flag_is_checked_like_the_variable(promoted, tmp_path) -> None:
    ckpt, cache, root, _ = promoted
    os.chmod(cache, 0o777)
    try:
        env = _env(tmp_path / "elsewhere")
        for verb in ("preload", "status", "promote"):
            line = _one_line(_cli(env, *VERBS[verb](ckpt, root), "--cache-dir", str(cache)))
            assert f"cache dir {cache} is group/world writable" in line, line
    finally:
        os.chmod(cache, 0o755)


def test_promote_under_umask_002_makes_a_cache_it_accepts_next_time(tiny_ckpt, tmp_path) -> None:
    """The cache dir is made 0700, not 0775 as umask 002 (user private groups) would
    leave it: that one the rule above would refuse at the next promote."""
    cache, root = tmp_path / "new" / "cache", short_dir()
    old = os.umask(0o002)
    try:
        promote(tiny_ckpt, socket_root=root, cache_dir=cache, progress=False)
        assert os.stat(cache).st_mode & 0o777 == 0o700
        promote(tiny_ckpt, socket_root=root, cache_dir=cache, progress=False)
    finally:
        os.umask(old)
        shutil.rmtree(root, ignore_errors=True)
