"""t11 as a kind: an edit in any file that decides answers is seen, by name.

One row per kind of answer file (each route the rule has: transformers'
tokenizer, chat-template, processor and generation names, the named-template
folder, a versioned tokenizer file, mistral_common's files, vLLM's
params.json, remote code). For each: an edit, a removal and an addition
change ``answer_identity`` (so the gate's reference cache key), and a golden
recorded before the change is refused naming the file. Controls: files that
decide nothing (a README, ``._`` sidecars, a ``.py`` no config maps, a
versioned tokenizer file nothing lists) change nothing and the golden still
fits. A golden from before ``answer_files`` is refused under ``--checkpoint``,
saying what it does not cover (the t11 golden, recorded by the old code).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from canaries.fit import AnswerFilesMismatchError, AnswerFilesUnrecordedError, check_fit
from canaries.golden import Golden, GoldenPrompt, Sampling
from harness.engine import EngineSpec
from harness.gate import ReferenceCache
from preload.deployment import answer_identity
from preload.identity import answer_files as af
from preload.identity.answer_files import RULE, Change, changes, legacy_tokenizer_digest
from preload_gate.cli import main as cli_main

pytestmark = pytest.mark.unit
DIGEST = "ab" * 32


def _auto_map(folder: Path) -> None:
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def _fast_files(folder: Path) -> None:
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["fast_tokenizer_files"] = ["tokenizer.4.0.0.json"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def _nothing(folder: Path) -> None:
    pass


# (route, file, what makes the folder read it). Every route of the rule has a row.
KINDS: list[tuple[str, str, Callable[[Path], None]]] = [
    ("tokenizer", "chat_template.jinja", _nothing),
    ("tokenizer", "tokenizer.json", _nothing),
    ("tokenizer", "tokenizer_config.json", _nothing),
    ("tokenizer", "special_tokens_map.json", _nothing),
    ("tokenizer", "added_tokens.json", _nothing),
    ("vocab", "tokenizer.model", _nothing),
    ("vocab", "vocab.json", _nothing),
    ("vocab", "merges.txt", _nothing),
    ("vocab", "spiece.model", _nothing),
    ("template dir", "additional_chat_templates/tool_use.jinja", _nothing),
    ("template dir", "additional_chat_templates/._tool_use.jinja", _nothing),  # transformers globs it too
    ("fast_tokenizer_files", "tokenizer.4.0.0.json", _fast_files),
    ("processor", "chat_template.json", _nothing),
    ("processor", "processor_config.json", _nothing),
    ("processor", "preprocessor_config.json", _nothing),
    ("processor", "video_preprocessor_config.json", _nothing),
    ("processor", "audio_tokenizer_config.json", _nothing),
    ("generation", "generation_config.json", _nothing),
    ("mistral", "tekken.json", _nothing),
    ("mistral", "tokenizer.model.v3", _nothing),
    ("mistral", "tokenizer.model.v7m1", _nothing),
    ("vllm", "params.json", _nothing),
    ("remote code", "tokenization_custom.py", _auto_map),
    ("remote code", "helpers.py", _auto_map),  # a module the named one imports
]
# Files that decide nothing: adding or editing them changes no key.
UNRELATED: list[tuple[str, Callable[[Path], None]]] = [
    ("README.md", _nothing),
    ("._tokenizer.json", _nothing),
    ("._chat_template.jinja", _nothing),
    ("._generation_config.json", _nothing),
    ("notes.txt", _nothing),
    ("tokenization_custom.py", _nothing),  # no config maps it: no code runs
    ("tokenizer.4.0.0.json", _nothing),  # nothing lists it: transformers never reads it
    ("additional_chat_templates/README.md", _nothing),
    ("original/tokenizer.model", _nothing),  # Llama repos' originals: read by nobody
]


def test_every_route_of_the_rule_has_a_row() -> None:
    routes = {r for r, _, _ in KINDS}
    assert routes == {"tokenizer", "vocab", "template dir", "fast_tokenizer_files", "processor", "generation",
                      "mistral", "vllm", "remote code"}
    names = {f for _, f, _ in KINDS}
    for group in (af.TOKENIZER_NAMES, af.PROCESSOR_NAMES, af.GENERATION_NAMES, af.VLLM_NAMES):
        assert set(group) <= names, set(group) - names


@pytest.fixture
def folder(tiny_ckpt: Path, tmp_path: Path) -> Path:
    """The tiny checkpoint's files besides the weights (no row reads them)."""
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, out, ignore=shutil.ignore_patterns("*.safetensors"))
    return out


def _write(folder: Path, name: str, text: str) -> None:
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)


def golden_for(folder: Path, **fields: object) -> Golden:
    """A golden recorded from ``folder`` as ``canary record`` keys one."""
    p = GoldenPrompt("p0", [1, 2, 3], [5, 6], "", [-0.1, -0.2], [{"5": -0.1}, {"6": -0.2}])
    ident = answer_identity(folder)
    return Golden(DIGEST, "0.32.0", Sampling(max_tokens=2, top_logprobs=1), [p], config_digest=ident["config_digest"],
                  answer_files=ident["answer_files"], **fields)  # type: ignore[arg-type]


def reference_key(folder: Path) -> str:
    return ReferenceCache(folder.parent / "refs").key(DIGEST, EngineSpec(checkpoint=str(folder)), "0.32.0")


def refused(golden: Golden, folder: Path) -> str:
    with pytest.raises(AnswerFilesMismatchError) as exc:
        check_fit(golden, {}, folder)
    return str(exc.value)


@pytest.mark.parametrize(("route", "name", "setup"), KINDS, ids=[n for _, n, _ in KINDS])
def test_an_edit_in_any_answer_file_is_refused_by_name(folder: Path, route: str, name: str,
                                                       setup: Callable[[Path], None]) -> None:
    setup(folder)
    _write(folder, name, "recorded\n")
    golden, key = golden_for(folder), reference_key(folder)
    assert name in golden.answer_files, route  # type: ignore[operator]
    check_fit(golden, {}, folder)  # control: the folder it was recorded from fits
    _write(folder, name, "edited\n")
    assert changes(golden.answer_files, folder) == [Change(name, "changed")]  # type: ignore[arg-type]
    assert f"answer_files: {name} changed" in refused(golden, folder)
    assert reference_key(folder) != key
    (folder / name).unlink()
    assert f"answer_files: {name} removed" in refused(golden, folder)


@pytest.mark.parametrize(("route", "name", "setup"), KINDS, ids=[n for _, n, _ in KINDS])
def test_an_answer_file_added_after_recording_is_refused_by_name(folder: Path, route: str, name: str,
                                                                 setup: Callable[[Path], None]) -> None:
    setup(folder)
    (folder / name).unlink(missing_ok=True)  # the tiny fixture ships some: record without it
    golden, key = golden_for(folder), reference_key(folder)
    _write(folder, name, "added\n")
    assert f"answer_files: {name} added" in refused(golden, folder)
    assert reference_key(folder) != key


@pytest.mark.parametrize("name", sorted(RULE.names))
def test_every_name_held_is_an_answer_file(folder: Path, name: str) -> None:
    golden = golden_for(folder)
    _write(folder, name, "edited\n")
    assert f"{name} " in refused(golden, folder)


@pytest.mark.parametrize(("name", "setup"), UNRELATED, ids=[n for n, _ in UNRELATED])
def test_control_files_that_decide_nothing_change_nothing(folder: Path, name: str,
                                                          setup: Callable[[Path], None]) -> None:
    setup(folder)
    before, key, golden = answer_identity(folder), reference_key(folder), golden_for(folder)
    _write(folder, name, "one\n")
    _write(folder, name, "two\n")
    assert answer_identity(folder) == before and reference_key(folder) == key
    check_fit(golden, {}, folder)


def test_a_golden_records_each_answer_file_of_a_changed_template(folder: Path, tmp_path: Path, capsys) -> None:
    """t11 through the CLI: the chat template edited in chat_template.jinja is
    refused before any request (exit 2, one line naming the file); the same
    edit inside tokenizer_config.json likewise."""
    _write(folder, "chat_template.jinja", "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}")
    g = tmp_path / "golden.json"
    g.write_text(json.dumps(golden_for(folder).to_json()))
    argv = ["canary", "check", "--base-url", "http://127.0.0.1:9", "--golden", str(g), "--checkpoint", str(folder),
            "--timeout", "1", "--retries", "0"]
    _write(folder, "chat_template.jinja", "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "answer_files: chat_template.jinja changed" in err[0], err
    # The template moved into tokenizer_config.json (the layout before chat_template.jinja).
    (folder / "chat_template.jinja").unlink()
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": "{{ messages[0].content }}"}))
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "answer_files: chat_template.jinja removed, tokenizer_config.json changed" in err[0], err


def _old_golden(folder: Path, **fields: object) -> Golden:
    """A golden as the code before answer_files wrote it: a tokenizer_digest over the legacy list."""
    g = golden_for(folder)
    return Golden(g.digest, g.vllm_version, g.sampling, g.prompts, config_digest=g.config_digest,
                  tokenizer_digest=legacy_tokenizer_digest(folder), **fields)  # type: ignore[arg-type]


def test_a_golden_from_before_answer_files_is_refused_saying_what_it_misses(folder: Path) -> None:
    _write(folder, "chat_template.jinja", "{{ messages[0].content }}")
    old = _old_golden(folder)
    assert old.answer_files is None and old.tokenizer_digest is not None
    check_fit(old, {})  # without --checkpoint nothing is compared, as before
    with pytest.raises(AnswerFilesUnrecordedError) as exc:
        check_fit(old, {}, folder)
    msg = str(exc.value)
    assert "records no answer_files" in msg and "those match" in msg
    assert "not covered: chat_template.jinja, generation_config.json" in msg and "canary record" in msg
    # Its own files edited: it says those differ too.
    _write(folder, "tokenizer.json", "{}")
    with pytest.raises(AnswerFilesUnrecordedError, match="and those differ"):
        check_fit(old, {}, folder)
    # A golden keyed by nothing at all.
    unkeyed = Golden(old.digest, old.vllm_version, old.sampling, old.prompts)
    with pytest.raises(AnswerFilesUnrecordedError, match="records no digest of them at all"):
        check_fit(unkeyed, {}, folder)

