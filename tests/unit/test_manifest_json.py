"""A promotion manifest read back from disk: its shape is msgspec's to check.

One row per way a manifest file goes bad, each with the message a person
acts on (the file, the field's path, the command to run); the written
manifest itself is the control that loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pgbase import atomic
from pgbase.errors import ManifestError
from preload.identity.digest import checkpoint_digest
from preload.identity.filestat import FileStat
from preload.identity.manifest import (
    Manifest,
    ShardRecord,
    StaleManifestError,
    load_manifest,
    write_manifest,
)

pytestmark = pytest.mark.unit

STAT = FileStat(size=10, mtime_ns=2, ctime_ns=3, ino=4, dev=5)
MANIFEST = Manifest(
    checkpoint="/models/tiny", digest=checkpoint_digest({"model.safetensors": "e" * 64}), config_digest="c" * 64,
    shards=(ShardRecord("model.safetensors", 10, "e" * 64, STAT, {"w": "f" * 64}),),
    index_stat=None, dir_stat=STAT, subdir_stats={"sub": STAT}, selection="auto", created=1.5,
)


def _written(tmp_path: Path, edit=None) -> Path:
    path = write_manifest(MANIFEST, tmp_path)
    if edit is not None:
        obj = json.loads(path.read_text(encoding="utf-8"))
        edit(obj)
        atomic.write_json(path, obj, mode=0o600)
    return path


def test_control_a_written_manifest_loads_as_it_was(tmp_path: Path) -> None:
    _written(tmp_path)
    assert load_manifest(MANIFEST.checkpoint, tmp_path) == MANIFEST


def test_upper_case_digests_in_a_manifest_read_as_lower_case(tmp_path: Path) -> None:
    def upper(o: dict) -> None:
        o["digest"] = o["digest"].upper()
        for s in o["shards"]:
            s["sha256"] = s["sha256"].upper()
    _written(tmp_path, upper)
    assert load_manifest(MANIFEST.checkpoint, tmp_path) == MANIFEST


@pytest.mark.parametrize("edit, error, message", [
    (lambda o: o["shards"][0]["stat"].update(ino="4"), ManifestError,
     r"Expected `int`, got `str` - at `\$.shards\[0\].stat.ino`"),
    (lambda o: o.pop("digest"), ManifestError, "missing required field `digest`"),
    (lambda o: o.pop("version"), ManifestError, "missing required field `version`"),
    (lambda o: o.update(subdir_stats={"sub": None}), ManifestError, r"at `\$.subdir_stats\[...\]`"),
    (lambda o: o.update(version=1), StaleManifestError, "has version 1, not 2"),
    (lambda o: o.update(version="2"), StaleManifestError, "has version '2', not 2"),
    # The digest engines trust is the one the shard list implies: another
    # checkpoint's digest, or one of the wrong length, is refused.
    (lambda o: o.update(digest="9" * 64), ManifestError, "is not the one its shard list implies"),
    (lambda o: o.update(digest="abc"), ManifestError, "malformed: digest 'abc' is not a SHA-256 digest"),
    # Every digest in it is read by pgbase.digest_text's one rule, before the
    # implied-digest check (which a non-hex shard list would pass, consistently).
    (lambda o: o["shards"][0].update(sha256="g" * 64), ManifestError, r"shard .*'s sha256 'gggg.* is not hex"),
    (lambda o: o.update(config_digest="c" * 63), ManifestError, "config_digest 'ccc.* is 63 characters"),
    (lambda o: o["shards"][0].update(sha256="0" * 64), ManifestError, "is not the one its shard list implies"),
])
def test_a_bad_manifest_names_the_file_the_field_and_the_fix(tmp_path: Path, edit, error, message) -> None:
    path = _written(tmp_path, edit)
    with pytest.raises(error, match=message) as info:
        load_manifest(MANIFEST.checkpoint, tmp_path)
    assert "run: preload-gate promote /models/tiny" in str(info.value)
    assert str(path) in str(info.value)
    if error is ManifestError:
        assert not isinstance(info.value, StaleManifestError)
        assert str(path) in str(info.value)
