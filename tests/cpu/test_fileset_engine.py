"""A hit is what ``auto`` loads, on layouts where the file set is not the obvious one.

Real vLLM CPU engines (few: each costs 30-60 s on 2 cores):

- c02: ``consolidated.safetensors`` (weights W2) beside indexed ``model-*``
  shards (weights W1). vLLM's ``auto`` reads only the consolidated file.
  ``promote`` hashes exactly that file; a loaded-stage daemon serves it; a
  ``verified_cache`` engine with fallback off hits with greedy tokens equal
  to ``auto`` on the same folder (and different from W1 alone: the control
  that the layout matters). Touching the served file afterwards makes the
  next engine fail with one miss naming the file and ``preload-gate
  promote``, with the manifest's bytes unchanged.
- ``.bin`` weights (vLLM's ``auto`` loads ``pytorch_model.bin``): a
  ``verified_cache`` engine with fallback off fails naming why
  (safetensors only), with one miss event.
"""

from __future__ import annotations

import os
import shutil

import pytest
from daemon_support import Daemon, copy_checkpoint, short_dir
from loader_support import run_engine

from pgbase.fileset import vllm_selection
from preload.events import read_events
from preload.identity.manifest import manifest_path
from preload.promote import promote

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.xdist_group(name="fileset_engines")]


@pytest.fixture(scope="module")
def c02(tiny_checkpoint, tmp_path_factory):
    base = tmp_path_factory.mktemp("c02")
    ckpt = copy_checkpoint(tiny_checkpoint(shards=2), base / "ckpt")
    shutil.copyfile(tiny_checkpoint(seed=7) / "model.safetensors", ckpt / "consolidated.safetensors")
    root, cache = short_dir("pg-fs-"), base / "cache"
    yield {"ckpt": ckpt, "root": root, "cache": cache, "w1": tiny_checkpoint(shards=2)}
    shutil.rmtree(root, ignore_errors=True)


def test_c02_hit_equals_auto_and_a_touched_file_is_a_named_miss(c02, tmp_path):
    ckpt, root, cache = c02["ckpt"], c02["root"], c02["cache"]
    assert vllm_selection(ckpt).files == ("consolidated.safetensors",)
    promo = promote(ckpt, socket_root=root, cache_dir=cache)
    assert [s.name for s in promo.manifest.shards] == ["consolidated.safetensors"]
    auto = run_engine(ckpt, cache)
    assert auto["rc"] == 0 and auto["tokens"], auto["log"][-3000:]
    events = tmp_path / "events.jsonl"
    daemon = Daemon(ckpt, root, cache, ("--stage", "loaded")).start(timeout=400)
    try:
        assert daemon.ready["digest"] == promo.digest
        hit = run_engine(ckpt, cache, events, load_format="verified_cache",
                         extra={"socket_root": str(root), "fallback": False})
    finally:
        daemon.stop()
    assert hit["rc"] == 0, hit["log"][-3000:]
    assert hit["tokens"] == auto["tokens"]
    evs = read_events(events)
    assert [e["outcome"] for e in evs] == ["hit"] and evs[0]["digest"] == promo.digest
    # Control: the indexed shards alone (what was served before) answer differently.
    w1 = run_engine(c02["w1"], cache)
    assert w1["rc"] == 0 and w1["tokens"] != auto["tokens"]

    # Stale manifest at engine start: one named miss, no re-hash, manifest untouched.
    mpath = manifest_path(ckpt, cache)
    before = mpath.read_bytes()
    target = ckpt / "consolidated.safetensors"
    st = os.stat(target)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    stale_events = tmp_path / "stale.jsonl"
    stale = run_engine(ckpt, cache, stale_events, load_format="verified_cache",
                       extra={"socket_root": str(root), "fallback": False})
    assert stale["rc"] != 0
    evs = read_events(stale_events)
    assert len(evs) == 1 and evs[0]["outcome"] == "miss", evs
    assert "consolidated.safetensors changed" in evs[0]["reason"]
    assert "preload-gate promote" in evs[0]["reason"]
    assert mpath.read_bytes() == before


def test_bin_weights_fail_naming_why(tiny_ckpt, tmp_path):
    import torch
    from safetensors.torch import load_file

    ckpt = copy_checkpoint(tiny_ckpt, tmp_path / "bin")
    torch.save(load_file(str(ckpt / "model.safetensors")), ckpt / "pytorch_model.bin")
    (ckpt / "model.safetensors").unlink()
    assert vllm_selection(ckpt).files == ("pytorch_model.bin",)
    events = tmp_path / "events.jsonl"
    r = run_engine(ckpt, tmp_path / "cache", events, load_format="verified_cache",
                   extra={"socket_root": str(tmp_path / "s"), "fallback": False, "identity": "full"})
    assert r["rc"] != 0
    evs = read_events(events)
    assert len(evs) == 1 and evs[0]["outcome"] == "miss", evs
    assert "serves safetensors only" in evs[0]["reason"] and "pytorch_model.bin" in evs[0]["reason"]
