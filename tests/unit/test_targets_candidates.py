"""Candidates made by :func:`harness.targets.checkpoints.make_candidate` never reach the base.

``make_candidate`` hard-links a finished npcache dump and copies everything
else; an in-place row (a trainer overwriting its snapshot) must rewrite a
private copy, whatever the format. The control links the touched weight file
as a naive speed-up would, and the same check catches it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

import harness.targets.checkpoints as checkpoints
from fixtures.binformat import to_bin
from fixtures.mutations import MUTATIONS, copy_checkpoint
from harness.mutations import case_by_name
from harness.targets.checkpoints import make_candidate

pytestmark = pytest.mark.unit
IN_PLACE = [r.name for r in MUTATIONS if r.in_place]


def _snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``root``: (inode, SHA-256 of its bytes)."""
    return {str(p.relative_to(root)): (p.stat().st_ino, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def _staged(tiny_ckpt: Path, tmp_path: Path, fmt: str) -> Path:
    base = copy_checkpoint(tiny_ckpt, tmp_path / "base")
    if fmt == "bin":
        to_bin(base)
    # A finished npcache dump, as vLLM leaves it (np/weight_names.json present).
    (base / "np").mkdir()
    (base / "np" / "w").write_bytes(b"dump")
    (base / "np" / "weight_names.json").write_text(json.dumps(["w"]))
    return base


def _base_changed(tiny_ckpt: Path, tmp_path: Path, row: str, fmt: str) -> bool:
    base = _staged(tiny_ckpt, tmp_path, fmt)
    before = _snapshot(base)
    cand = make_candidate(case_by_name(row), base, tmp_path / "work", fmt)
    assert cand != base
    after_cand = _snapshot(cand)
    # The candidate's weights did change, and the dump is shared by link.
    assert {k: v[1] for k, v in after_cand.items()} != {k: v[1] for k, v in before.items()}
    assert after_cand["np/w"][0] == before["np/w"][0]
    return _snapshot(base) != before


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("row", IN_PLACE)
def test_an_in_place_rows_candidate_never_changes_the_base(row, fmt, tiny_ckpt, tmp_path):
    assert not _base_changed(tiny_ckpt, tmp_path, row, fmt)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_control_a_naive_link_of_the_touched_file_is_caught(fmt, tiny_ckpt, tmp_path, monkeypatch):
    real = checkpoints.derive_copy

    def naive(src, dst):  # links the weight file too: the overwrite goes through to the base
        out = real(src, dst)
        for p in checkpoints.weight_files(out):
            p.unlink()
            os.link(Path(src) / p.name, p)
        return out

    monkeypatch.setattr(checkpoints, "derive_copy", naive)
    assert _base_changed(tiny_ckpt, tmp_path, "inplace_overwrite", fmt)


def test_an_unfinished_dump_is_copied_not_linked(tiny_ckpt, tmp_path):
    base = _staged(tiny_ckpt, tmp_path, "safetensors")
    (base / "np" / "weight_names.json").unlink()  # an engine would write the dump here
    cand = make_candidate(case_by_name("zeroed_norm"), base, tmp_path / "work", "safetensors")
    assert (cand / "np" / "w").stat().st_ino != (base / "np" / "w").stat().st_ino
