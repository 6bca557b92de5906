"""config.json as the cache key reads it: the shape transformers declares,
refused by name otherwise, and a digest that never crashes on valid JSON.

Rows of odd configs a store can hold (a field report: ``"architectures": 5``
was a traceback in the raw daemon; a lone surrogate escape crashed promote).
Each is one CheckpointError naming ``architectures`` or the JSON type, from
``read_config``, the raw-stage key and ``promote`` alike (exit 2, one line).
Controls: a valid config reads and keys as before, and its digest equals the
plain UTF-8 formula used so far (no manifest or golden changes).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from fixtures.tiny import write_tiny
from pgbase.errors import CheckpointError
from preload.daemon.raw import raw_key
from preload.identity.config import config_digest, read_config
from preload_gate.cli import main as cli_main

pytestmark = pytest.mark.unit

BAD = [
    ("architectures a number", '{"architectures": 5}', "architectures is 5"),
    ("architectures an object", '{"architectures": {"a": 1}}', "architectures is {"),
    ("architectures a string", '{"architectures": "LlamaForCausalLM"}', "not a list of model class names"),
    ("architectures holding null", '{"architectures": [null]}', "architectures is [null]"),
    ("a JSON list", '[1, 2]', "holds a JSON list, not an object"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("cfg") / "tiny", arch="qwen3", shards=1, seed=1)


def _with_config(tiny: Path, tmp_path: Path, text: str) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in tiny.iterdir():
        (ckpt / f.name).symlink_to(f)
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").write_text(text, encoding="utf-8")
    return ckpt


@pytest.mark.parametrize(("label", "text", "says"), BAD, ids=[b[0] for b in BAD])
def test_an_odd_config_is_one_named_refusal_everywhere(tiny: Path, tmp_path: Path, label: str, text: str,
                                                       says: str, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _with_config(tiny, tmp_path, text)
    with pytest.raises(CheckpointError, match=".*" + says.replace("[", r"\[").replace("{", r"\{")):
        read_config(ckpt)
    with pytest.raises(CheckpointError):
        raw_key(ckpt, "a" * 64, "shm")
    assert cli_main(["promote", str(ckpt), "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_a_lone_surrogate_escape_digests(tiny: Path, tmp_path: Path) -> None:
    ckpt = _with_config(tiny, tmp_path, '{"architectures": ["Qwen3ForCausalLM"], "note": "x\\ud800"}')
    d = config_digest(ckpt)
    assert d is not None and len(d) == 64
    assert config_digest(ckpt) == d


def test_control_a_valid_config_keys_as_before(tiny: Path) -> None:
    obj = json.loads((tiny / "config.json").read_text(encoding="utf-8"))
    assert read_config(tiny) == obj
    canon = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert config_digest(tiny) == hashlib.sha256(canon.encode()).hexdigest()
    assert raw_key(tiny, "a" * 64, "shm").architecture == obj["architectures"][0]


def test_control_non_ascii_text_digests_as_plain_utf8(tiny: Path, tmp_path: Path) -> None:
    ckpt = _with_config(tiny, tmp_path, '{"architectures": ["Qwen3ForCausalLM"], "note": "café ✓"}')
    canon = json.dumps(read_config(ckpt), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert config_digest(ckpt) == hashlib.sha256(canon.encode("utf-8")).hexdigest()
