"""vLLM's fast loaders as gate targets, without an engine: why each cannot run,
the engine each asks for, what tensorizer's notes say, and ``--target all``.

Each row has its control: the same target with the requirement present runs
(``unavailable()`` is None), the reference spec beside the loader's differs
only in the load format and its extra config, a tensorizer file made from the
candidate itself is not called stale. The comparison with vLLM's own
registry and source is tests/cpu/test_loader_formats_vllm.py (it imports vLLM).
"""

from __future__ import annotations

import dataclasses
import io
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import harness.cli
import harness.engine
import harness.gate
import harness.report
import harness.report.terminal
import harness.targets.loaders as loaders
from harness.cli import DEMO_TARGET_NAMES, TARGET_NAMES
from harness.demo import DEMO_TARGETS
from harness.engine import EngineResult, EngineSpec
from harness.gate import GateOptions, run_gate
from harness.mutations import BASE_SETTINGS, case_by_name
from harness.report.terminal import print_summary
from harness.results import CaseResult
from harness.targets import NAMES, get_target
from harness.targets.base import PreparedCache
from harness.targets.judge import judge_served
from harness.targets.tensorizer import TensorizerTarget
from harness.verdict import BLOCK, NOT_RUN, PASS
from preload_gate.cli import main

pytestmark = pytest.mark.unit

LOADER_TARGETS = ("fastsafetensors", "instanttensor", "runai_streamer", "tensorizer")


def _machine(monkeypatch, gpus: int, hip: str | None, packages: set[str], vllm: bool = True) -> None:
    """This machine as the row says: CUDA devices, a ROCm build or not, importable packages, vLLM."""
    monkeypatch.setattr(loaders, "cuda_devices", lambda: gpus)
    monkeypatch.setattr(loaders, "installed_vllm", lambda: ("vllm", "0.33.0") if vllm else None)
    monkeypatch.setattr(loaders, "package_present", lambda name: name in packages)
    monkeypatch.setattr(torch.version, "hip", hip)


ALL_PACKAGES = {"fastsafetensors", "instanttensor", "runai_model_streamer", "tensorizer"}

# target, machine (gpus, hip, packages), the words its reason must hold (None: it runs)
ROWS = [
    ("fastsafetensors", (0, None, set()), ["a CUDA device", "cuda:<device>", "package fastsafetensors",
                                           "pip install fastsafetensors"]),
    ("fastsafetensors", (0, None, ALL_PACKAGES), ["a CUDA device"]),
    ("fastsafetensors", (1, None, set()), ["package fastsafetensors"]),
    ("fastsafetensors", (1, "6.2", ALL_PACKAGES), None),  # vLLM's cuda:N device exists on ROCm too
    ("fastsafetensors", (1, None, ALL_PACKAGES), None),
    ("instanttensor", (0, None, ALL_PACKAGES), ["an NVIDIA CUDA device", "InstantTensor requires NVIDIA GPUs",
                                                "torch sees none"]),
    ("instanttensor", (1, "6.2", ALL_PACKAGES), ["an NVIDIA CUDA device", "a non-NVIDIA GPU"]),
    ("instanttensor", (1, None, set()), ["package instanttensor", "pip install instanttensor"]),
    ("instanttensor", (1, None, ALL_PACKAGES), None),
    ("runai_streamer", (0, None, set()), ["package runai_model_streamer", "pip install runai-model-streamer"]),
    ("runai_streamer", (0, None, ALL_PACKAGES), None),  # no GPU needed: it streams into CPU memory
    ("tensorizer", (0, None, set()), ["package tensorizer", "pip install tensorizer"]),
    ("tensorizer", (0, None, ALL_PACKAGES), None),
]


@pytest.mark.parametrize("name,machine,words", ROWS,
                         ids=[f"{r[0]}-{'runs' if r[2] is None else 'lacks'}-{i}" for i, r in enumerate(ROWS)])
def test_unavailable_names_what_the_machine_lacks(monkeypatch, name, machine, words):
    _machine(monkeypatch, *machine)
    reason = get_target(name).unavailable()
    if words is None:
        assert reason is None
        return
    assert reason is not None and reason.startswith(f"vLLM's {name} loader was not run: this machine lacks ")
    for w in words:
        assert w in reason, (w, reason)
    if machine[0] == 0 and loaders.LOADERS[name].gpu is None:
        assert "CUDA" not in reason  # a CPU loader is never refused for want of a GPU


def test_no_vllm_is_named_too(monkeypatch):
    _machine(monkeypatch, 1, None, ALL_PACKAGES, vllm=False)
    assert get_target("runai_streamer").unavailable().endswith("lacks vLLM (not installed)")
    _machine(monkeypatch, 1, None, ALL_PACKAGES, vllm=True)
    assert get_target("runai_streamer").unavailable() is None  # control


def test_every_row_of_the_table_is_a_loader_and_every_loader_has_rows():
    assert {r[0] for r in ROWS} == set(LOADER_TARGETS) == set(loaders.LOADERS)
    for name in LOADER_TARGETS:
        assert any(r[0] == name and r[2] is None for r in ROWS), f"{name}: no row where it runs (the control)"


# -- the engines each target asks for -------------------------------------------------

SPECS = {
    "fastsafetensors": ("fastsafetensors", None),
    "instanttensor": ("instanttensor", None),
    "runai_streamer": ("runai_streamer", None),
    "tensorizer": ("tensorizer", {"tensorizer_uri": "/w/tensorized/model.tensors"}),
}


@pytest.mark.parametrize("name", LOADER_TARGETS)
def test_the_cached_engine_is_the_reference_with_the_loaders_format(name, tmp_path):
    target = get_target(name)
    case = case_by_name("zeroed_norm")
    location = Path("/w/tensorized/model.tensors") if name == "tensorizer" else tmp_path / "base"
    cache = PreparedCache(BASE_SETTINGS, location, "b" * 64)
    common = case.engine_kwargs()
    cand = tmp_path / "cand"
    spec = target.cached_spec(cache, case, cand, common, "miss")
    assert (spec.load_format, spec.extra_config) == SPECS[name]
    assert spec.checkpoint == str(cand)  # config and tokenizer come from the candidate, always
    reference = EngineSpec(checkpoint=str(cand), **common)
    assert reference.load_format == "auto" and reference.extra_config is None
    # control: everything else equal to auto's engine, so a difference in output is the loader's
    assert dataclasses.replace(spec, load_format="auto", extra_config=None) == reference


def test_loader_targets_keep_no_daemon_and_write_nothing_into_the_base():
    for name in LOADER_TARGETS:
        t = get_target(name)
        assert (t.records_events, t.node_local, t.stages_base, t.checkpoint_format) == (
            False, False, False, "safetensors"), name
        assert t.default_cases == ()  # `all`: the whole catalogue, like the caches


def test_a_loader_blocks_with_both_answers_and_passes_only_on_equal_output():
    target, case = get_target("fastsafetensors"), case_by_name("identical_copy")
    served = target.served(PreparedCache(BASE_SETTINGS, Path("/b"), "a" * 64), case, Path("/c"), "a" * 64,
                           EngineResult(ok=True), "")
    ref = EngineResult(ok=True, token_ids=[[5, 6, 7]], logprobs=[[{"5": -0.1}, {"6": -0.2}, {"7": -0.3}]])
    bad = EngineResult(ok=True, token_ids=[[5, 9, 9]], logprobs=[[{"5": -0.1}, {"9": -0.2}, {"9": -0.3}]])
    res = CaseResult(case.name, case.description, case.expect, case.weights_equal, {}, NOT_RUN)
    res.reference, res.cached = ref, bad
    v = judge_served(target, case, res, served, 1e-3)
    assert v.status == BLOCK and v.reasons == ["output_mismatch"]
    assert any("auto 6 vs cached 9" in d for d in v.details), v.details
    res.cached = ref  # control: the same answer passes, judged on output alone
    v = judge_served(target, case, res, served, 1e-3)
    assert v.status == PASS and any("the hit could not be proven" in d for d in v.details)


# -- tensorizer --------------------------------------------------------------------------


def test_tensorizer_notes_a_file_serialized_from_other_content_as_stale():
    t, case = TensorizerTarget(), case_by_name("finetune_noise")
    cache = PreparedCache(BASE_SETTINGS, Path("/w/tensorized/model.tensors"), "b" * 64)
    log = "INFO Deserialized 1.1 MB in 0.02s, 55 MB/s\n"
    stale = t.served(cache, case, Path("/c"), "c" * 64, EngineResult(ok=True), log)
    assert "NOT the candidate, cccccccccccccccc" in stale.notes[0] and not stale.hit_proven
    assert stale.notes[1] == "vLLM logged 'Deserialized 1.1 MB in 0.02s'"
    same = t.served(cache, case, Path("/c"), "b" * 64, EngineResult(ok=True), "")  # control
    assert "(the candidate)" in same.notes[0] and "NOT" not in same.notes[0]
    assert "logged no 'Deserialized" in same.notes[1]


def test_tensorizer_runs_only_at_tp_1():
    t = TensorizerTarget()
    assert "TP=1 only" in t.case_unavailable(case_by_name("tp_2_to_1"))
    assert t.case_unavailable(case_by_name("zeroed_norm")) is None  # control
    assert get_target("runai_streamer").case_unavailable(case_by_name("tp_2_to_1")) is None


# -- the gate here, the CLI's names ----------------------------------------------------------


@pytest.mark.parametrize("name", LOADER_TARGETS)
def test_the_gate_reports_each_case_not_run_with_the_reason(name, tiny_ckpt, tmp_path):
    reason = get_target(name).unavailable()
    if reason is None:
        pytest.skip(f"{name} can run on this machine: its cases are judged (tests/cpu, tests/gpu)")
    report = run_gate(GateOptions(candidate=str(tiny_ckpt), target=name, mutations="identical_copy,zeroed_norm",
                                  workdir=str(tmp_path / "w")))
    assert [(c.name, c.status, c.not_run_reason) for c in report.cases] == [
        ("identical_copy", NOT_RUN, reason), ("zeroed_norm", NOT_RUN, reason)]
    assert report.exit_code == 2 and report.verdict != PASS
    # The terminal says why, once (the table has no room for it); control: a run with none not run says nothing.
    doc = report.to_json()
    out = io.StringIO()
    print_summary(doc, stream=out)
    assert " ".join(out.getvalue().split()).count(f"not run: {' '.join(reason.split())}") == 1
    for c in doc["cases"]:
        c["status"] = PASS
    out = io.StringIO()
    print_summary(doc, stream=out)
    assert "not run:" not in out.getvalue()


def test_the_cli_offers_every_target_and_the_demo_shows_every_column():
    assert TARGET_NAMES == NAMES
    assert DEMO_TARGET_NAMES == DEMO_TARGETS
    assert set(LOADER_TARGETS) <= set(DEMO_TARGETS)


def test_target_all_runs_the_gate_once_per_target_with_its_own_report(monkeypatch, tmp_path, capsys):
    seen: list[tuple[str, str | None, str | None]] = []
    written: list[str] = []

    def fake_gate(opts, executor=None):
        seen.append((opts.target, opts.report_dir, opts.workdir))
        code = 1 if opts.target == "npcache" else (0 if opts.target == "verified_cache" else 2)
        return SimpleNamespace(to_json=lambda: {"target": opts.target}, exit_code=code)

    monkeypatch.setattr(harness.gate, "run_gate", fake_gate)
    monkeypatch.setattr(harness.report, "write_reports", lambda doc, out: written.append(str(out)))
    monkeypatch.setattr(harness.report.terminal, "print_summary", lambda doc: None)
    # No survivor process and no signal handlers in the test's own process.
    monkeypatch.setattr(harness.cli, "hold", lambda verb: None)
    monkeypatch.setattr(harness.engine, "unwind_on_signals", lambda verb: None)
    rc = main(["gate", str(tmp_path / "ckpt"), "--mutations", "identical_copy", "--target", "all",
               "--report", str(tmp_path / "r"), "--workdir", str(tmp_path / "w")])
    assert [s[0] for s in seen] == list(NAMES)
    assert all(s[1] == str(tmp_path / "r" / s[0]) and s[2] == str(tmp_path / "w" / s[0]) for s in seen)
    assert written == [str(tmp_path / "r" / n) for n in NAMES]
    assert rc == 1  # npcache blocked
    seen.clear()
    rc = main(["gate", str(tmp_path / "ckpt"), "--mutations", "identical_copy", "--target", "ipc_cache",
               "--report", str(tmp_path / "r1")])
    assert seen == [("ipc_cache", str(tmp_path / "r1"), None)] and rc == 2  # control: one target, its own dirs


def test_package_present_looks_the_module_up_without_importing_it():
    assert loaders.package_present("json") and "no_such_loader_package_41" not in sys.modules
    assert not loaders.package_present("no_such_loader_package_41")  # control: an absent one is absent
