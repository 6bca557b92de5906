"""``preload-gate fingerprints``: the JSON contract, the table, and the matrix verb."""

from __future__ import annotations

import json

import pytest

from fixtures.mutations import MUTATIONS, SCHEMES, by_name
from preload_gate.cli import main

pytestmark = pytest.mark.unit


def test_json_contract(tiny_ckpt, tmp_path, capsys):
    row = by_name("tail_edit")
    cand = row.apply(row.stage(tiny_ckpt, tmp_path), tmp_path)
    rc = main(["fingerprints", "--base", str(tiny_ckpt), "--candidate", str(cand), "--json", "--header-impl", "reimpl"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["schemes"]) == set(SCHEMES)
    for scheme, r in doc["schemes"].items():
        assert isinstance(r["equal"], bool)
        assert len(r["base"]) in (32, 64) and len(r["candidate"]) in (32, 64)
        assert r["equal"] == row.expected[scheme]
    assert "reimplementation" in doc["schemes"]["header_only"]["implementation"]


def test_table_output(tiny_ckpt, tmp_path, capsys):
    row = by_name("identical_copy")
    cand = row.apply(row.stage(tiny_ckpt, tmp_path), tmp_path)
    assert main(["fingerprints", "--base", str(tiny_ckpt), "--candidate", str(cand), "--header-impl", "reimpl"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.split()}
    assert "same" in lines["content"] and "DIFFERENT" in lines["realpath"]


def test_matrix_verb_matches_the_table(tiny_checkpoint, capsys):
    rc = main(["fingerprints", "--base", str(tiny_checkpoint(shards=2)), "--mutations", "all",
               "--header-impl", "reimpl", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["as_expected"] is True
    assert [m["mutation"] for m in doc["matrix"]] == [r.name for r in MUTATIONS]
    inplace = next(m for m in doc["matrix"] if m["mutation"] == "inplace_overwrite")
    assert inplace["schemes"]["realpath"]["equal"] and not inplace["schemes"]["content"]["equal"]


def test_matrix_verb_flags_a_departure(tiny_ckpt, capsys, monkeypatch):
    """Control: if the table expected the wrong thing, the verb says so and exits 1."""
    import dataclasses

    import fixtures.mutations as m

    row = m.by_name("mid_row_zeroed")
    # Declares its edit inside the first KiB, so the table expects sampled_1k to see it.
    lying = dataclasses.replace(row, edit=m.IN_SAMPLE)
    assert lying.expected["sampled_1k"] is False
    monkeypatch.setattr(m, "MUTATIONS", (lying,))
    rc = main(["fingerprints", "--base", str(tiny_ckpt), "--mutations", "all", "--header-impl", "reimpl"])
    out = capsys.readouterr().out
    assert rc == 1 and "MISSED!" in out


def test_candidate_or_mutations_not_both(tiny_ckpt, capsys):
    assert main(["fingerprints", "--base", str(tiny_ckpt)]) == 2
    assert "exactly one of" in capsys.readouterr().err
