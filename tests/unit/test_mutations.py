"""The mutation table as a specification: every row, every anchor scheme.

The fingerprint matrix is parametrized from ``fixtures.mutations.MUTATIONS``;
a scheme that concludes anything other than the row's expectation fails.
header_only runs the labelled reimplementation here (this tier has no
vLLM); tests/cpu/test_fixtures_serve.py checks vLLM's own function agrees.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fixtures.mutations import MUTATIONS, SCHEMES, MutationError, by_name, copy_checkpoint
from fixtures.shardfile import decode
from pgbase.shards import read_header, shard_paths
from preload.identity import anchors

pytestmark = pytest.mark.unit


def _fingerprints(ckpt: Path) -> dict[str, str]:
    out = {}
    for scheme in SCHEMES:
        opts = {"implementation": "reimpl"} if scheme == "header_only" else {}
        out[scheme] = anchors.fingerprint(scheme, ckpt, **opts).hex
    return out


def _headers(ckpt: Path) -> list[bytes]:
    raw = []
    for p in shard_paths(ckpt):
        h = read_header(p)
        raw.append(p.read_bytes()[: h.data_start])
    return raw


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("row", MUTATIONS, ids=[r.name for r in MUTATIONS])
def test_fingerprint_matrix(row, shards, tiny_checkpoint, tmp_path):
    base = tiny_checkpoint(shards=shards)
    staged = row.stage(base, tmp_path)
    before = _fingerprints(staged)
    headers_before = _headers(staged)
    candidate = row.apply(staged, tmp_path)
    after = _fingerprints(candidate)
    got = {s: before[s] == after[s] for s in SCHEMES}
    assert got == dict(row.expected), f"{row.name}: schemes concluded {got}"
    # Recipes never touch a header: that is what makes header_only blind to them.
    assert _headers(candidate) == headers_before
    assert (candidate == staged) == row.in_place
    # The caller's base is never modified.
    assert _fingerprints(base)["content"] == _fingerprints(tiny_checkpoint(shards=shards))["content"]


@pytest.fixture(scope="module")
def observed(tiny_checkpoint, tmp_path_factory) -> dict[str, tuple[bool, dict[str, bool]]]:
    """Per row, measured on the bytes (not read from the table): whether the
    tensor values stayed equal, and per scheme whether it saw the same checkpoint."""
    base = tiny_checkpoint(shards=1)
    out = {}
    for row in MUTATIONS:
        tmp = tmp_path_factory.mktemp(f"observed-{row.name}")
        staged = row.stage(base, tmp)
        before, values_before = _fingerprints(staged), _values(staged)
        candidate = row.apply(staged, tmp)
        after = _fingerprints(candidate)
        out[row.name] = (_values(candidate) == values_before, {s: before[s] == after[s] for s in SCHEMES})
    return out


def _values(ckpt: Path) -> dict[str, bytes]:
    """Every tensor's raw value bytes, by name (safetensors' reading of the files)."""
    from safetensors import safe_open

    out = {}
    for p in shard_paths(ckpt):
        with safe_open(str(p), framework="pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return out


def test_the_issues_claims_hold_on_the_bytes(observed):
    """The headline claims, measured: header_only misses every value edit,
    content catches every one, sampled_1k misses exactly the edits past the
    first KiB of a tensor; an identical copy is the same content, an in-place
    overwrite the same path with other content."""
    value_edits = {name for name, (values_equal, _) in observed.items() if not values_equal}
    assert {"zeroed_norm", "tail_edit", "finetune_noise", "inplace_overwrite"} <= value_edits
    assert all(observed[n][1]["header_only"] for n in value_edits), "header_only misses every value edit"
    assert not any(observed[n][1]["content"] for n in value_edits), "content catches every value edit"
    assert {n for n in value_edits if observed[n][1]["sampled_1k"]} == {"tail_edit", "mid_row_zeroed", "single_element"}
    copy_values_equal, copy = observed["identical_copy"]
    assert copy_values_equal and copy["content"] and not copy["realpath"]
    over = observed["inplace_overwrite"][1]
    assert over["realpath"] and not over["content"]


def test_the_table_declares_what_the_bytes_show(observed):
    """Each row's declared ``weights_equal`` is what the bytes show (the
    matrix test above holds its scheme columns to the bytes)."""
    assert {r.name: r.weights_equal for r in MUTATIONS} == {n: v for n, (v, _) in observed.items()}


def test_rows_are_unique_and_complete():
    names = [r.name for r in MUTATIONS]
    assert len(names) == len(set(names))
    for required in ("identical_copy", "zeroed_norm", "tail_edit", "mid_row_zeroed", "single_element",
                     "finetune_noise", "constant_shift", "first_row_zeroed", "inplace_overwrite"):
        assert required in names
    for r in MUTATIONS:
        assert set(r.expected) == set(SCHEMES)


def _edit_byte(ckpt: Path, offset_in_tensor: int) -> str:
    p = shard_paths(ckpt)[0]
    t = max(read_header(p).tensors, key=lambda t: (t.nbytes, t.name))
    with open(p, "r+b") as f:
        f.seek(t.begin + offset_in_tensor)
        b = f.read(1)
        f.seek(t.begin + offset_in_tensor)
        f.write(bytes([b[0] ^ 0x40]))
    return t.name


@pytest.mark.parametrize(("offset", "caught"), [(0, True), (1000, True), (1023, True), (1024, False), (1100, False)])
def test_sampled_1k_reads_exactly_the_first_kib(offset, caught, tiny_ckpt, tmp_path):
    """Control for the matrix: sampled_1k really reads bytes 0..1023 of a tensor and no more."""
    cand = copy_checkpoint(tiny_ckpt, tmp_path / "c")
    _edit_byte(cand, offset)
    base_fp = anchors.sampled_1k(tiny_ckpt).hex
    assert (anchors.sampled_1k(cand).hex != base_fp) is caught
    # content sees every one of them.
    assert anchors.content(cand).hex != anchors.content(tiny_ckpt).hex


def test_recipes_are_deterministic(tiny_ckpt, tmp_path):
    for row in MUTATIONS:
        if row.weights_equal:
            continue
        a = row.apply(row.stage(tiny_ckpt, tmp_path / "a"), tmp_path / "a")
        b = row.apply(row.stage(tiny_ckpt, tmp_path / "b"), tmp_path / "b")
        assert anchors.content(a).hex == anchors.content(b).hex, row.name


def test_edits_change_the_values_they_claim(tiny_ckpt, tmp_path):
    """mid_row_zeroed zeroes exactly one row past the first KiB; single_element changes one element."""
    p = shard_paths(tiny_ckpt)[0]
    big = min((t for t in read_header(p).tensors if len(t.shape) == 2), key=lambda t: (-t.nbytes, t.name))
    raw = p.read_bytes()
    base_vals = decode(raw[big.begin:big.end], big.dtype, big.shape)
    for name, check in (
        ("mid_row_zeroed", lambda d: (d.any(axis=1).sum() == 1 and (base_vals[big.shape[0] // 2] != 0).any())),
        ("single_element", lambda d: d.sum() == 1),
        ("first_row_zeroed", lambda d: d[0].all() and d.any(axis=1).sum() == 1),
    ):
        row = by_name(name)
        cand = row.apply(row.stage(tiny_ckpt, tmp_path), tmp_path)
        craw = (cand / p.name).read_bytes()
        vals = decode(craw[big.begin:big.end], big.dtype, big.shape)
        assert check(vals != base_vals), name


def test_copy_checkpoint_refuses_an_existing_target(tiny_ckpt, tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(MutationError, match="already exists"):
        copy_checkpoint(tiny_ckpt, tmp_path / "x")


def test_unknown_row_names_the_known_ones():
    with pytest.raises(MutationError, match="identical_copy"):
        by_name("nope")


def test_recipe_on_a_checkpoint_without_value_tensors(tmp_path):
    from fixtures.shardfile import RawTensor, write_shard

    ckpt = tmp_path / "ints"
    ckpt.mkdir()
    write_shard(ckpt / "model.safetensors", {"ids": RawTensor("I32", (4,), bytes(16))})
    with pytest.raises(MutationError, match="no F32/F16/BF16 tensor"):
        by_name("tail_edit").apply(ckpt, tmp_path / "w")
