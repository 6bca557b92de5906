"""The mutation table as a specification: every row, every anchor scheme.

Each file row declares what its recipe changes (where the byte edit falls,
in place or not, mtimes kept or not) and the table derives every expected
column from that. Two kinds of test hold it to the files: the change each
recipe really makes, measured on disk, must be the declared one; and the
fingerprints each scheme really computes (parametrized from
``fixtures.mutations.MUTATIONS``) must conclude what the derived columns
say. header_only runs the labelled reimplementation here (this tier has no
vLLM); tests/cpu/test_fixtures_serve.py checks vLLM's own function agrees.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fixtures.mutations import (
    CATALOGUE,
    IN_SAMPLE,
    MUTATIONS,
    NO_EDIT,
    PAST_SAMPLE,
    SCHEMES,
    MutationError,
    by_name,
    copy_checkpoint,
)
from fixtures.shardfile import decode
from pgbase.schemes import SAMPLE_BYTES
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


@dataclass(frozen=True)
class Observed:
    """One row applied to a copy of the base, measured on the files (never read from the table)."""

    values_equal: bool  # every tensor's bytes as safetensors reads them
    schemes: dict[str, bool]  # per scheme: the same fingerprint before and after
    edit: str  # where the changed bytes lie (_edit_region)
    in_place: bool  # the candidate is the staged base's own directory
    mtimes_kept: bool  # every shard's mtime_ns as it was


@pytest.fixture(scope="module")
def observed(tiny_checkpoint, tmp_path_factory) -> dict[str, Observed]:
    base = tiny_checkpoint(shards=3)
    out = {}
    for row in MUTATIONS:
        tmp = tmp_path_factory.mktemp(f"observed-{row.name}")
        staged = row.stage(base, tmp)
        before, values_before = _fingerprints(staged), _values(staged)
        raw_before, mtimes_before = _tensor_bytes(staged), _mtimes(staged)
        candidate = row.apply(staged, tmp)
        out[row.name] = Observed(
            values_equal=_values(candidate) == values_before,
            schemes={s: before[s] == b for s, b in _fingerprints(candidate).items()},
            edit=_edit_region(raw_before, _tensor_bytes(candidate)),
            in_place=candidate == staged,
            mtimes_kept=_mtimes(candidate) == mtimes_before,
        )
    return out


def _tensor_bytes(ckpt: Path) -> dict[str, bytes]:
    """Every tensor's bytes, by name, sliced at the offsets its shard's header gives."""
    out = {}
    for p in shard_paths(ckpt):
        raw = p.read_bytes()
        out.update({t.name: raw[t.begin:t.end] for t in read_header(p).tensors})
    return out


def _mtimes(ckpt: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in shard_paths(ckpt)}


def _edit_region(before: dict[str, bytes], after: dict[str, bytes]) -> str:
    """NO_EDIT, or where the earliest changed byte of any tensor lies: inside
    its first SAMPLE_BYTES (IN_SAMPLE) or only past them (PAST_SAMPLE)."""
    assert before.keys() == after.keys()
    firsts = [next(i for i, (x, y) in enumerate(zip(before[n], after[n], strict=True)) if x != y)
              for n in before if before[n] != after[n]]
    if not firsts:
        return NO_EDIT
    return IN_SAMPLE if min(firsts) < SAMPLE_BYTES else PAST_SAMPLE


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
    value_edits = {name for name, o in observed.items() if not o.values_equal}
    assert {"zeroed_norm", "tail_edit", "finetune_noise", "inplace_overwrite"} <= value_edits
    assert all(observed[n].schemes["header_only"] for n in value_edits), "header_only misses every value edit"
    assert not any(observed[n].schemes["content"] for n in value_edits), "content catches every value edit"
    assert {n for n in value_edits if observed[n].schemes["sampled_1k"]} == {"tail_edit", "mid_row_zeroed", "single_element"}
    copy = observed["identical_copy"]
    assert copy.values_equal and copy.schemes["content"] and not copy.schemes["realpath"]
    over = observed["inplace_overwrite"].schemes
    assert over["realpath"] and not over["content"]


def test_each_recipe_makes_the_change_its_row_declares(observed):
    """What each recipe did to the files (the edit's region, in place or a
    copy, mtimes) is what its row declares; the expected columns are derived
    from those declarations, so a wrong one would skew them all."""
    declared = {r.name: (r.edit, r.in_place, r.mtimes_kept, r.weights_equal) for r in MUTATIONS}
    measured = {n: (o.edit, o.in_place, o.mtimes_kept, o.values_equal) for n, o in observed.items()}
    assert measured == declared


@pytest.mark.parametrize(("offset", "region"), [(0, IN_SAMPLE), (SAMPLE_BYTES - 1, IN_SAMPLE),
                                                (SAMPLE_BYTES, PAST_SAMPLE), (None, NO_EDIT)])
def test_edit_region_control(offset, region, tiny_ckpt, tmp_path):
    """Control for the measurement above: one flipped byte at either side of
    the sample boundary, and none at all, are each told apart."""
    cand = copy_checkpoint(tiny_ckpt, tmp_path / "c")
    if offset is not None:
        _edit_byte(cand, offset)
    assert _edit_region(_tensor_bytes(tiny_ckpt), _tensor_bytes(cand)) == region


def test_a_setting_row_leaves_the_base_as_it_is(tiny_ckpt, tmp_path):
    """A setting row's candidate is the base itself, untouched: the gate
    serves the same bytes under other settings."""
    before, mtimes = _tensor_bytes(tiny_ckpt), _mtimes(tiny_ckpt)
    settings_rows = [r for r in CATALOGUE if not r.is_file]
    assert {r.name for r in settings_rows} == {"dtype_change", "tp_shift", "dp_shift", "tp_2_to_1"}
    for row in settings_rows:
        assert row.apply(row.stage(tiny_ckpt, tmp_path), tmp_path) == tiny_ckpt
        assert all(row.expected.values()), row.name
    assert _tensor_bytes(tiny_ckpt) == before and _mtimes(tiny_ckpt) == mtimes
    assert not list(tmp_path.iterdir()), "a setting row copies nothing"


def test_a_row_that_declares_no_file_change_cannot_carry_one():
    with pytest.raises(ValueError, match="setting row"):
        dataclasses.replace(by_name("dtype_change"), in_place=True)
    with pytest.raises(ValueError, match="edit"):
        dataclasses.replace(by_name("tail_edit"), edit="somewhere")


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
