"""Weights that outlive their daemon, at 8 GiB (issue 26, the CUDA side).

A daemon serves a ~8 GiB Llama (random weights, saved by transformers on the
device) over a VMM arena; its arena fd is deposited in a stand-in fd store
(``fd_holder.py``: a plain process, no CUDA), then the daemon's rank is
killed with SIGKILL. Shown: the attached engine decodes identically before
and after; a successor adopts the arena from the held fd and proves it by
recomputing the resident checksums; a new engine attaches it and decodes
bit-identically to ``from_pretrained``; a byte written into the arena
between the two makes the proof fail, naming the tensor (the control).

``PRELOAD_GATE_GPU_READOPT_LAYERS`` (default 24 layers: ~8.2 GiB) sizes the model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpu_support import PROBE, fd_holder, probe, probe_env, running_daemon, spec_for

pytestmark = pytest.mark.gpu
PROMPTS = [[1, 5, 77, 300, 12, 9], [256, 3, 3, 3, 500], [42]]
WRITTEN = "model.layers.3.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def big_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("llama-8g") / "ckpt"
    config = LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_hidden_layers=int(os.environ.get("PRELOAD_GATE_GPU_READOPT_LAYERS", "24")),
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=2048,
        tie_word_embeddings=True, dtype="bfloat16",
    )
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialise in bf16: no 17 GB fp32 detour
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(before)
    model.save_pretrained(out, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return out


def _line(proc: subprocess.Popen[str], event: str) -> dict:
    assert proc.stdout is not None
    for raw in proc.stdout:
        if raw.startswith("{"):
            obj = json.loads(raw)
            if obj.get("event") in (event, "error"):
                return obj
    raise AssertionError(f"engine ended before {event}: {proc.stderr.read() if proc.stderr else ''}")


def _decode(engine: subprocess.Popen[str]) -> dict:
    assert engine.stdin is not None
    engine.stdin.write("decode\n")
    engine.stdin.flush()
    return _line(engine, "decoded")


def test_an_8g_arena_outlives_its_daemon_and_is_readopted_proven(big_llama: Path) -> None:
    with fd_holder() as (holder, first), running_daemon(big_llama) as ready:
        assert first["libcuda_mapped"] is False
        rank = ready["ranks"][0]
        assert rank["bytes"] >= 8 << 30, rank
        engine = subprocess.Popen(
            [sys.executable, str(PROBE), json.dumps(spec_for(ready, big_llama, "hf_serve", prompts=PROMPTS))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=probe_env(),
        )
        try:
            attached = _line(engine, "attached")
            assert attached["event"] == "attached" and attached["access"] == "read", attached
            before = _decode(engine)
            dep = probe(spec_for(ready, big_llama, "deposit_from_daemon", holder=holder))
            assert dep["event"] == "result" and dep["deposited"] is True, dep
            os.kill(rank["pid"], signal.SIGKILL)
            for _ in range(100):
                try:
                    os.kill(rank["pid"], 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                raise AssertionError("the daemon's rank did not die")
            time.sleep(1.0)  # the watch connection closes with the rank: let the engine read it
            after = _decode(engine)
        finally:
            if engine.poll() is None and engine.stdin is not None:
                engine.stdin.write("exit\n")
                engine.stdin.flush()
            engine.wait(120)
        assert before["event"] == after["event"] == "decoded", (before, after)
        assert after["tokens"] == before["tokens"] and after["logits_sha256"] == before["logits_sha256"]
        assert after["daemon_lost"] is True  # the engine saw the daemon go, and kept decoding
        adopted = probe({"action": "adopt", "holder": holder, "warm": True, "compare_disk": True,
                         "checkpoint": str(big_llama)})
        assert adopted["event"] == "result" and "proof_error" not in adopted, adopted
        assert adopted["proof"]["method"] == "checksum" and adopted["equal_to_disk"] is True, adopted
        new = probe({"action": "hf_fd", "holder": holder, "checkpoint": str(big_llama), "prompts": PROMPTS,
                     "max_new_tokens": 16})
        assert new["event"] == "result", new
        assert new["tokens_equal"] and new["logits_equal"], (new.get("ours"), new.get("reference"))
        assert new["ptr_equal"] is True and new["access"] == "read"
        assert new["ours"] == before["tokens"]
        written = probe({"action": "write_byte", "holder": holder, "tensor": WRITTEN, "byte": 12345})
        assert written["event"] == "result", written
        bad = probe({"action": "adopt", "holder": holder})
        assert bad["event"] == "result" and "proof" not in bad, bad
        assert WRITTEN in bad["proof_error"] and "1 of" in bad["proof_error"], bad
    figures = {"daemon_load_seconds": rank.get("load_seconds"), "adopt_prove_s": adopted["adopt_prove_s"],
               "fetch_adopt_s": adopted["fetch_adopt_s"], "proof_s": adopted["proof"]["seconds"],
               "bytes": rank["bytes"], "engine_attach_s": new["attach_s"]}
    print(json.dumps({"readopt_figures": figures}))
    if os.environ.get("PRELOAD_GATE_GPU_FIGURES"):  # gpu_suite.sh collects them beside the bench
        Path(os.environ["PRELOAD_GATE_GPU_FIGURES"]).write_text(json.dumps(figures, indent=1))
