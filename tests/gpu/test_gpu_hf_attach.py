"""A transformers model built on meta with the daemon's tensors decodes
exactly like ``from_pretrained`` of the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_support import probe, running_daemon, spec_for

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 5, 77, 300, 12, 9], [256, 3, 3, 3, 500], [42]]


def _llama_ckpt(out: Path) -> Path:
    """A ~250 MB Llama with tied embeddings, random weights, saved by transformers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=True, dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def larger_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _llama_ckpt(tmp_path_factory.mktemp("llama-250m") / "ckpt")


@pytest.mark.parametrize("which", ["tiny", "larger"])
def test_meta_model_with_attached_tensors_decodes_like_from_pretrained(which, tiny_checkpoint, larger_ckpt) -> None:
    ckpt = tiny_checkpoint(arch="llama") if which == "tiny" else larger_ckpt
    prompts = PROMPTS if which == "larger" else [[t % 1024 for t in p] for p in PROMPTS]
    with running_daemon(ckpt) as ready:
        r = probe(spec_for(ready, ckpt, "hf", prompts=prompts, max_new_tokens=16))
    assert r["event"] == "result", r
    assert r["verified"] is True
    assert all(len(t) == 16 for t in r["ours"])
    assert r["tokens_equal"], (r["ours"], r["reference"])
    assert r["logits_equal"], "same weights, same kernels: logits must be bit-identical"
    if which == "larger":
        assert r["tied"] is True  # lm_head shares the attached embedding, as from_pretrained ties it
