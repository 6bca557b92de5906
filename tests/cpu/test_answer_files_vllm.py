"""The answer files are what vLLM reads, and what the SmolLM2 fixture ships (differential).

No engine: vLLM's own readers are called on a folder as ``vllm serve`` calls
them before it loads weights (``ModelConfig``, ``get_tokenizer``, the chat
template it resolves for a chat request, the sampling defaults it takes from
generation_config.json), and every file they open there must be an answer
file, config.json or a weight file (those have digests of their own). The
SmolLM2 fixture keeps every file transformers saves for its tokenizer, and
each is an answer file. Controls: a rule with one name left out reports it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from file_reads import reads_of

from pgbase.shards import shard_paths
from preload.identity.answer_files import RULE, AnswerFileRule, select

pytestmark = pytest.mark.cpu
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def uncovered(read: set[str], root: Path, rule: AnswerFileRule = RULE) -> list[str]:
    weights = {p.name for p in shard_paths(root)}
    return sorted(read - set(select(root, rule)) - {"config.json"} - weights)


def test_every_file_vllm_reads_before_the_weights_is_an_answer_file(tiny_ckpt: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config import ModelConfig
    from vllm.renderers.hf import resolve_chat_template
    from vllm.tokenizers import get_tokenizer

    root = Path(shutil.copytree(tiny_ckpt, tmp_path / "ckpt"))
    (root / "chat_template.jinja").write_text(TEMPLATE)
    (root / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20, "eos_token_id": 2}))
    with reads_of(root, monkeypatch) as read:
        mc = ModelConfig(model=str(root), dtype="bfloat16", max_model_len=256)
        tok = get_tokenizer(str(root))
        template = resolve_chat_template(tok, None, None, model_config=mc)
        defaults = mc.get_diff_sampling_param()
    assert template == TEMPLATE and defaults == {"temperature": 0.6, "top_k": 20}
    # Not vacuous: vLLM read the files t11 is about.
    assert {"chat_template.jinja", "generation_config.json", "tokenizer_config.json"} <= read, read
    assert uncovered(read, root) == []
    for name in sorted(read & RULE.names):  # control
        assert uncovered(read, root, RULE.without(name)) == [name], name


def test_smollm2_fixture_keeps_every_tokenizer_file_transformers_saves(smollm2_ckpt: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    out = tmp_path / "saved"
    AutoTokenizer.from_pretrained(str(smollm2_ckpt)).save_pretrained(str(out))
    saved = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert "chat_template.jinja" in saved
    assert sorted(n for n in saved if not (smollm2_ckpt / n).is_file()) == []
    assert uncovered(saved, smollm2_ckpt) == []
    for name in sorted(saved & RULE.names):  # control
        assert uncovered(saved, smollm2_ckpt, RULE.without(name)) == [name], name
