"""The files besides the weights and ``config.json`` that decide a model's answers.

The same tensors answer differently under another chat template (field case
t11: an edited ``chat_template.jinja``), other tokenizer files, other
generation defaults, another processor config, or other remote code. Which
files those are is decided by the libraries that read them, so the names are
theirs:

- transformers' tokenizer loader (``PreTrainedTokenizerBase.from_pretrained``
  on a local folder) reads its class's ``vocab_files_names`` and
  ``added_tokens.json``, ``special_tokens_map.json``, ``tokenizer_config.json``,
  ``tokenizer.json``, ``chat_template.jinja`` (``tokenization_utils_base``,
  ``utils.hub``), every ``additional_chat_templates/*.jinja`` (found with
  ``Path.glob``, hidden names included, as transformers lists them), and the
  versioned ``tokenizer.*.json`` named by ``tokenizer_config.json``'s
  ``fast_tokenizer_files``;
- its processors read ``processor_config.json``, ``preprocessor_config.json``
  (image processors and feature extractors), ``video_preprocessor_config.json``,
  ``audio_tokenizer_config.json`` and ``chat_template.json`` (``utils``);
- ``GenerationConfig`` reads ``generation_config.json``. vLLM applies it
  (``--generation-config auto``, the default): ``ModelConfig.get_diff_sampling_param``
  fills every sampling field a request leaves out (the canary states all of
  them but ``top_k`` and ``min_p``, which ``SamplingParams`` resets for
  temperature 0), ``SamplingParams.update_from_generation_config`` adds its
  ``eos_token_id`` as stop tokens (ignored under the canary's ``ignore_eos``),
  and some models read it when they are built, whatever the request says
  (vLLM 0.32 ``llama4.py``: ``attn_temperature_tuning``; ``gemma4_mm.py``,
  ``gemma4_unified.py``, ``gemma4_mtp.py``: ``suppress_tokens``). It decides answers;
- mistral_common (through transformers' ``MistralCommonBackend``, which vLLM's
  ``--tokenizer-mode mistral`` uses) reads ``tekken.json`` or a
  ``*.model.v<version>`` SentencePiece file; vLLM reads a Mistral-format
  config from ``params.json`` (``transformers_utils.config.MISTRAL_CONFIG_NAME``);
- under ``trust_remote_code``, the Python modules an ``auto_map`` names (and
  the modules they import) are the model, tokenizer or processor: where any
  config holds an ``auto_map``, every top-level ``*.py`` file counts.

Each name is asked of transformers where it is importable (its constants,
and the ``vocab_files_names`` of the tokenizer class the folder names); the
same names are held here for a process where it is not (the preload layer
imports without it), and ``tests/unit/test_answer_files_owners.py`` holds
them equal to transformers', vLLM's and mistral_common's. The names held
here always count: an owner can only add to them, so a golden recorded where
transformers is installed and checked where it is not covers the same files.

A record is ``{relative path: sha256 hex}`` of the files present, so a
difference is named file by file (:func:`changes`).

>>> answer_files("/models/smollm2")  # doctest: +SKIP
{'chat_template.jinja': '9c1f...', 'generation_config.json': '4b2e...', 'tokenizer.json': '...', ...}
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from pgbase.oscause import FILE_LIMIT_ERRNOS
from preload.identity.digest import hash_file

# transformers' tokenizer files besides the class's own (tokenization_utils_base
# ADDED_TOKENS_FILE, SPECIAL_TOKENS_MAP_FILE, TOKENIZER_CONFIG_FILE,
# FULL_TOKENIZER_FILE; utils.hub CHAT_TEMPLATE_FILE).
TOKENIZER_NAMES = ("added_tokens.json", "special_tokens_map.json", "tokenizer_config.json", "tokenizer.json",
                   "chat_template.jinja")
# utils.hub CHAT_TEMPLATE_DIR: named chat templates, one ``NAME.jinja`` each.
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# Every value of every tokenizer class's ``vocab_files_names``: the classes
# TOKENIZER_MAPPING_NAMES maps and the backends (TokenizersBackend,
# SentencePieceBackend). The union, not the folder's one class: the class is
# transformers' choice at load time (AutoTokenizer has a dozen branches), and
# a name that counts in one process must count in every other.
VOCAB_FILE_NAMES = (
    "bpe.codes", "byte_maps.json", "dict.txt", "emoji.json", "entity_vocab.json", "merges.txt",
    "normalizer.json", "prophetnet.tokenizer", "sentencepiece.bpe.model", "sentencepiece.model", "source.spm",
    "spiece.model", "spm.model", "spm_char.model", "target.spm", "target_vocab.json", "tokenizer.json",
    "tokenizer.model", "tokenizer_config.json", "vocab-src.json", "vocab-tgt.json", "vocab.json", "vocab.txt",
    "word_pronunciation.json", "word_shape.json",
)
# utils PROCESSOR_NAME, IMAGE_PROCESSOR_NAME (= FEATURE_EXTRACTOR_NAME),
# VIDEO_PROCESSOR_NAME, AUDIO_TOKENIZER_NAME; utils.hub
# LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE.
PROCESSOR_NAMES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
                   "audio_tokenizer_config.json", "chat_template.json")
GENERATION_NAMES = ("generation_config.json",)  # utils GENERATION_CONFIG_NAME
VLLM_NAMES = ("params.json",)  # vLLM transformers_utils.config.MISTRAL_CONFIG_NAME
# mistral_common's tokenizer files (tokens.tokenizers.utils
# _filter_valid_tokenizer_files: tekken.json, or a name whose suffixes are
# ``.model`` or ``.model.v<TokenizerVersion><MultiModalVersion>``), and
# transformers' fallback pattern for them (``tekken\.json|tokenizer\.model\.*|
# tiktoken\.model``). Ours is wider: any ``*.model`` or ``*.model.v*``.
_MISTRAL_FILE = re.compile(r"tekken\.json|[^/]*\.model(\.v[0-9a-z]+)?")
# Configs whose ``auto_map`` makes the folder's Python modules the model,
# tokenizer or processor (transformers' dynamic_module_utils loads them).
_AUTO_MAP_CONFIGS = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json",
                     "video_preprocessor_config.json")

# What goldens recorded before answer files digested as ``tokenizer_digest``
# (a hand list, kept only to tell an operator what such a golden covers).
LEGACY_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "tekken.json",
)


@dataclass(frozen=True)
class AnswerFileRule:
    """Which files of a folder decide answers.

    ``names``: top-level file names; ``template_dir``: a folder whose
    ``*.jinja`` files are named chat templates; ``ask_owners``: whether
    transformers is asked about the files these leave unexplained;
    ``excluded``: relative paths never picked (see :meth:`without`).
    """

    names: frozenset[str]
    template_dir: str = CHAT_TEMPLATE_DIR
    ask_owners: bool = True
    excluded: frozenset[str] = frozenset()

    def without(self, name: str) -> AnswerFileRule:
        """This rule picking ``name`` by no route (its name, a pattern, an
        owner's answer): the control of a differential test."""
        return AnswerFileRule(self.names - {name}, self.template_dir, ask_owners=False,
                              excluded=self.excluded | {name})


# The names held here; transformers is asked about the rest where importable.
RULE = AnswerFileRule(frozenset(TOKENIZER_NAMES + VOCAB_FILE_NAMES + PROCESSOR_NAMES + GENERATION_NAMES
                                + VLLM_NAMES))


@dataclass(frozen=True)
class Change:
    """One answer file that differs from a record: ``changed``, ``added`` (present now, not recorded) or ``removed``."""

    name: str
    kind: str

    def __str__(self) -> str:
        return f"{self.name} {self.kind}"


@functools.cache
def _transformers_names() -> frozenset[str]:
    """transformers' file-name constants; empty where it is not importable.

    Any failure leaves only the names held here, which always count: the
    owner's answer can add a name (a newer transformers), never remove one.
    """
    try:
        from transformers import tokenization_utils_base as tub
        from transformers import utils
        from transformers.utils import hub
    except Exception:  # noqa: BLE001 (absent, or broken by an optional dependency)
        return frozenset()
    found = [getattr(tub, n, None) for n in ("ADDED_TOKENS_FILE", "SPECIAL_TOKENS_MAP_FILE", "TOKENIZER_CONFIG_FILE",
                                             "FULL_TOKENIZER_FILE")]
    found += [getattr(hub, n, None) for n in ("CHAT_TEMPLATE_FILE", "LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE")]
    found += [getattr(utils, n, None) for n in ("PROCESSOR_NAME", "IMAGE_PROCESSOR_NAME", "FEATURE_EXTRACTOR_NAME",
                                                "VIDEO_PROCESSOR_NAME", "AUDIO_TOKENIZER_NAME",
                                                "GENERATION_CONFIG_NAME")]
    return frozenset(n for n in found if isinstance(n, str))


@functools.cache
def _vocab_files_of(class_name: str) -> frozenset[str]:
    """``vocab_files_names`` of transformers' tokenizer class ``class_name``
    (its top-level name, as ``tokenizer_class_from_name`` falls back to, Fast
    aliases included); empty where there is none."""
    try:
        import transformers

        names = getattr(getattr(transformers, class_name, None), "vocab_files_names", None)
    except Exception:  # noqa: BLE001 (absent, a missing optional dependency: a dummy class raises)
        return frozenset()
    return frozenset(v for v in names.values() if isinstance(v, str)) if isinstance(names, dict) else frozenset()


def _read_json(path: Path) -> dict[str, Any]:
    """A config as a dict; {} when absent or unreadable (its bytes are digested either way)."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _tokenizer_class_files(root: Path) -> frozenset[str]:
    """Names of the tokenizer class ``tokenizer_config.json`` names
    (``tokenizer_class``, with and without ``Fast``, as AutoTokenizer tries it).

    A folder that names none gets the class AutoTokenizer maps its
    ``model_type`` to; every mapped class's names are held here already
    (:data:`VOCAB_FILE_NAMES`), and asking transformers' mapping costs far more
    (it imports every model's configuration), so it is not asked.
    """
    tc = _read_json(root / "tokenizer_config.json").get("tokenizer_class")
    if not isinstance(tc, str) or not tc.isidentifier():
        return frozenset()
    return _vocab_files_of(tc) | _vocab_files_of(tc.removesuffix("Fast") if tc.endswith("Fast") else tc + "Fast")


def _safe_relative(name: object) -> str | None:
    """``name`` as a path inside the folder, or None (absolute, ``..``, empty)."""
    if not isinstance(name, str) or not name or "\\" in name:
        return None
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or str(p) != name:
        return None
    return name


def _weights_or_config(name: str) -> bool:
    """Files another digest covers: the weights (content digest) and config.json (config digest)."""
    return name == "config.json" or name.endswith((".safetensors", ".bin", ".index.json"))


def select(checkpoint: str | os.PathLike[str], answer_rule: AnswerFileRule = RULE) -> list[str]:
    """Relative paths of the answer files present in ``checkpoint``, sorted by byte order.

    transformers is asked (``answer_rule.ask_owners``) only where a top-level
    file is left that the names held here do not pick and no other digest
    covers: an owner's names can only add such a file, and asking costs
    seconds (importing transformers' tokenizers).
    """
    root = Path(checkpoint)
    try:
        top = [e.name for e in os.scandir(root) if e.is_file()]
    except OSError as exc:
        if exc.errno in FILE_LIMIT_ERRNOS:
            raise  # not "no answer files": a key without them would name other content
        return []
    picked = {n for n in top if n in answer_rule.names or _MISTRAL_FILE.fullmatch(n)}
    listed = _read_json(root / "tokenizer_config.json").get("fast_tokenizer_files")
    if isinstance(listed, list):
        picked |= {n for n in map(_safe_relative, listed) if n is not None and (root / n).is_file()}
    if (root / answer_rule.template_dir).is_dir():
        # As transformers finds them: Path.glob("*.jinja"), hidden names included.
        picked |= {f"{answer_rule.template_dir}/{p.name}"
                   for p in (root / answer_rule.template_dir).glob("*.jinja") if p.is_file()}
    if any("auto_map" in _read_json(root / c) for c in _AUTO_MAP_CONFIGS if c in top):
        picked |= {n for n in top if n.endswith(".py") and not n.startswith(".")}
    rest = {n for n in top if n not in picked and not _weights_or_config(n)}
    if rest and answer_rule.ask_owners:
        picked |= rest & (_transformers_names() | _tokenizer_class_files(root))
    picked -= answer_rule.excluded | {"config.json"}
    return sorted(picked, key=lambda n: n.encode("utf-8", "surrogateescape"))


def answer_files(checkpoint: str | os.PathLike[str], answer_rule: AnswerFileRule = RULE) -> dict[str, str]:
    """``{relative path: sha256 hex}`` of every answer file present in ``checkpoint``."""
    root = Path(checkpoint)
    return {name: hash_file(root / name) for name in select(root, answer_rule)}


def changes(recorded: Mapping[str, str], checkpoint: str | os.PathLike[str],
            answer_rule: AnswerFileRule = RULE) -> list[Change]:
    """How ``checkpoint``'s answer files differ from ``recorded``, file by file.

    Every recorded name is looked at as well as every name the rule picks
    now, so a record made where the rule named more files (a newer
    transformers) is still compared on all of them.
    """
    root = Path(checkpoint)
    now = answer_files(root, answer_rule)
    for name in recorded:
        if name not in now and _safe_relative(name) and (root / name).is_file():
            now[name] = hash_file(root / name)
    out = []
    for name in sorted(set(recorded) | set(now)):
        if name not in now:
            out.append(Change(name, "removed"))
        elif name not in recorded:
            out.append(Change(name, "added"))
        elif recorded[name] != now[name]:
            out.append(Change(name, "changed"))
    return out


def valid_name(name: object) -> bool:
    """Whether a recorded name is a path inside a checkpoint folder."""
    return _safe_relative(name) is not None


def legacy_tokenizer_digest(checkpoint: str | os.PathLike[str], names: Iterable[str] = LEGACY_TOKENIZER_FILES
                            ) -> str | None:
    """The ``tokenizer_digest`` goldens recorded before answer files: SHA-256
    over ``sha256sum``-style lines of the :data:`LEGACY_TOKENIZER_FILES` present; None if none."""
    root = Path(checkpoint)
    lines = [f"{hash_file(root / n)}  {n}\n" for n in sorted(names) if (root / n).is_file()]
    return hashlib.sha256("".join(lines).encode()).hexdigest() if lines else None
