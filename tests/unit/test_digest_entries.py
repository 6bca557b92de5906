"""Every entry that takes a digest from outside reads it by the one rule.

A 64-character value that is not hex (``BAD``) is the row that matters: it
has the right length, so a check of the length alone lets it through. Each
entry refuses it in one line naming its flag or field (a verb: exit 2);
each has a control where a good value is accepted (upper case, read as
lower case, wherever the entry hands the digest back), so the refusal is the
digest check's doing.

The flags (``preload --expect-digest``, ``canary check --expect-digest``)
are rows of tests/unit/test_cli_bad_input.py, which also checks that nothing
is written.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from test_canary_check import make_golden

from canaries.claims import parse_metrics
from canaries.errors import GoldenError
from pgbase.errors import DigestFormatError, ProtocolError
from preload import protocol
from preload.client import DaemonClient
from preload.daemon.launcher import PreloadOptions, expected_digest
from preload.identity.digest import checkpoint_digest
from preload.identity.key import WeightCacheKey
from preload.identity.manifest import manifest_path, resolve_digest
from preload.loader import LoaderConfigError, LoaderOptions
from preload.promote import promote
from preload_gate.cli import main as cli_main

pytestmark = pytest.mark.unit

GOOD = "0123456789abcdef" * 4
BAD = "g" * 64  # the right length, not hex


def _one_line(exc: BaseException, *needles: str) -> None:
    msg = str(exc)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """Exit code and non-empty stderr lines of one in-process ``preload-gate`` run."""
    capsys.readouterr()
    try:
        rc = cli_main(argv)
    except SystemExit as exc:  # argparse's usage errors
        rc = int(exc.code or 0)
    return rc, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def test_resolve_digest_pinned_refuses_a_64_character_non_hex_digest(tmp_path: Path) -> None:
    """The bug: pinned mode checked only the length, so BAD became the
    checkpoint's identity (and named a socket directory) unread."""
    with pytest.raises(DigestFormatError) as info:
        resolve_digest(tmp_path, mode="pinned", expected_digest=BAD)
    _one_line(info.value, "expected_digest", "not hex", "preload-gate promote")
    assert resolve_digest(tmp_path, mode="pinned", expected_digest=GOOD.upper()).digest == GOOD


def test_loader_expected_digest_is_read_by_the_rule() -> None:
    with pytest.raises(LoaderConfigError) as info:
        LoaderOptions.from_extra({"identity": "pinned", "expected_digest": BAD})
    _one_line(info.value, "verified_cache extra config 'expected_digest'", "not hex")
    # Upper case is read as lower case here too (it was kept as typed).
    assert LoaderOptions.from_extra({"identity": "pinned", "expected_digest": GOOD.upper()}).expected_digest == GOOD


def test_preload_options_expect_digest_is_read_by_the_rule(tmp_path: Path) -> None:
    """The launcher's own reading, for callers of the Python API (the verb's
    flag is refused earlier, by argparse: test_cli_bad_input.py)."""
    with pytest.raises(DigestFormatError) as info:
        expected_digest(PreloadOptions(checkpoint=str(tmp_path), expect_digest=BAD))
    _one_line(info.value, "--expect-digest", "not hex")
    assert expected_digest(PreloadOptions(checkpoint=str(tmp_path), expect_digest=GOOD.upper())) == (
        GOOD, "--expect-digest")


def test_golden_file_digest_is_refused_by_canary_check(tmp_path: Path, capsys) -> None:
    golden = make_golden().to_json()
    path = tmp_path / "golden.json"
    argv = ["canary", "check", "--golden", str(path), "--base-url", "http://127.0.0.1:9"]
    path.write_text(json.dumps({**golden, "digest": BAD}))
    rc, err = _cli(argv, capsys)
    assert rc == 2 and len(err) == 1, err
    assert f"{path}: digest" in err[0] and "not hex" in err[0], err
    # Control: the same golden with the digest upper-cased loads (the check then
    # fails on the unreachable replica, exit 1, not on the golden).
    path.write_text(json.dumps({**golden, "digest": golden["digest"].upper()}))
    rc, err = _cli(argv + ["--retries", "0", "--timeout", "0.5"], capsys)
    assert rc == 1, err


def test_events_file_digest_is_refused_by_canary_check(tmp_path: Path, capsys) -> None:
    golden = tmp_path / "golden.json"
    golden.write_text(json.dumps(make_golden().to_json()))
    events = tmp_path / "events.jsonl"
    argv = ["canary", "check", "--golden", str(golden), "--base-url", "http://127.0.0.1:9",
            "--events-file", str(events), "--retries", "0", "--timeout", "0.5"]
    events.write_text(json.dumps({"outcome": "hit", "reason": "r", "digest": GOOD, "daemon_digest": BAD}) + "\n")
    rc, err = _cli(argv, capsys)
    assert rc == 2 and len(err) == 1, err
    assert "daemon_digest" in err[0] and "not hex" in err[0], err
    # Control: a good daemon digest (another content's) is read, and refused as a claim.
    events.write_text(json.dumps({"outcome": "hit", "reason": "r", "digest": GOOD, "daemon_digest": GOOD}) + "\n")
    rc, err = _cli(argv, capsys)
    assert rc == 2 and len(err) == 1 and "refusing golden" in err[0], err


def test_metrics_digest_label_is_read_by_the_rule() -> None:
    """A serving rank whose digest label is malformed is named, not skipped
    (skipping it read as "no serving rank", or let another rank's claim stand)."""
    up = 'preload_gate_rank_up{{socket="/s/rank0.sock",rank="0",digest="{}"}} 1\n'
    with pytest.raises(GoldenError) as info:
        parse_metrics(up.format(BAD), "daemon metrics at m")
    _one_line(info.value, "daemon metrics at m: a serving rank's digest label", "not hex")
    assert parse_metrics(up.format(GOOD.upper()), "m").digest == GOOD


@pytest.mark.usefixtures("no_vllm")  # vLLM's file selection is not under test; its import costs seconds
def test_manifest_digests_are_read_by_the_rule(tiny_ckpt: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """A manifest whose shard sha256 is not hex, with a top-level digest that
    matches it (so the "implied digest" check alone passes it), is refused
    by name when the daemon reads it: exit 2, one line, re-promote."""
    cache, sockets = tmp_path / "cache", tmp_path / "sockets"
    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(cache))
    monkeypatch.setenv("PRELOAD_GATE_SOCKET_ROOT", str(sockets))
    promo = promote(tiny_ckpt, socket_root=sockets, cache_dir=cache)
    assert expected_digest(PreloadOptions(checkpoint=str(tiny_ckpt))) == (promo.digest, "manifest")  # control
    path = manifest_path(tiny_ckpt, cache)
    obj = json.loads(path.read_text())
    obj["shards"][0]["sha256"] = BAD
    obj["digest"] = checkpoint_digest({s["name"]: s["sha256"] for s in obj["shards"]})
    path.write_text(json.dumps(obj))
    rc, err = _cli(["preload", str(tiny_ckpt), "--stage", "raw", "--dry-run"], capsys)
    assert rc == 2 and len(err) == 1, err
    assert f"shard {obj['shards'][0]['name']}'s sha256" in err[0] and "run: preload-gate promote" in err[0], err


def test_get_state_reply_digest_is_read_by_the_rule() -> None:
    """The daemon's digest, from the wire: a malformed one is a ProtocolError
    (the engine's fallback type), one line; upper case is read as lower."""
    key = WeightCacheKey(content_digest=GOOD)

    def get_state(digest: str):
        engine, daemon = socket.socketpair()
        with engine, daemon:
            # The reply waits in the socket buffer before the request is sent.
            protocol.send_frame(daemon, {"status": "ok", "digest": digest, "entries": [], "total_bytes": 0,
                                         "key": key.to_json(), "descriptor": {}, "daemon_id": "d", "stage": "raw"})
            return DaemonClient(engine, Path("/fake/rank0.sock"), 5.0).get_state(key)

    with pytest.raises(ProtocolError) as info:
        get_state(BAD)
    _one_line(info.value, "get_state reply is malformed", "not hex")
    assert get_state(GOOD.upper()).digest == GOOD
