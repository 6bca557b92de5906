"""The published small experiment, re-run: eight 1024x1024 float16 tensors.

Edits: dense noise, a constant shift, the first row zeroed, row 500 zeroed,
one element at row 900, and a byte-identical copy. content catches all five
edits; header_only catches none; sampled_1k catches exactly noise, shift and
first row.
"""

from __future__ import annotations

import numpy as np
import pytest

from fixtures.mutations import copy_checkpoint
from fixtures.shardfile import encode, write_shard
from preload.identity import anchors

pytestmark = pytest.mark.unit

EDITS = {
    "noise": lambda w, rng: w + 0.01 * rng.standard_normal(w.shape, dtype=np.float32),
    "shift": lambda w, rng: w + 0.01,
    "first_row": lambda w, rng: np.concatenate([np.zeros_like(w[:1]), w[1:]]),
    "row_500": lambda w, rng: np.where(np.arange(w.shape[0])[:, None] == 500, 0.0, w),
    "element_900": lambda w, rng: _set(w, (900, 17), w[900, 17] + 1.0),
}


def _set(w, idx, value):
    w = w.copy()
    w[idx] = value
    return w


def _experiment(root, edit=None):
    rng = np.random.default_rng(1234)
    weights = {f"layer{i}.weight": rng.standard_normal((1024, 1024), dtype=np.float32) * 0.02 for i in range(8)}
    if edit is not None:
        weights["layer3.weight"] = EDITS[edit](weights["layer3.weight"], np.random.default_rng(5))
    root.mkdir()
    write_shard(root / "model.safetensors", {k: encode(v, "F16") for k, v in weights.items()})
    return root


def _caught(scheme, base, cand):
    opts = {"implementation": "reimpl"} if scheme == "header_only" else {}
    return anchors.fingerprint(scheme, base, **opts).hex != anchors.fingerprint(scheme, cand, **opts).hex


def test_published_experiment(tmp_path):
    base = _experiment(tmp_path / "base")
    caught = {scheme: set() for scheme in ("header_only", "sampled_1k", "content")}
    for edit in EDITS:
        cand = _experiment(tmp_path / edit, edit)
        for scheme in caught:
            if _caught(scheme, base, cand):
                caught[scheme].add(edit)
    assert caught["content"] == set(EDITS)
    assert caught["header_only"] == set()
    assert caught["sampled_1k"] == {"noise", "shift", "first_row"}

    copy = copy_checkpoint(base, tmp_path / "copy")
    assert not any(_caught(s, base, copy) for s in caught)
