"""vLLM CPU serves the fixtures, and vLLM's own header hash agrees with ours.

Engines run in a subprocess from a guarded script (vLLM spawns workers),
with the small-engine settings: max_model_len 256, 1 GiB KV cache,
gpu_memory_utilization 0.1, eager mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from fixtures.mutations import MUTATIONS
from pgbase.shards import read_header
from preload.identity import anchors

pytestmark = [pytest.mark.cpu, pytest.mark.xdist_group(name="fixtures_serve")]

_SCRIPT = textwrap.dedent(
    """
    import json, sys

    def main():
        from vllm import LLM, SamplingParams
        llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=256,
                  gpu_memory_utilization=0.1, enforce_eager=True, seed=0)
        params = SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), ignore_eos=sys.argv[4] == "1")
        outs = llm.generate(json.loads(sys.argv[2]), params)
        print("RESULT " + json.dumps([{"ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text}
                                       for o in outs]), flush=True)

    if __name__ == "__main__":
        main()
    """
)


def _generate(tmp_path, model, prompts, max_tokens=8, ignore_eos=True):
    script = tmp_path / "serve_once.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), str(model), json.dumps(prompts), str(max_tokens), "1" if ignore_eos else "0"],
        capture_output=True, text=True, timeout=400, env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_vllm_cpu_serves_tiny(tiny_ckpt, tmp_path):
    out = _generate(tmp_path, tiny_ckpt, ["Hello, my name is", "The capital of France is"])
    for o in out:
        assert len(o["ids"]) == 8
        assert all(0 <= i < 1024 for i in o["ids"])


@pytest.mark.slow
def test_vllm_cpu_serves_tiny_llama_sharded(tiny_checkpoint, tmp_path):
    out = _generate(tmp_path, tiny_checkpoint(arch="llama", shards=3), ["Hello"])
    assert len(out[0]["ids"]) == 8


@pytest.mark.slow
def test_smollm2_knows_paris(smollm2_ckpt, tmp_path):
    out = _generate(tmp_path, smollm2_ckpt, ["The capital of France is"], max_tokens=3, ignore_eos=False)
    assert out[0]["text"].startswith(" Paris."), out


@pytest.mark.slow
def test_smollm2_same_inputs_same_bytes(smollm2_ckpt, tmp_path):
    from fixtures.smollm2 import write_smollm2

    again = write_smollm2(tmp_path / "again", progress=False)
    assert anchors.content(again).hex == anchors.content(smollm2_ckpt).hex
    files = sorted(p.name for p in smollm2_ckpt.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert (again / name).read_bytes() == (smollm2_ckpt / name).read_bytes(), name
    cfg = json.loads((again / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert "lm_head.weight" not in {t.name for t in read_header(again / "model.safetensors").tensors}


def test_header_only_calls_vllm_and_matches_the_reimplementation(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint(shards=3)
    vllm_fp = anchors.header_only(base, "vllm")
    assert vllm_fp.implementation.startswith("vllm 0.32")
    assert anchors.header_only(base, "auto").implementation == vllm_fp.implementation
    for row in MUTATIONS:
        staged = row.stage(base, tmp_path)
        cand = row.apply(staged, tmp_path)
        assert anchors.header_only(cand, "vllm").hex == anchors.header_only(cand, "reimpl").hex, row.name
    # Control: a layout change moves both implementations.
    other = tiny_checkpoint(shards=2)
    assert anchors.header_only(other, "vllm").hex != vllm_fp.hex
    assert anchors.header_only(other, "vllm").hex == anchors.header_only(other, "reimpl").hex


def test_matrix_cli_with_vllms_header_hash(tiny_checkpoint):
    proc = subprocess.run(
        [sys.executable, "-m", "preload_gate", "fingerprints", "--base", str(tiny_checkpoint(shards=2)),
         "--mutations", "all", "--header-impl", "vllm", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["as_expected"] is True
    assert doc["matrix"][0]["schemes"]["header_only"]["implementation"].startswith("vllm 0.32")
