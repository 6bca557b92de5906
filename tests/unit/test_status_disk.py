"""``status`` tells what an engine started on a daemon's folder would find now.

A table: one row per way the folder (or its manifest) can differ from what
the daemon serves, each judged by ``status``'s disk check
(:func:`preload.daemon.status.check_disk`, the engines' own restart check)
on a record of a daemon serving the promoted digest, with the state, cause,
shard and stat fields it must name; the first row, nothing changed, is the
control. Then: every folder in one round of stats; a daemon of another
release named, not called dead; and end to end, ``status`` on a live
daemon before and after its folder is edited in place (field case t13).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from daemon_support import REPO, Daemon, repo_pythonpath, short_dir
from reliability_support import fresh_checkpoint

from preload import protocol
from preload.daemon import status
from preload.daemon.raw import raw_key
from preload.daemon.status import DaemonRecord, DiskCheck, StatusReport, StoredRecord, StoreState
from preload.identity import filestat
from preload.identity import manifest as manifest_mod
from preload.identity.key import WeightCacheKey
from preload.identity.manifest import manifest_path
from preload.promote import promote

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="status_disk")]


def _promoted(tmp: Path, name: str, seed: int = 3) -> tuple[Path, Path, str]:
    ckpt = fresh_checkpoint(tmp / name, seed=seed, shards=2)
    cache = tmp / "cache"
    digest = promote(ckpt, socket_root=tmp / "sock", cache_dir=cache, progress=False).digest
    return Path(os.path.realpath(ckpt)), cache, digest


def _record(ckpt: Path, cache: Path, digest: str, pid: int = 4242) -> DaemonRecord:
    """A raw daemon's record as its stats answer gives it: its key read from the folder when it started."""
    return DaemonRecord(socket=f"/run/pg/{digest[:16]}/rank0.sock", socket_root="/run/pg", serving=True, pid=pid,
                        rank=0, digest=digest, checkpoint=str(ckpt), cache_dir=str(cache), launcher_pid=pid - 1,
                        command="preload-gate preload CKPT --stage raw", stage="raw", transport="shm",
                        key=raw_key(ckpt, digest, "shm").to_json())


def _shard(ckpt: Path) -> Path:
    return sorted(ckpt.glob("*.safetensors"))[0]


def _edit_in_place(ckpt: Path, cache: Path) -> None:
    p = _shard(ckpt)
    with open(p, "r+b") as f:
        f.seek(p.stat().st_size - 8)
        f.write(b"\x11" * 8)


def _touch(ckpt: Path, cache: Path) -> None:
    os.utime(_shard(ckpt))


def _remove_shard(ckpt: Path, cache: Path) -> None:
    _shard(ckpt).unlink()


def _add_weights(ckpt: Path, cache: Path) -> None:
    shutil.copy(_shard(ckpt), ckpt / "zz-extra.safetensors")


def _drop_manifest(ckpt: Path, cache: Path) -> None:
    manifest_path(ckpt, cache).unlink()


def _promote_edit(ckpt: Path, cache: Path) -> None:
    _edit_in_place(ckpt, cache)
    promote(ckpt, socket_root=cache.parent / "sock", cache_dir=cache, progress=False)


def _loosen_manifest(ckpt: Path, cache: Path) -> None:
    os.chmod(manifest_path(ckpt, cache), 0o666)


def _move_away(ckpt: Path, cache: Path) -> None:
    ckpt.rename(ckpt.with_name(ckpt.name + "-moved"))


def _edit_config(ckpt: Path, cache: Path) -> None:
    """One value changed in place, the file's size kept: no shard's stat moves."""
    p = ckpt / "config.json"
    text = p.read_text()
    p.write_text(text.replace('"rope_theta": 10000.0', '"rope_theta": 20000.0'))
    assert p.read_text() != text and len(p.read_text()) == len(text)


def _rename_architecture(ckpt: Path, cache: Path) -> None:
    p = ckpt / "config.json"
    p.write_text(p.read_text().replace("LlamaForCausalLM", "MistralForCausalLM"))


def _reformat_config(ckpt: Path, cache: Path) -> None:
    """The same object, other spacing and key order: the canonical form (the key's digest) is unchanged."""
    p = ckpt / "config.json"
    p.write_text(json.dumps(dict(reversed(list(json.loads(p.read_text()).items()))), indent=4))


def _remove_config(ckpt: Path, cache: Path) -> None:
    (ckpt / "config.json").unlink()


def _replace_config(ckpt: Path, cache: Path) -> None:
    """Edited as most editors save: a new file renamed over the old (the folder's entries change)."""
    p = ckpt / "config.json"
    p.with_name("config.json.tmp").write_text(p.read_text().replace("10000.0", "20000.0"))
    os.replace(p.with_name("config.json.tmp"), p)


def _break_config(ckpt: Path, cache: Path) -> None:
    (ckpt / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')


# row -> (change, state, cause, shard ("first": the first shard), words the reason or fields hold)
ROWS: dict[str, tuple[Callable[[Path, Path], None] | None, str, str, str | None, str]] = {
    "control: nothing changed": (None, "fresh", "", None, ""),
    "edited in place": (_edit_in_place, "stale", "changed", "first", "mtime_ns, ctime_ns"),
    "touched": (_touch, "stale", "changed", "first", "mtime_ns"),
    "shard removed": (_remove_shard, "stale", "changed", "first", "removed"),
    "weights added": (_add_weights, "stale", "changed", None, "zz-extra.safetensors added"),
    "manifest removed": (_drop_manifest, "stale", "no_manifest", None, "no promotion manifest"),
    "promoted again": (_promote_edit, "stale", "promoted_again", None, "promoted again as"),
    "manifest others can write": (_loosen_manifest, "unknown", "", None, "group/world"),
    "folder moved away": (_move_away, "stale", "changed", None, "cannot stat the checkpoint directory"),
    # config.json is no shard: the manifest's stats do not see it, the key's config_digest does.
    "config.json edited in place (same size)": (_edit_config, "stale", "config", "config.json", "config_digest "),
    "config.json architecture renamed": (_rename_architecture, "stale", "config", "config.json",
                                         "architecture LlamaForCausalLM -> MistralForCausalLM"),
    "control: config.json reformatted": (_reformat_config, "fresh", "", None, ""),
    # Removed or renamed over: the folder's entries change, which the engines' stat check sees first.
    "config.json removed": (_remove_config, "stale", "changed", None, "config.json removed"),
    "config.json replaced by rename": (_replace_config, "stale", "changed", None, "config.json"),
    "config.json invalid": (_break_config, "stale", "config", "config.json", "not readable JSON"),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_disk_check(tmp_path: Path, row: str) -> None:
    change, state, cause, shard, words = ROWS[row]
    ckpt, cache, digest = _promoted(tmp_path, "m")
    first = _shard(ckpt).name
    rec = _record(ckpt, cache, digest)  # the daemon started on the folder as promoted
    if change is not None:
        change(ckpt, cache)
    status.check_disk([rec])
    d = rec.disk
    assert d is not None
    assert (d.state, d.cause) == (state, cause), f"{row}: {d}"
    assert d.shard == (first if shard == "first" else shard), f"{row}: {d}"
    assert words in d.reason + " " + d.fields, f"{row}: {d}"
    line = status.disk_line(rec)
    if state == "stale":
        assert line.startswith(f"stale: {ckpt}") and "engines on it will miss; run: " in line, line
        if cause == "config":
            _check_config_row(rec, ckpt, digest, words)
        else:
            assert "stop this one (kill 4241)" in d.fix and "as this one was: preload-gate preload" in d.fix
        promote = f"preload-gate promote {ckpt} --cache-dir {cache}"
        if row == "config.json removed":  # promote alone would leave the key's config_digest behind
            assert d.fix.startswith(f"restore {ckpt / 'config.json'}") and f"then {promote}" in d.fix, d.fix
        elif row == "folder moved away":  # a promote of the old path fails: stop this one, promote the new one
            assert d.fix.startswith(f"stop this one (kill 4241): {ckpt} is gone"), d.fix
            assert "preload-gate promote NEW_PATH" in d.fix and promote not in d.fix, d.fix
        elif cause not in ("promoted_again", "config"):
            assert d.fix.startswith(promote), d.fix
        if row == "config.json replaced by rename":  # the same weights: promote prints the same digest
            assert f"if it prints {digest[:16]}, stop this one (kill 4241) first, then start it again" in d.fix, d.fix
    elif state == "fresh":
        assert d.manifest_digest == digest and line.startswith(f"fresh: {ckpt} matches"), line


def _check_config_row(rec: DaemonRecord, ckpt: Path, digest: str, words: str) -> None:
    """A config.json row: the line as the task names it, the fix, and the key an engine (a raw consumer)
    builds from the folder now differs from the daemon's in exactly the fields status names."""
    d = rec.disk
    assert d is not None
    line = status.disk_line(rec)
    assert line.startswith(f"stale: {ckpt} changed (config.json: "), line
    assert "preload-gate promote" not in d.fix, d.fix  # the weights are the promoted ones: no re-promote
    if (ckpt / "config.json").is_file() and "readable" not in words:
        # Same content digest: the same socket dir and rank lock, so this one stops first.
        assert d.fix.startswith("stop this one (kill 4241) first"), d.fix
        assert "then start it again (as this one was: preload-gate preload" in d.fix, d.fix
        named = [part.split()[0] for part in d.fields.split(", ")]
        engine = raw_key(ckpt, digest, "shm")
        assert engine.mismatched_fields(WeightCacheKey.from_json(rec.key)) == named, (named, d.fields)
        old, new = rec.key["config_digest"], engine.config_digest  # type: ignore[index]
        assert f"config_digest {old[:16]} -> {new[:16]}" in d.fields, d.fields
    else:
        assert d.fix.startswith(f"restore {ckpt / 'config.json'}"), d.fix


def test_the_fields_a_stale_line_names(tmp_path: Path) -> None:
    ckpt, cache, digest = _promoted(tmp_path, "m")
    _edit_in_place(ckpt, cache)
    rec = _record(ckpt, cache, digest)
    status.check_disk([rec])
    first = _shard(ckpt).name
    assert status.disk_line(rec).startswith(
        f"stale: {ckpt} changed ({first}: mtime_ns, ctime_ns); engines on it will miss; run: preload-gate promote ")


def test_a_newer_daemon_for_the_new_digest_supersedes(tmp_path: Path) -> None:
    ckpt, cache, old = _promoted(tmp_path, "m")
    _promote_edit(ckpt, cache)
    new = manifest_mod.load_manifest(ckpt, cache).digest  # type: ignore[union-attr]
    a, b = _record(ckpt, cache, old, pid=100), _record(ckpt, cache, new, pid=200)
    status.check_disk([a, b])
    assert a.disk is not None and b.disk is not None
    assert (a.disk.state, b.disk.state) == ("superseded", "fresh")
    assert "served by pid 200" in a.disk.reason and a.disk.fix == "stop this one (kill 99)"


def test_every_daemon_folder_in_one_round_of_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two daemons on two folders (one edited) and a third rank of the first:
    one ``stat_all`` call in all, and the engines' check makes none of its own."""
    calls: list[int] = []
    real = filestat.stat_all

    def counting(paths):  # type: ignore[no-untyped-def]
        calls.append(len(paths))
        return real(paths)

    monkeypatch.setattr(filestat, "stat_all", counting)
    monkeypatch.setattr(manifest_mod, "stat_all", counting)
    a, cache, da = _promoted(tmp_path, "a", seed=1)
    b, _, db = _promoted(tmp_path, "b", seed=2)
    _edit_in_place(b, cache)
    recs = [_record(a, cache, da), _record(b, cache, db), dataclass_rank(_record(a, cache, da), 1)]
    status.check_disk(recs)
    assert [r.disk.state for r in recs if r.disk] == ["fresh", "stale", "fresh"]
    assert len(calls) == 1, calls
    # Control: the engines' check on its own stats each folder once more.
    assert manifest_mod.stale_reason(a, manifest_mod.load_manifest(a, cache)) is None  # type: ignore[arg-type]
    assert len(calls) == 2


def dataclass_rank(r: DaemonRecord, rank: int) -> DaemonRecord:
    return msgspec.structs.replace(r, rank=rank, socket=r.socket.replace("rank0", f"rank{rank}"))


def test_a_daemon_of_another_release_is_named_not_called_dead(tmp_path: Path) -> None:
    """A socket whose daemon answers hello with a version refusal (what a
    release-1 daemon says to a release-2 status) is listed as that refusal."""
    root = short_dir("pg-sv-")
    sdir = root / ("ab" * 8)
    sdir.mkdir(mode=0o700)
    path = sdir / "rank0.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    os.chmod(path, 0o600)
    srv.listen(1)

    def old_daemon() -> None:
        conn, _ = srv.accept()
        with conn:
            protocol.recv_frame(conn, 5.0)
            protocol.send_frame(conn, protocol.error_reply(
                f"protocol version {protocol.PROTOCOL_VERSION} is not 1; run the daemon and the engine from the "
                "same preload-gate release"))

    t = threading.Thread(target=old_daemon, daemon=True)
    t.start()
    try:
        (rec,) = status.scan(root)
    finally:
        t.join(10)
        srv.close()
        shutil.rmtree(root, ignore_errors=True)
    assert not rec.serving and rec.refused and "is not 1" in rec.refused
    line = status.render(StatusReport("r", [], "x", [rec], [], []), root)[0]
    assert line == f"{path}: a daemon answers but refused us: {rec.refused}"
    assert "stale socket" not in line


def test_the_json_shape_is_documented() -> None:
    """Every field ``status --json`` prints is named in docs/daemon.md."""
    doc = (REPO / "docs" / "daemon.md").read_text()
    for struct in (StatusReport, DaemonRecord, DiskCheck, StoredRecord, StoreState):
        for name in struct.__struct_fields__:
            assert f"`{name}`" in doc, f"{struct.__name__}.{name} is not documented in docs/daemon.md"


# ------------------------------------------------------------------ end to end (t13)

def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "preload_gate.cli", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=180)


def test_status_on_a_live_daemon_before_and_after_its_folder_changes(tmp_path: Path) -> None:
    ckpt = fresh_checkpoint(tmp_path / "m", seed=4)
    root, cache = short_dir("pg-st-"), tmp_path / "cache"
    env = {**os.environ, "PRELOAD_GATE_CACHE": str(cache), "PYTHONPATH": repo_pythonpath()}
    env.pop("PRELOAD_GATE_SOCKET_ROOT", None)
    promote(ckpt, socket_root=root, cache_dir=cache, progress=False)
    d = Daemon(ckpt, root, cache).start()
    real = os.path.realpath(ckpt)
    try:
        fresh = _cli(env, "status", "--socket-root", str(root))
        assert fresh.returncode == 0, fresh.stderr
        assert f"fresh: {real} matches its promotion manifest" in fresh.stdout, fresh.stdout
        assert "stale" not in fresh.stdout  # the control
        for want in (d.ready["digest"], "raw/shm", "0 attached", "key      tp 0/1"):
            assert want in fresh.stdout, (want, fresh.stdout)

        _edit_in_place(Path(real), cache)
        stale = _cli(env, "status", "--socket-root", str(root))
        first = _shard(Path(real)).name
        want = (f"stale: {real} changed ({first}: mtime_ns, ctime_ns); engines on it will miss; "
                f"run: preload-gate promote {real} --cache-dir {cache}; if it prints a digest other than "
                f"{d.ready['digest'][:16]}, start a daemon for it (as this one was: preload-gate preload {ckpt} "
                f"--socket-root {root} --cache-dir {cache} --stage raw)")  # its cache came from its environment
        assert want in stale.stdout, stale.stdout
        assert f"and stop this one (kill {d.proc.pid})" in stale.stdout  # type: ignore[union-attr]
        # What an engine's stat check says, the same reason (the dry run runs it).
        dry = _cli(env, "preload", str(ckpt), "--stage", "raw", "--socket-root", str(root), "--dry-run")
        assert dry.returncode == 2 and f"{first} changed (mtime_ns, ctime_ns)" in dry.stderr, dry.stderr

        doc = msgspec.json.decode(_cli(env, "status", "--socket-root", str(root), "--json").stdout,
                                  type=StatusReport)
        assert doc.format == status.FORMAT
        (rec,) = doc.ranks
        assert rec.disk is not None and (rec.disk.state, rec.disk.shard, rec.disk.fields) == (
            "stale", first, "mtime_ns, ctime_ns")
        assert (rec.checkpoint, rec.digest, rec.stage, rec.transport, rec.attached) == (
            real, d.ready["digest"], "raw", "shm", 0)
        assert rec.key and rec.key["content_digest"] == d.ready["digest"]
        assert set(json.loads(_cli(env, "status", "--socket-root", str(root), "--json").stdout)["ranks"][0]) == set(
            DaemonRecord.__struct_fields__)  # every field present, null where it does not apply

        # The printed first step: promote. New content: the daemon is now the old digest's.
        assert _cli(env, "promote", real).returncode == 0
        after = _cli(env, "status", "--socket-root", str(root))
        assert f"stale: {real} was promoted again as " in after.stdout, after.stdout
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_status_on_a_live_daemon_whose_config_json_is_edited_in_place(tmp_path: Path) -> None:
    """config.json is no shard: an edit in place (same size) moves no stat the
    manifest holds, yet every engine on the folder then misses on
    config_digest. ``status`` says so, naming config.json (control: the
    untouched folder is fresh), the key a raw consumer builds from the folder
    differs in that field, and the printed fix (stop, start as it was; no
    promote) makes the folder fresh again."""
    import shlex

    from preload.daemon.ready import READY, start_preload, stop_daemon, wait_ready

    ckpt = fresh_checkpoint(tmp_path / "m", seed=5)
    root, cache = short_dir("pg-sc-"), tmp_path / "cache"
    env = {**os.environ, "PRELOAD_GATE_CACHE": str(cache), "PYTHONPATH": repo_pythonpath()}
    env.pop("PRELOAD_GATE_SOCKET_ROOT", None)
    digest = promote(ckpt, socket_root=root, cache_dir=cache, progress=False).digest
    d = Daemon(ckpt, root, cache).start()
    again = None

    def report() -> DaemonRecord:
        out = _cli(env, "status", "--socket-root", str(root), "--json")
        assert out.returncode == 0, out.stderr
        (rec,) = msgspec.json.decode(out.stdout, type=StatusReport).ranks
        assert rec.disk is not None
        return rec

    try:
        before = report()
        assert before.disk is not None and before.disk.state == "fresh", before.disk  # the control
        _edit_config(ckpt, cache)
        rec = report()
        assert rec.disk is not None and (rec.disk.state, rec.disk.cause, rec.disk.shard) == (
            "stale", "config", "config.json"), rec.disk
        engine = raw_key(ckpt, digest, "shm")  # what a raw consumer on the folder keys now
        daemon = WeightCacheKey.from_json(rec.key)
        assert engine.mismatched_fields(daemon) == ["config_digest"]
        assert rec.disk.fields == (f"config_digest {daemon.config_digest[:16]} -> "  # type: ignore[index]
                                   f"{engine.config_digest[:16]}")  # type: ignore[index]
        line = _cli(env, "status", "--socket-root", str(root)).stdout
        assert (f"stale: {os.path.realpath(ckpt)} changed (config.json: {rec.disk.fields}); engines on it will "
                f"miss; run: stop this one (kill {d.proc.pid}) first, then start it again (as this one was: "  # type: ignore[union-attr]
                f"{rec.command})") in line, line

        # The fix as printed: stop, then the command (no promote); the folder is fresh again.
        d.stop()
        assert rec.command is not None
        argv = shlex.split(rec.command)
        assert argv[:2] == ["preload-gate", "preload"]
        again = start_preload(argv[2:], env=env, cwd=tmp_path, stderr=subprocess.DEVNULL)
        wait_ready(again, READY, 120)
        after = report()
        assert after.disk is not None and after.disk.state == "fresh", after.disk
        assert WeightCacheKey.from_json(after.key).config_digest == engine.config_digest
    finally:
        d.stop()
        if again is not None:
            stop_daemon(again, 30)
        shutil.rmtree(root, ignore_errors=True)
