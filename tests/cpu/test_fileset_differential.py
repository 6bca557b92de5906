"""The shard set is vLLM's: its own selection, and a mirror proven equal to it.

A generated corpus of checkpoint layouts (hidden files, AppleDouble ``._*``
sidecars, ``consolidated*.safetensors`` beside indexed shards, in a
subdirectory, index weight maps naming a subset or a missing file, broken
indexes, ``.bin``/``.pt`` only, mixed, trainer files, directories and
symlinks named ``*.safetensors``) plus the field's handed layouts (c01, c02).
For each layout:

- ``mirror_selection`` (used without vLLM: the raw stage, the GPU machine)
  gives exactly what vLLM 0.32's ``DefaultModelLoader._prepare_weights``
  gives for ``auto`` (asked of vLLM here), or both refuse;
- ``promote`` hashes exactly those files, or refuses in one line when the
  cache cannot serve them (``.bin`` weights).

Control: the rule this project used before (every ``*.safetensors``, index
filtered, no mistral switch, hidden files included) is run through the same
comparison and must be caught.

No engine is started; vLLM is imported.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

from safetensors.numpy import save_file  # noqa: E402

from pgbase.errors import CheckpointError  # noqa: E402
from pgbase.fileset import (  # noqa: E402
    FileSet,
    SelectionError,
    mirror_selection,
    servable,
    vllm_selection,
)
from preload.identity.manifest import build_manifest  # noqa: E402

pytestmark = pytest.mark.cpu

N_RANDOM = 240


def _st(path: Path, tag: str) -> None:
    """A valid one-tensor safetensors file whose tensor name is unique to it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({f"t.{tag}": np.arange(4, dtype=np.float32)}, str(path))


def _appledouble(path: Path) -> None:
    path.write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + b"\0" * 4070)


def _index(path: Path, files: list[str], how: str) -> None:
    if how == "full":
        obj: object = {"metadata": {}, "weight_map": {f"t.{f}": f for f in files}}
    elif how == "subset":
        obj = {"metadata": {}, "weight_map": {f"t.{f}": f for f in files[:1]}}
    elif how == "missing":
        obj = {"weight_map": {"t.x": "model-99999-of-99999.safetensors", **{f"t.{f}": f for f in files}}}
    elif how == "no_weight_map":
        obj = {"metadata": {}}
    elif how == "list_map":
        obj = {"weight_map": files}
    else:
        path.write_text("{not json")
        return
    path.write_text(json.dumps(obj))


def _random_layout(root: Path, rng: random.Random) -> Path:
    d = root / f"r{rng.randrange(1 << 30):x}"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    n = rng.choice([0, 1, 1, 2, 3])
    hf = ["model.safetensors"] if n == 1 and rng.random() < 0.5 else [
        f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    for f in hf:
        _st(d / f, f)
    if hf and rng.random() < 0.5:
        _index(d / "model.safetensors.index.json", hf,
               rng.choice(["full", "full", "subset", "missing", "no_weight_map", "list_map", "bad"]))
    cons = rng.choice([[], [], ["consolidated.safetensors"],
                       ["consolidated-00001-of-00002.safetensors", "consolidated-00002-of-00002.safetensors"]])
    for f in cons:
        _st(d / f, f)
    if cons and rng.random() < 0.3:
        _index(d / "consolidated.safetensors.index.json", cons, rng.choice(["full", "subset", "missing"]))
    if rng.random() < 0.15:
        _st(d / "original" / "consolidated.safetensors", "sub")  # the switch looks below the folder
    if rng.random() < 0.3:
        for f in (hf + cons)[:2] or ["model.safetensors"]:
            _appledouble(d / f"._{f}")
    if rng.random() < 0.15:
        _st(d / ".hidden.safetensors", "hidden")
    if rng.random() < 0.1:
        _appledouble(d / "._consolidated.safetensors")
    for name, p in (("pytorch_model.bin", 0.2), ("training_args.bin", 0.2), ("optimizer.pt", 0.15),
                    ("scheduler.pt", 0.1), ("model.pt", 0.1), ("optimizer.bin", 0.1)):
        if rng.random() < p:
            (d / name).write_bytes(b"\x80\x02pickle")
    if rng.random() < 0.05:
        (d / "extra.safetensors").mkdir()
    if rng.random() < 0.08 and hf:
        os.symlink(d / hf[0], d / "alias.safetensors")
    if rng.random() < 0.05:
        os.symlink(d / "nowhere.safetensors", d / "dangling.safetensors")
    return d


def _handed(root: Path) -> list[Path]:
    """The field's layouts: c01 (AppleDouble sidecars) and c02 (consolidated beside an index)."""
    c01 = root / "c01"
    c01.mkdir()
    _st(c01 / "model.safetensors", "m")
    _appledouble(c01 / "._model.safetensors")
    _appledouble(c01 / "._config.json")
    c02 = root / "c02"
    c02.mkdir()
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for f in shards:
        _st(c02 / f, f)
    _index(c02 / "model.safetensors.index.json", shards, "full")
    _st(c02 / "consolidated.safetensors", "c")
    bin_only = root / "bin_only"
    bin_only.mkdir()
    (bin_only / "pytorch_model.bin").write_bytes(b"\x80\x02")
    (bin_only / "training_args.bin").write_bytes(b"\x80\x02")
    return [c01, c02, bin_only]


def _outcome(select, d: Path) -> tuple | str:
    try:
        fs: FileSet = select(d)
    except SelectionError:
        return "refused"
    return (fs.files, fs.use_safetensors, fs.index_file)


def _old_rule(d: Path) -> FileSet:
    """Control: the selection before this issue (no mistral switch, hidden files in)."""
    names = sorted(e.name for e in os.scandir(d) if e.name.endswith(".safetensors"))
    idx = d / "model.safetensors.index.json"
    if idx.is_file():
        try:
            wanted = set(json.loads(idx.read_text())["weight_map"].values())
        except Exception as exc:
            raise SelectionError(str(exc)) from exc
        names = [n for n in names if n in wanted]
    if not names:
        raise SelectionError("none")
    return FileSet(d, tuple(names), True, "model.safetensors.index.json", "old")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("layouts")
    rng = random.Random(11)
    return _handed(root) + [_random_layout(root, rng) for _ in range(N_RANDOM)]


def test_mirror_equals_vllm_on_every_layout(corpus):
    diffs = [(d.name, _outcome(mirror_selection, d), _outcome(vllm_selection, d)) for d in corpus]
    bad = [x for x in diffs if x[1] != x[2]]
    assert not bad, bad[:5]
    kinds = {o if isinstance(o, str) else ("st" if o[1] else "bin") + ("/mistral" if "consolidated" in o[2] else "")
             for _, o, _ in diffs}
    # The corpus exercises every branch: refusals, hf safetensors, the mistral switch, .bin sets.
    assert {"refused", "st", "st/mistral", "bin"} <= kinds, kinds


def test_control_the_old_rule_is_caught(corpus):
    bad = [d.name for d in corpus if _outcome(_old_rule, d) != _outcome(vllm_selection, d)]
    assert "c01" in bad and "c02" in bad and len(bad) > 20


def test_handed_layouts_select_what_the_field_saw(corpus):
    by = {d.name: d for d in corpus}
    assert vllm_selection(by["c01"]).files == ("model.safetensors",)
    assert vllm_selection(by["c02"]).files == ("consolidated.safetensors",)
    assert not vllm_selection(by["bin_only"]).use_safetensors


def test_promote_hashes_exactly_vllms_files_or_refuses_in_one_line(corpus, tmp_path):
    promoted = refused = 0
    for d in corpus:
        try:
            want = vllm_selection(d)
        except SelectionError:
            with pytest.raises(CheckpointError):
                build_manifest(d, progress=False)
            refused += 1
            continue
        try:
            servable(want)
        except CheckpointError as exc:
            with pytest.raises(CheckpointError) as info:
                build_manifest(d, progress=False)
            assert str(info.value) == str(exc) and "\n" not in str(exc)
            refused += 1
            continue
        try:
            m = build_manifest(d, progress=False)
        except CheckpointError as exc:
            # A symlinked shard holds the same tensors as its target: refused by name.
            assert "is stored in both" in str(exc) and (d / "alias.safetensors").is_symlink(), exc
            refused += 1
            continue
        assert tuple(s.name for s in m.shards) == want.files, d.name
        assert m.selection.startswith("vllm ")
        promoted += 1
    assert promoted > 50 and refused > 20, (promoted, refused)


def test_bin_only_layout_is_one_clear_line(corpus):
    d = next(d for d in corpus if d.name == "bin_only")
    with pytest.raises(CheckpointError, match=r"serves safetensors only") as info:
        servable(mirror_selection(d))
    assert "pytorch_model.bin" in str(info.value) and "training_args.bin" not in str(info.value)
