"""The tiny fixture: deterministic bytes, valid shards, a working tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fixtures.tiny import FixtureError, write_tiny
from pgbase.shards import INDEX_NAME, read_header, shard_paths
from preload.identity import anchors

pytestmark = pytest.mark.unit


def _all_bytes(ckpt):
    return {p.name: p.read_bytes() for p in sorted(ckpt.iterdir())}


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("shards", [1, 3])
def test_same_inputs_same_bytes(arch, shards, tmp_path):
    a = write_tiny(tmp_path / "a", arch=arch, shards=shards, seed=7)
    b = write_tiny(tmp_path / "b", arch=arch, shards=shards, seed=7)
    assert _all_bytes(a) == _all_bytes(b)
    assert anchors.content(a).hex == anchors.content(b).hex


def test_seed_changes_the_weights(tmp_path):
    a = write_tiny(tmp_path / "a", seed=0)
    b = write_tiny(tmp_path / "b", seed=1)
    assert anchors.content(a).hex != anchors.content(b).hex
    assert anchors.header_only(a, "reimpl").hex == anchors.header_only(b, "reimpl").hex


def test_layout_is_real(tiny_checkpoint):
    ckpt = tiny_checkpoint(shards=3)
    paths = shard_paths(ckpt)
    assert [p.name for p in paths] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((ckpt / INDEX_NAME).read_text())
    tensors = {t.name: t for p in paths for t in read_header(p).tensors}
    assert set(index["weight_map"]) == set(tensors)
    assert all(t.dtype == "BF16" for t in tensors.values())
    assert sum(t.nbytes > 1024 for t in tensors.values()) >= 10
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == cfg["head_dim"] == 64
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert "model.layers.0.self_attn.q_norm.weight" in tensors


def test_llama_has_no_qk_norm(tiny_checkpoint):
    ckpt = tiny_checkpoint(arch="llama")
    names = {t.name for t in read_header(shard_paths(ckpt)[0]).tensors}
    assert not any("q_norm" in n for n in names)
    assert json.loads((ckpt / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_tokenizer_round_trips_offline(tiny_ckpt):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_ckpt / "tokenizer.json"))
    text = "Hello, wörld! <|im_end|>"
    ids = tok.encode(text).ids
    assert max(ids) < json.loads((tiny_ckpt / "config.json").read_text())["vocab_size"]
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.token_to_id("<|im_end|>") == json.loads((tiny_ckpt / "config.json").read_text())["eos_token_id"]


def test_transformers_loads_the_tokenizer(tiny_ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt))
    assert tok.decode(tok("capital of France")["input_ids"]) == "capital of France"
    assert tok.eos_token == "<|im_end|>"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"arch": "gpt2"}, "unknown arch"), ({"shards": 0}, "--shards must be"), ({"shards": 999}, "--shards must be")],
)
def test_bad_arguments(kwargs, message, tmp_path):
    with pytest.raises(FixtureError, match=message):
        write_tiny(tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()


def test_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep").write_text("mine")
    with pytest.raises(FixtureError, match="not an empty directory"):
        write_tiny(tmp_path / "x")
    assert (tmp_path / "x" / "keep").read_text() == "mine"


def test_cli_writes_the_same_bytes_as_the_api(tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "preload_gate", "fixtures", "tiny", str(out), "--arch", "llama",
         "--shards", "2", "--seed", "3"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    api = write_tiny(tmp_path / "api", arch="llama", shards=2, seed=3)
    assert _all_bytes(out) == _all_bytes(api)


def test_cli_bad_argument_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "preload_gate", "fixtures", "tiny", str(tmp_path / "x"), "--shards", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0 and "--shards: 0 is not a positive integer" in proc.stderr
