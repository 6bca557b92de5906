"""Every change to a promoted checkpoint's folders is named in the stale-manifest miss.

A folder's stat says only that an entry was added, removed or renamed; the
restart check lists a changed folder once and diffs it with the listing
promote recorded (name -> inode), so the message names the entry and what
happened to it: removed, added, renamed (the same inode under a new name),
replaced (the same name on a new inode). One row per kind of change, each
through the engine's own entry point (``resolve_digest`` in stat mode), with
the unchanged checkpoint as the control; none of them opens a file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from fixtures.mutations import copy_checkpoint
from harness.bench.remote_fs import RemoteFS
from preload.identity import filestat as filestat_mod
from preload.identity import manifest as manifest_mod
from preload.identity.manifest import StaleManifestError, load_manifest, resolve_digest
from preload.promote import promote

pytestmark = pytest.mark.unit

S1, S2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"
FILE_SET = "so vLLM's file set may differ"


def _rewrite(path: Path, edit: Callable[[dict], None]) -> None:
    """An atomic writer's way: a new file beside, renamed over the old name."""
    doc = json.loads(path.read_text())
    edit(doc)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _drop_s2(ckpt: Path) -> None:
    (ckpt / S2).unlink()
    p = ckpt / INDEX
    doc = json.loads(p.read_text())
    doc["weight_map"] = {k: v for k, v in doc["weight_map"].items() if v != S2}
    with open(p, "w") as f:  # in place: same inode, new size
        json.dump(doc, f)


def _consolidated(where: Path) -> None:
    save_file({"w": np.zeros(2, dtype=np.float32)}, str(where / "consolidated.safetensors"))


def _churn(ckpt: Path) -> None:
    (ckpt / "x.tmp").write_text("")
    (ckpt / "x.tmp").unlink()


# (name, made before promotion, the change, words the miss must hold, the shard it names, file-set note)
ROWS: list[tuple[str, Callable[[Path], None] | None, Callable[[Path], None], list[str], str | None, bool]] = [
    ("shard removed", None, lambda c: (c / S2).unlink(), [f"shard {S2} removed"], S2, True),
    ("shard renamed", None, lambda c: (c / S2).rename(c / "model-renamed.safetensors"),
     [f"shard {S2} renamed to model-renamed.safetensors"], S2, True),
    ("shard replaced by a copy", None, lambda c: (shutil.copy2(c / S2, c / "t"), os.replace(c / "t", c / S2)),
     [f"shard {S2} replaced (new inode)"], S2, True),
    ("weight file added", None, lambda c: shutil.copy2(c / S1, c / "extra.safetensors"),
     ["extra.safetensors added"], None, True),
    ("consolidated file added", None, _consolidated, ["consolidated.safetensors added"], None, True),
    ("index removed", None, lambda c: (c / INDEX).unlink(), [f"{INDEX} removed"], INDEX, True),
    ("index replaced", None, lambda c: _rewrite(c / INDEX, lambda d: d.update(metadata={"x": 1})),
     [f"{INDEX} replaced (new inode)"], INDEX, True),
    ("index edited in place", None, lambda c: (c / INDEX).write_text((c / INDEX).read_text() + " "),
     [f"{INDEX} changed (size"], INDEX, False),
    ("shard removed and the index edited", None, _drop_s2,
     [f"shard {S2} removed", f"{INDEX} changed (size"], S2, True),
    ("folder added", None, lambda c: (c / "original").mkdir(), ["original/ added"], None, True),
    ("folder removed", lambda c: (c / "original").mkdir(), lambda c: (c / "original").rmdir(),
     ["original/ removed"], None, True),
    ("consolidated file added in a subfolder", lambda c: (c / "original").mkdir(),
     lambda c: _consolidated(c / "original"), ["original/consolidated.safetensors added"], None, True),
    ("non-weight file added", None, lambda c: (c / "chat_template.jinja").write_text("{{x}}"),
     ["chat_template.jinja added"], None, False),
    ("non-weight file renamed", None, lambda c: (c / "tokenizer.json").rename(c / "tok.json"),
     ["tokenizer.json renamed to tok.json"], None, False),
    ("config.json replaced", None, lambda c: _rewrite(c / "config.json", lambda d: d.update(x=1)),
     ["config.json replaced (new inode)"], None, False),
    ("an entry added and removed again", None, _churn,
     ["its entries are the promoted ones (an entry added and removed again)"], None, True),
]


@pytest.fixture(autouse=True)
def _pool_backend(monkeypatch):
    monkeypatch.setenv(filestat_mod.STAT_BACKEND_ENV, "pool")  # the shim counts Python's stats


@pytest.fixture
def checkpoint(tiny_checkpoint, tmp_path):
    def make(before: Callable[[Path], None] | None) -> tuple[Path, Path]:
        ckpt = copy_checkpoint(tiny_checkpoint(shards=2), tmp_path / "ckpt")
        assert {S1, S2, INDEX} <= set(os.listdir(ckpt))
        if before is not None:
            before(ckpt)
        cache = tmp_path / "cache"
        promote(ckpt, socket_root=tmp_path / "sock", cache_dir=cache, progress=False)
        return ckpt, cache
    return make


@pytest.mark.parametrize(("name", "before", "change", "words", "shard", "file_set"), ROWS,
                         ids=[r[0] for r in ROWS])
def test_every_folder_change_is_named(checkpoint, name, before, change, words, shard, file_set) -> None:
    ckpt, cache = checkpoint(before)
    assert resolve_digest(ckpt, mode="stat", cache_dir=cache).source == "manifest"  # control: unchanged
    change(ckpt)
    with RemoteFS([ckpt]) as fs, pytest.raises(StaleManifestError) as info:
        resolve_digest(ckpt, mode="stat", cache_dir=cache)
    msg = str(info.value)
    for w in words:
        assert w in msg, (name, msg)
    assert info.value.shard == shard, (name, msg)
    assert (FILE_SET in msg) is file_set, (name, msg)
    assert "mtime_ns, ctime_ns)" not in msg.split("changed (")[0] or "promoted ones" in msg  # never stats alone
    assert fs.counts.opens == 0 and len(msg.splitlines()) == 1 and f"run: preload-gate promote {ckpt}" in msg


def test_a_manifest_without_listings_still_names_shards_index_and_weight_files(checkpoint) -> None:
    """Manifests promoted before listings were recorded stay usable: what
    they know (shards and index, by inode) is named, and a new weight file;
    other entries fall back to the directory's stat fields."""
    ckpt, cache = checkpoint(None)
    old = dataclasses.replace(load_manifest(ckpt, cache), entries=None)
    assert manifest_mod.stale_reason(ckpt, old) is None  # control
    (ckpt / S2).rename(ckpt / "model-renamed.safetensors")
    reason, shard = manifest_mod.stale_reason(ckpt, old)
    assert reason.startswith(f"shard {S2} renamed to model-renamed.safetensors") and shard == S2
    (ckpt / "model-renamed.safetensors").rename(ckpt / S2)
    promote(ckpt, socket_root=ckpt.parent / "sock", cache_dir=cache, progress=False)
    old = dataclasses.replace(load_manifest(ckpt, cache), entries=None)
    (ckpt / "chat_template.jinja").write_text("x")
    reason, shard = manifest_mod.stale_reason(ckpt, old)
    assert "mtime_ns, ctime_ns changed, though its entries are the promoted ones" in reason and shard is None
