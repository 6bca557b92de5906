"""The answer files are the files their owners write and read (differential).

:mod:`preload.identity.answer_files` holds the names transformers, vLLM and
mistral_common decide, for a process without them; these tests hold the two
equal on the installed versions:

- the names: transformers' constants, every tokenizer class's
  ``vocab_files_names`` (each class as ``tokenizer_class_from_name`` resolves
  it), vLLM's ``MISTRAL_CONFIG_NAME``, mistral_common's tokenizer files;
- what transformers *saves*: for the tokenizers our fixtures use (the tiny
  fixture's byte-level tokenizer, in every save layout), a SentencePiece and a
  vocab/merges tokenizer, a processor (LLaVA's: image processor, tokenizer,
  chat template), an image processor, a feature extractor and a generation
  config, every file ``save_pretrained`` writes is an answer file;
- what transformers *reads* back from each of those folders (every file
  Python opens there, seen by an audit hook, and every file the tokenizer
  loader resolves for its backend, which may open it from C++).

Each differential has its control: the same check under a rule with one
name left out (:meth:`AnswerFileRule.without`) reports exactly that file.
The SmolLM2 fixture's own tokenizer is checked in the cpu tier (it converts
a GGUF: tests/cpu/test_answer_files_vllm.py).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from file_reads import reads_of

from preload.identity import answer_files as af
from preload.identity.answer_files import RULE, AnswerFileRule, select

pytestmark = pytest.mark.unit
transformers = pytest.importorskip("transformers")

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def saved_files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def uncovered(files: set[str], root: Path, rule: AnswerFileRule = RULE) -> list[str]:
    """Files of ``files`` (relative to ``root``) that no digest covers: not an
    answer file under ``rule`` and not config.json (the config digest's)."""
    return sorted(files - set(select(root, rule)) - {"config.json"})


# --- the names ------------------------------------------------------------

def test_names_held_here_are_transformers_constants() -> None:
    from transformers import tokenization_utils_base as tub
    from transformers import utils
    from transformers.utils import hub

    assert af.TOKENIZER_NAMES == (tub.ADDED_TOKENS_FILE, tub.SPECIAL_TOKENS_MAP_FILE, tub.TOKENIZER_CONFIG_FILE,
                                  tub.FULL_TOKENIZER_FILE, hub.CHAT_TEMPLATE_FILE)
    assert af.CHAT_TEMPLATE_DIR == hub.CHAT_TEMPLATE_DIR
    assert set(af.PROCESSOR_NAMES) == {utils.PROCESSOR_NAME, utils.IMAGE_PROCESSOR_NAME, utils.FEATURE_EXTRACTOR_NAME,
                                       utils.VIDEO_PROCESSOR_NAME, utils.AUDIO_TOKENIZER_NAME,
                                       hub.LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE}
    assert af.GENERATION_NAMES == (utils.GENERATION_CONFIG_NAME,)
    # What the rule asks transformers at run time adds nothing to the names
    # held here on this version: a process without transformers picks the same.
    assert af._transformers_names() <= RULE.names and af._transformers_names()


def _every_tokenizer_class() -> list[str]:
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    names: set[str] = set()
    for value in TOKENIZER_MAPPING_NAMES.values():
        names.update(v for v in (value if isinstance(value, (tuple, list)) else [value]) if v)
    # The backends AutoTokenizer falls back to when no mapped class fits.
    return sorted(names | {"TokenizersBackend", "SentencePieceBackend", "PythonBackend", "MistralCommonBackend",
                           "PreTrainedTokenizerFast"})


def test_vocab_file_names_are_every_tokenizer_class_s() -> None:
    """The union held here is the union of every class's ``vocab_files_names``,
    each class as transformers resolves its name; and every class's own names
    are in it, which is what the rule needs of the class a folder names."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    union: set[str] = set()
    for name in _every_tokenizer_class():
        cls = tokenizer_class_from_name(name)
        files = getattr(cls, "vocab_files_names", None)
        if not isinstance(files, dict):  # RagTokenizer: a pair of tokenizers, no files of its own
            continue
        own = {v for v in files.values() if isinstance(v, str)}
        assert own <= set(af.VOCAB_FILE_NAMES), (name, own - set(af.VOCAB_FILE_NAMES))
        assert af._vocab_files_of(name) == own, name
        union |= own
    assert set(af.VOCAB_FILE_NAMES) == union


def test_mistral_config_name_is_vllm_s() -> None:
    """vLLM's ``MISTRAL_CONFIG_NAME``, read from its source (importing vLLM
    takes seconds and the unit tier has none)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    source = Path(next(iter(spec.submodule_search_locations))) / "transformers_utils" / "config.py"
    values = [node.value.value for node in ast.parse(source.read_text()).body
              if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
              and any(isinstance(t, ast.Name) and t.id == "MISTRAL_CONFIG_NAME" for t in node.targets)]
    assert values == list(af.VLLM_NAMES)


def mistral_uncovered(accepted: list[str]) -> list[str]:
    return [n for n in accepted if not af._MISTRAL_FILE.fullmatch(n)]


def test_mistral_tokenizer_files_are_mistral_common_s() -> None:
    utils = pytest.importorskip("mistral_common.tokens.tokenizers.utils")
    from mistral_common.tokens.tokenizers.base import TokenizerVersion
    from mistral_common.tokens.tokenizers.multimodal import MultiModalVersion

    stems = ["tokenizer", "._tokenizer", "tekken", "._tekken", "consolidated", "tokenizer.mm"]
    tails = [".model", ".json", ".model.safetensors", ".txt"]
    tails += [f".model.{v}{m}" for v in TokenizerVersion.__members__ for m in [*MultiModalVersion.__members__, ""]]
    candidates = [s + t for s in stems for t in tails]
    accepted = [name for name, _ in utils._filter_valid_tokenizer_files(candidates)]
    assert "tekken.json" in accepted and "tokenizer.model.v3" in accepted
    assert mistral_uncovered(accepted) == []
    # Control: a file mistral_common would take that the pattern missed is reported.
    assert mistral_uncovered([*accepted, "tokenizer.spm.v3"]) == ["tokenizer.spm.v3"]


# --- what transformers saves and reads back --------------------------------

def _tiny_tokenizer(tmp: Path) -> object:
    from transformers import AutoTokenizer

    from fixtures.tokenizer import write_tokenizer

    src = tmp / "tiny-src"
    src.mkdir()
    write_tokenizer(src)
    return AutoTokenizer.from_pretrained(str(src))


def _save_tiny(kw: dict[str, object], templates: object = TEMPLATE) -> Callable[[Path, Path], str]:
    def build(tmp: Path, out: Path) -> str:
        tok = _tiny_tokenizer(tmp)
        tok.chat_template = templates  # type: ignore[attr-defined]
        tok.save_pretrained(str(out), **kw)  # type: ignore[attr-defined]
        return "tokenizer"
    return build


def _sentencepiece(tmp: Path, out: Path) -> str:
    import sentencepiece as spm
    from transformers import SentencePieceBackend

    (tmp / "corpus.txt").write_text("hello world this is a tiny corpus\n" * 50)
    with open(os.devnull, "w") as quiet:
        spm.SentencePieceTrainer.train(input=str(tmp / "corpus.txt"), model_prefix=str(tmp / "sp"), vocab_size=20,
                                       model_type="unigram", logstream=quiet)
    SentencePieceBackend(vocab_file=str(tmp / "sp.model")).save_pretrained(str(out))
    return "tokenizer"


def _vocab_merges(tmp: Path, out: Path) -> str:
    from transformers import GPT2Tokenizer

    from fixtures.tokenizer import _byte_alphabet

    (tmp / "vocab.json").write_text(json.dumps({c: i for i, c in enumerate(_byte_alphabet())}))
    (tmp / "merges.txt").write_text("#version: 0.2\n")
    GPT2Tokenizer(vocab_file=str(tmp / "vocab.json"), merges_file=str(tmp / "merges.txt")).save_pretrained(str(out))
    return "tokenizer"


def _llava_processor(tmp: Path, out: Path) -> str:
    from transformers import CLIPImageProcessor, LlavaProcessor

    LlavaProcessor(image_processor=CLIPImageProcessor(), tokenizer=_tiny_tokenizer(tmp),
                   chat_template=TEMPLATE).save_pretrained(str(out))
    return "processor"


def _image_processor(tmp: Path, out: Path) -> str:
    from transformers import CLIPImageProcessor

    CLIPImageProcessor().save_pretrained(str(out))
    return "image_processor"


def _feature_extractor(tmp: Path, out: Path) -> str:
    from transformers import WhisperFeatureExtractor

    WhisperFeatureExtractor().save_pretrained(str(out))
    return "feature_extractor"


def _generation_config(tmp: Path, out: Path) -> str:
    from transformers import GenerationConfig

    GenerationConfig(temperature=0.6, top_p=0.9, do_sample=True, eos_token_id=[1, 2]).save_pretrained(str(out))
    return "generation_config"


SAVERS: dict[str, Callable[[Path, Path], str]] = {
    "tiny fixture tokenizer": _save_tiny({}),
    "tiny, template inside tokenizer_config.json": _save_tiny({"save_jinja_files": False}),
    "tiny, named templates": _save_tiny({}, {"default": TEMPLATE, "tool_use": "{{ messages[0]['content'] }}"}),
    "tiny, legacy format": _save_tiny({"legacy_format": True}),
    "sentencepiece backend": _sentencepiece,
    "vocab and merges (GPT-2)": _vocab_merges,
    "LLaVA processor": _llava_processor,
    "image processor": _image_processor,
    "feature extractor": _feature_extractor,
    "generation config": _generation_config,
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Each saver's output folder and what loads it back, built once."""
    out = {}
    for i, (name, build) in enumerate(SAVERS.items()):
        work = tmp_path_factory.mktemp(f"saver{i}")
        folder = work / "out"
        out[name] = (folder, build(work, folder))
    return out


@pytest.mark.parametrize("case", list(SAVERS))
def test_every_file_transformers_saves_is_an_answer_file(saved, case: str) -> None:
    folder, _ = saved[case]
    files = saved_files(folder)
    assert files, case
    assert uncovered(files, folder) == []
    # The names held here alone, as in a process without transformers.
    assert uncovered(files, folder, AnswerFileRule(RULE.names, ask_owners=False)) == []


@pytest.mark.parametrize("case", list(SAVERS))
def test_control_a_name_left_out_is_reported(saved, case: str) -> None:
    folder, _ = saved[case]
    files = saved_files(folder)
    for name in sorted(files & RULE.names):
        assert uncovered(files, folder, RULE.without(name)) == [name], (case, name)
    if any(f.startswith(af.CHAT_TEMPLATE_DIR + "/") for f in files):
        elsewhere = AnswerFileRule(RULE.names, template_dir="other_templates", ask_owners=False)
        assert uncovered(files, folder, elsewhere) == sorted(f for f in files if f.startswith(af.CHAT_TEMPLATE_DIR))


def test_control_the_old_hand_list_fails_these_differentials(saved) -> None:
    """The list the tokenizer digest used before (field case t11) fails the
    save differential on exactly the files it missed."""
    old = AnswerFileRule(frozenset(af.LEGACY_TOKENIZER_FILES), template_dir="-", ask_owners=False)
    missed = {case: uncovered(saved_files(folder), folder, old) for case, (folder, _) in saved.items()}
    assert missed["tiny fixture tokenizer"] == ["chat_template.jinja"]
    assert missed["tiny, named templates"] == ["additional_chat_templates/tool_use.jinja", "chat_template.jinja"]
    assert missed["LLaVA processor"] == ["chat_template.jinja", "processor_config.json"]
    assert missed["generation config"] == ["generation_config.json"]
    assert missed["image processor"] == missed["feature extractor"] == ["preprocessor_config.json"]


def _load(folder: Path, kind: str) -> None:
    import transformers as t

    loader = {"tokenizer": t.AutoTokenizer, "processor": t.AutoProcessor, "image_processor": t.AutoImageProcessor,
              "feature_extractor": t.AutoFeatureExtractor, "generation_config": t.GenerationConfig}[kind]
    loader.from_pretrained(str(folder))


def _legacy_processor_template(folder: Path) -> None:
    """A processor as transformers < 4.50 saved it: the template in chat_template.json."""
    text = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": text}))


def _versioned_tokenizer_file(folder: Path) -> None:
    """A tokenizer.json for newer transformers beside the plain one, named by fast_tokenizer_files."""
    shutil.copy(folder / "tokenizer.json", folder / "tokenizer.4.0.0.json")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["fast_tokenizer_files"] = ["tokenizer.4.0.0.json"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


READ_CASES = {**{c: None for c in SAVERS},
              "LLaVA processor, template in chat_template.json": ("LLaVA processor", _legacy_processor_template),
              "tiny, versioned tokenizer file": ("tiny fixture tokenizer", _versioned_tokenizer_file)}


@pytest.mark.parametrize("case", list(READ_CASES))
def test_every_file_transformers_reads_back_is_an_answer_file(saved, case: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    edit = READ_CASES[case]
    folder, kind = saved[case if edit is None else edit[0]]
    if edit is not None:
        folder = Path(shutil.copytree(folder, tmp_path / "edited"))
        edit[1](folder)
    with reads_of(folder, monkeypatch) as read:
        _load(folder, kind)
    assert read, case
    if edit is not None:  # the edit made transformers read the file it added
        assert read & ({"chat_template.json", "tokenizer.4.0.0.json"}), read
    assert uncovered(read, folder) == []
    assert uncovered(read, folder, AnswerFileRule(RULE.names, ask_owners=False)) == []
    # Control: the check reports a file transformers read that the rule leaves out.
    for name in sorted(read & RULE.names):
        assert uncovered(read, folder, RULE.without(name)) == [name], (case, name)


# --- a name only the installed transformers knows --------------------------

NEW_NAME = "brand_new_vocab.dat"  # no name held here, no pattern picks it


def _with_class_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A newer BertTokenizer that reads one more vocabulary file."""
    monkeypatch.setattr(transformers.BertTokenizer, "vocab_files_names",
                        {**transformers.BertTokenizer.vocab_files_names, "extra_file": NEW_NAME})


def _with_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    """A newer transformers whose audio tokenizer config has another name."""
    from transformers import utils

    monkeypatch.setattr(utils, "AUDIO_TOKENIZER_NAME", NEW_NAME)


@pytest.fixture
def fresh_owner_caches():
    """The owners' answers are cached per process: asked again around a patch."""
    cached = (af._transformers_names, af._vocab_files_of)  # the real ones: a test may patch them out
    for f in cached:
        f.cache_clear()
    yield
    for f in cached:
        f.cache_clear()


@pytest.mark.parametrize("newer", [_with_class_name, _with_constant], ids=["vocab_files_names", "constant"])
@pytest.mark.parametrize("asked", [True, False], ids=["asked at run time", "control: lookup bypassed"])
def test_a_name_only_the_installed_transformers_knows_is_covered(newer, asked: bool, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  fresh_owner_caches) -> None:
    """The run-time lookup (``select``'s ``ask_owners`` branch) is what covers a
    file a newer transformers reads: an edit of it changes the answer
    identity. Control: the same folder, the same patched transformers, with
    the lookup bypassed (the owners answer nothing): the file is not covered
    and its edit goes unseen, so the branch is what covers it."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    (tmp_path / NEW_NAME).write_text("a b c\n")
    newer(monkeypatch)
    if not asked:
        monkeypatch.setattr(af, "_transformers_names", lambda: frozenset())
        monkeypatch.setattr(af, "_vocab_files_of", lambda name: frozenset())
    recorded = af.answer_files(tmp_path)
    (tmp_path / NEW_NAME).write_text("a b d\n")
    seen = [str(c) for c in af.changes(recorded, tmp_path)]
    if asked:
        assert NEW_NAME in recorded and seen == [f"{NEW_NAME} changed"], (recorded, seen)
    else:
        assert NEW_NAME not in recorded and seen == [], (recorded, seen)
