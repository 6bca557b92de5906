"""The loader's extra config and the load event, without vLLM."""

from __future__ import annotations

import json
import logging
import sys
import threading

import pytest

from preload.events import LOG_PREFIX, LoadEvent, emit, read_events
from preload.loader import LoaderConfigError, LoaderOptions

pytestmark = pytest.mark.unit


def test_defaults_are_safe():
    o = LoaderOptions.from_extra(None)
    assert (o.mode, o.fallback, o.identity, o.unsafe_identity, o.unsafe_silent_fallback) == (
        "zero_copy", True, "stat", None, False)


def test_every_documented_key_parses(monkeypatch):
    monkeypatch.setenv("PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS", "1")
    o = LoaderOptions.from_extra({
        "socket_root": "/r", "socket_dir": "/r/x", "mode": "copy", "fallback": False, "identity": "pinned",
        "expected_digest": "ab" * 32, "verify_resident": True, "events_file": "/e", "connect_timeout_s": 1,
        "state_timeout_s": 2.5, "unsafe_identity": "header_only", "unsafe_silent_fallback": True,
    })
    assert o.mode == "copy" and o.connect_timeout_s == 1.0 and o.unsafe_identity == "header_only"


@pytest.mark.parametrize("extra, match", [
    ({"sockt_root": "/r"}, "unknown verified_cache extra config keys: \\['sockt_root'\\]"),
    ({"mode": "mmap"}, "mode 'mmap'"),
    ({"fallback": "no"}, "'fallback' must be true or false"),
    ({"identity": "vibes"}, "identity 'vibes'"),
    ({"identity": "pinned"}, "needs expected_digest"),
    ({"connect_timeout_s": 0}, "positive number"),
    ({"connect_timeout_s": True}, "positive number"),
    ({"unsafe_identity": "sampled_1k"}, "must be 'header_only'"),
    ({"socket_root": 5}, "must be a string"),
    ({"identity": "pinned", "expected_digest": "g" * 64}, "'expected_digest' 'gggg.* is not hex"),
])
def test_bad_extra_config_is_one_clear_error(extra, match):
    with pytest.raises(LoaderConfigError, match=match):
        LoaderOptions.from_extra(extra)


@pytest.mark.parametrize("extra", [{"unsafe_identity": "header_only"}, {"unsafe_silent_fallback": True},
                                   {"unsafe_uncounted_memory": True}])
def test_negative_controls_need_the_test_only_switch(monkeypatch, extra):
    """Refused by name without PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS=1; accepted
    with it (control)."""
    monkeypatch.delenv("PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS", raising=False)
    with pytest.raises(LoaderConfigError, match="PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS=1"):
        LoaderOptions.from_extra(extra)
    monkeypatch.setenv("PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS", "1")
    LoaderOptions.from_extra(extra)


def test_loader_module_imports_without_vllm():
    import subprocess

    code = "import sys, preload.loader; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_event_is_one_line_in_file_and_log(tmp_path, caplog):
    path = tmp_path / "events.jsonl"
    ev = LoadEvent(outcome="miss", reason="no daemon for this digest", fields=["content_digest"],
                   digest="ab" * 32, rank=1, source="disk")
    with caplog.at_level(logging.INFO, logger="preload.load"):
        emit(ev, str(path))
    assert read_events(path) == [ev.to_json()]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(LOG_PREFIX)]
    assert len(lines) == 1 and json.loads(lines[0][len(LOG_PREFIX):]) == ev.to_json()
    assert caplog.records[-1].levelno == logging.WARNING  # a miss is loud
    expected = {"outcome", "reason", "fields", "digest", "daemon_digest", "mode", "seconds", "tensors",
                "bytes", "rank"}
    assert expected <= set(ev.to_json())


def test_events_env_and_concurrent_ranks_do_not_interleave(tmp_path, monkeypatch):
    path = tmp_path / "ev.jsonl"
    monkeypatch.setenv("PRELOAD_GATE_EVENTS", str(path))
    threads = [threading.Thread(target=emit, args=(LoadEvent(outcome="hit", reason="x" * 2000, rank=r),))
               for r in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(e["rank"] for e in read_events(path)) == list(range(16))


def test_outcome_is_checked():
    with pytest.raises(ValueError, match="outcome"):
        LoadEvent(outcome="maybe", reason="")


@pytest.mark.parametrize("kind,configured,want", [
    ("cuda", None, True),    # default on where a zero-copy engine can write the daemon's memory
    ("shm", None, False),    # a sealed, MAP_PRIVATE arena cannot change
    ("cuda", False, False),  # an explicit setting wins
    ("shm", True, True),
])
def test_verify_resident_defaults_on_for_cuda_arenas(kind, configured, want):
    from types import SimpleNamespace

    from preload.loader.resident import should_verify

    extra = {} if configured is None else {"verify_resident": configured}
    state = SimpleNamespace(descriptor={"kind": kind})
    assert should_verify(LoaderOptions.from_extra(extra), state) is want
