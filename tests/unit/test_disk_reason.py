"""Why a rank reads from disk: one row per reason kind (issue 39).

Each row is the situation and the kind and words :func:`explain` gives it;
a check makes sure every kind in :data:`KINDS` has a row. The announcement
is one load event per read (outcome ``miss``, mode ``adopt``, source
``disk``), except a failed proof, whose error event ``adopt`` already wrote.
Its control: a reason the old daemon gave (none: ``Outcome()``) says only
``nothing_stored``, not why.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from preload.daemon import disk_reason
from preload.daemon.adopt import Outcome, expired_why
from preload.daemon.keeper_start import note_expired
from preload.daemon.stage import RankConfig

pytestmark = pytest.mark.unit

D = "ab" * 32


def _cfg(**kw) -> RankConfig:
    return RankConfig(checkpoint="/models/m", **kw)


ROWS = [
    # (id, cfg, digest, store_state, outcome, kind, words in why, fields)
    ("no_store_flag", _cfg(fd_store=False), D, "disabled", Outcome(), "no_store", "--no-fd-store", ()),
    ("no_keeper", _cfg(), D, "absent", Outcome(), "no_store", "no keeper runs under ROOT", ()),
    ("keeper_died", _cfg(), D, "unreachable", Outcome(), "store_lost", "ROOT/keeper.sock is there but no keeper", ()),
    ("store_failed", _cfg(), D, "cannot start the keeper", Outcome(), "store_lost", "cannot be used: cannot start", ()),
    ("nothing", _cfg(), D, "", Outcome(kind="nothing_stored", why="holds no arena"), "nothing_stored", "holds no", ()),
    ("expired", _cfg(), D, "", Outcome(kind="arena_expired", why=expired_why(D, 0, time.time() - 5, 60)),
     "arena_expired", "expired at", ()),
    ("stage", _cfg(), D, "", Outcome(kind="stage_differs", why="stage loaded/shm"), "stage_differs", "stage", ()),
    ("key", _cfg(), D, "", Outcome(kind="key_differs", why="differs in config_digest", fields=("config_digest",)),
     "key_differs", "config_digest", ("config_digest",)),
    ("proof", _cfg(), D, "", Outcome(kind="proof_failed", why="its proof failed: no write seal"), "proof_failed",
     "no write seal", ()),
    ("key_unknown", _cfg(stage="loaded"), D, "", Outcome(kind="key_unknown", why="only after the fill"),
     "key_unknown", "after the fill", ()),
    ("digest_unknown", _cfg(), None, "", Outcome(), "digest_unknown", "no --expect-digest", ()),
    ("unsafe", _cfg(unsafe_identity="header_only"), D, "", Outcome(), "unsafe_identity", "--unsafe-identity", ()),
]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_each_reason(row, tmp_path: Path) -> None:
    _id, cfg, digest, state, outcome, kind, words, fields = row
    got = disk_reason.explain(cfg, digest, "ROOT", state, outcome)
    assert got.kind == kind and words in got.why and got.fields == fields, got


def test_every_kind_has_a_row() -> None:
    assert {r[5] for r in ROWS} == set(disk_reason.KINDS)


def test_an_expiry_left_by_a_keeper_gone_idle_is_said(tmp_path: Path) -> None:
    """No keeper runs any more (it exited idle after the TTL), its expiry is still read."""
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    note_expired(root, D, 0, 60.0)
    got = disk_reason.explain(_cfg(), D, str(root), "absent", Outcome())
    assert got.kind == "arena_expired" and "after its 60 s orphan TTL" in got.why
    # The neighbour: another rank did not expire: no store.
    assert disk_reason.explain(_cfg(global_rank=1), D, str(root), "absent", Outcome()).kind == "no_store"


def test_control_the_old_outcome_says_only_nothing_stored() -> None:
    """Before: a stored arena not adopted came back as ``Outcome()`` with no kind."""
    assert disk_reason.explain(_cfg(), D, "ROOT", "", Outcome()).kind == "nothing_stored"


@pytest.mark.parametrize("kind,events", [("key_differs", 1), ("proof_failed", 0)])
def test_one_event_per_read(kind: str, events: int, tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv("PRELOAD_GATE_EVENTS", str(path))
    reason = disk_reason.DiskReason(kind, "why", ("dtype",) if kind == "key_differs" else ())
    disk_reason.announce(reason, _cfg(), D)
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    assert len(lines) == events
    if events:
        (e,) = lines
        assert (e["outcome"], e["mode"], e["source"], e["reason"], e["fields"]) == (
            "miss", "adopt", "disk", "key_differs: why", ["dtype"])


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="not one of"):
        disk_reason.DiskReason("lost", "why")
