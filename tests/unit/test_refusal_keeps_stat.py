"""A refused verb leaves every directory's stat as it was.

``pgbase.outdir.check_output_dir`` proves a directory writable by making and
removing a probe in it, which changes that directory's mtime and ctime; a
promoted checkpoint's manifest records its directory's stat, so a probe in
the checkpoint before a refusal made the promotion stale (every engine then
missed). Each row points a verb's output at a promoted checkpoint, or inside
it, with a mistake the verb refuses, and checks exit 2, the checkpoint's
stat unchanged and the promotion still fresh.

Control: the same checker on a run that does write into the checkpoint
(``fixtures tiny`` into a fresh subfolder) sees the stat change.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fixtures.tiny import write_tiny
from preload.identity.manifest import load_manifest, stale_reason
from preload.promote import promote
from preload_gate.cli import main as cli_main

pytestmark = pytest.mark.unit


@pytest.fixture()
def promoted(tmp_path: Path) -> tuple[Path, Path]:
    ckpt = write_tiny(tmp_path / "ckpt", arch="qwen3", shards=1, seed=3)
    cache = tmp_path / "cache"
    promote(ckpt, cache_dir=cache, progress=False)
    return ckpt, cache


def _stat(p: Path) -> tuple[int, int]:
    st = os.stat(p)
    return st.st_mtime_ns, st.st_ctime_ns


def _fresh(ckpt: Path, cache: Path) -> str | None:
    manifest = load_manifest(ckpt, cache_dir=cache)
    assert manifest is not None
    why = stale_reason(ckpt, manifest)
    return None if why is None else why[0]


ROWS = [
    # OUT is the checkpoint itself: not empty, refused (the field report).
    ("fixtures into the checkpoint", ["fixtures", "tiny", "{ckpt}"], "not an empty directory"),
    # --report inside the checkpoint, and a mutation name the gate refuses.
    ("gate, unknown mutation", ["gate", "{ckpt}", "--mutations", "no_such_case", "--report", "{ckpt}/report"],
     "no_such_case"),
    # The golden beside the weights, and a dtype the engine would refuse.
    ("canary record, bad dtype", ["canary", "record", "--model", "{ckpt}", "--out", "{ckpt}/golden.json",
                                  "--dtype", "float7"], "float7"),
    ("canary record, missing prompts", ["canary", "record", "--model", "{ckpt}", "--out", "{ckpt}/sub/g.json",
                                        "--prompts", "{ckpt}/no-such-prompts.txt"], "no-such-prompts"),
    # OUT through a missing folder and back: the folder it resolves to is the checkpoint.
    ("fixtures through x/../..", ["fixtures", "tiny", "{ckpt}/x/../../ckpt"], "not an empty directory"),
    # A later flag bad: no earlier flag's directory probed first.
    ("gate, bad later directory", ["gate", "{ckpt}", "--report", "{ckpt}", "--reference-cache",
                                   "{ckpt}/config.json"], "--reference-cache"),
    ("gate, bad dtype", ["gate", "{ckpt}", "--report", "{ckpt}/r", "--dtype", "bogus"], "bogus"),
    ("bench, unknown param", ["bench", "--out", "{ckpt}", "--param", "bogus=1"], "bogus"),
    ("bench, unknown row", ["bench", "--out", "{ckpt}/b", "--workdir", "{ckpt}", "--only", "nosuch"], "nosuch"),
    ("demo, unknown mutation", ["demo", "--report", "{ckpt}", "--mutations", "nosuch"], "nosuch"),
]


@pytest.mark.parametrize(("label", "argv", "says"), ROWS, ids=[r[0] for r in ROWS])
def test_a_refusal_leaves_the_checkpoint_stat_and_its_promotion_fresh(
        promoted: tuple[Path, Path], label: str, argv: list[str], says: str,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt, cache = promoted
    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(cache))
    assert _fresh(ckpt, cache) is None
    before = _stat(ckpt)
    assert cli_main([a.replace("{ckpt}", str(ckpt)) for a in argv]) == 2
    assert says in capsys.readouterr().err
    assert _stat(ckpt) == before, f"{label}: the refusal changed the checkpoint directory's stat"
    assert _fresh(ckpt, cache) is None


def test_control_a_run_that_writes_in_the_checkpoint_changes_its_stat(promoted: tuple[Path, Path]) -> None:
    ckpt, cache = promoted
    before = _stat(ckpt)
    assert cli_main(["fixtures", "tiny", str(ckpt / "sub")]) == 0
    assert _stat(ckpt) != before
    assert _fresh(ckpt, cache) is not None
