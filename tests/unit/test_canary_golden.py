"""Golden recording's failure paths, without an engine: a stub worker stands in for vLLM."""

from __future__ import annotations

import json
import time

import pytest
from daemon_support import process_gone

from canaries import golden as golden_mod
from canaries.errors import GoldenError
from pgbase.errors import CheckpointError
from pgbase.shards import shard_paths

pytestmark = pytest.mark.unit


def stub_result(n_prompts: int, max_tokens: int = 16) -> dict:
    prompt = {"prompt": "p", "prompt_token_ids": [1, 2], "token_ids": [7] * max_tokens, "text": "x",
              "token_logprobs": [-0.5] * max_tokens, "top_logprobs": [{"7": -0.5}] * max_tokens}
    return {"ok": True, "vllm_version": "0.32.0", "prompts": [prompt] * n_prompts, "token_texts": {"7": "seven"}}


def test_record_writes_a_golden_keyed_by_an_independent_digest(tiny_ckpt, tmp_path, monkeypatch) -> None:
    from canaries.golden import load_golden, record
    from preload.identity.digest import content_digest

    monkeypatch.setattr(golden_mod, "_run_worker", lambda spec, timeout_s, *_say: stub_result(len(spec["prompts"])))
    out = tmp_path / "g.json"
    g = record(tiny_ckpt, out, prompts=["a", "b"])
    assert g.digest == content_digest(tiny_ckpt)
    assert load_golden(out).key() == g.key()
    assert json.loads(out.read_text())["engine"]["load_format"] == "auto"


def test_the_default_golden_covers_the_prompts_the_gate_compares(tiny_ckpt, tmp_path, monkeypatch) -> None:
    """A passing promotion gate records the golden with the default prompts
    (harness.gate.golden); the canaries later check a replica on exactly the
    prompts the gate's engines compared, not a second list that drifted."""
    from harness.engine import EngineSpec

    sent: list[list[str]] = []

    def worker(spec: dict, timeout_s: float, *_say) -> dict:
        sent.append(list(spec["prompts"]))
        return stub_result(len(spec["prompts"]))

    monkeypatch.setattr(golden_mod, "_run_worker", worker)
    golden_mod.record(tiny_ckpt, tmp_path / "g.json")
    assert sent == [list(EngineSpec(checkpoint=str(tiny_ckpt)).prompts)]


def test_checkpoint_edited_during_recording_is_refused(tiny_ckpt, tmp_path, monkeypatch) -> None:
    from fixtures.mutations import copy_checkpoint

    ckpt = copy_checkpoint(tiny_ckpt, tmp_path / "ckpt")
    shard = shard_paths(ckpt)[0]

    def editing_worker(spec: dict, timeout_s: float, *_say) -> dict:
        data = bytearray(shard.read_bytes())
        data[-1] ^= 1  # what an rsync landing mid-recording looks like
        time.sleep(0.01)
        shard.write_bytes(bytes(data))
        return stub_result(len(spec["prompts"]))

    monkeypatch.setattr(golden_mod, "_run_worker", editing_worker)
    out = tmp_path / "g.json"
    with pytest.raises(GoldenError, match="changed while the golden was being recorded"):
        golden_mod.record(ckpt, out)
    assert not out.exists()
    # Control: the same recording without the edit succeeds.
    monkeypatch.setattr(golden_mod, "_run_worker", lambda spec, timeout_s, *_say: stub_result(len(spec["prompts"])))
    golden_mod.record(ckpt, out)
    assert out.exists()


def test_hung_recording_engine_is_killed_within_timeout(tiny_ckpt, tmp_path, monkeypatch) -> None:
    marker = tmp_path / "child.pid"
    # A stand-in engine that leaves a child behind and hangs, as vLLM's CPU engine core can.
    code = ("import os, subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(marker)!r}, 'w').write(str(c.pid)); time.sleep(600)")
    monkeypatch.setattr(golden_mod, "_WORKER_ARGS", ("-c", code))
    t0 = time.monotonic()
    with pytest.raises(GoldenError, match="timed out after 2 s"):
        golden_mod.record(tiny_ckpt, tmp_path / "g.json", timeout_s=2)
    # Killed at its 2 s timeout (the message says so), not waited out: it
    # sleeps 600 s. The wall bound is only that; record() hashes the
    # checkpoint and reads its tokenizer first, which a loaded machine slows.
    assert time.monotonic() - t0 < 300
    child = int(marker.read_text())
    assert process_gone(child)


def test_failed_recording_engine_is_one_error_with_its_reason(tiny_ckpt, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(golden_mod, "_WORKER_ARGS", ("-c", "import sys; print('boom: no engine'); sys.exit(3)"))
    with pytest.raises(GoldenError, match="exited with code 3 and wrote no result(.|\n)*boom: no engine"):
        golden_mod.record(tiny_ckpt, tmp_path / "g.json", timeout_s=30)
    assert not (tmp_path / "g.json").exists()


def test_bad_inputs(tmp_path) -> None:
    with pytest.raises(CheckpointError):
        golden_mod.record(tmp_path / "absent", tmp_path / "g.json")
    with pytest.raises(GoldenError, match="max_tokens"):
        golden_mod.Sampling(max_tokens=0)
    from canaries.prompts import load_prompts

    (tmp_path / "p.txt").write_text("\n  \n")
    with pytest.raises(GoldenError, match="holds no prompt"):
        load_prompts(tmp_path / "p.txt")
    (tmp_path / "p.json").write_text('["a", 3]')
    with pytest.raises(GoldenError, match="list of strings"):
        load_prompts(tmp_path / "p.json")
    (tmp_path / "q.txt").write_text("one\n\ntwo\n")
    assert load_prompts(tmp_path / "q.txt") == ("one", "two")
