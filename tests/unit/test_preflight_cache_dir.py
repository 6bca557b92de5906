"""``check_cache_dir`` proves the manifest cache can be made by making it
(root passes ``os.access`` even under /proc) and leaves nothing behind."""

from __future__ import annotations

import os

import pytest

from preload.preflight import PreflightError, check_cache_dir

pytestmark = pytest.mark.unit


def test_a_creatable_cache_passes_and_leaves_no_directory(tmp_path):
    target = tmp_path / "new" / "cache"
    check_cache_dir(target, tmp_path)
    assert not (tmp_path / "new").exists(), "the levels the check made are removed again"


def test_an_existing_cache_is_left_as_it_was(tmp_path):
    (tmp_path / "cache" / "manifests").mkdir(parents=True, mode=0o700)
    os.chmod(tmp_path / "cache" / "manifests", 0o700)
    check_cache_dir(tmp_path / "cache", tmp_path)
    assert (tmp_path / "cache" / "manifests").is_dir(), "control: what existed before stays"


def test_a_cache_under_proc_is_refused_naming_the_fix(tmp_path):
    # /proc takes no mkdir, for root too: os.access alone would have passed it as root.
    with pytest.raises(PreflightError, match=r"cannot be created: .*set --cache-dir or PRELOAD_GATE_CACHE"):
        check_cache_dir("/proc/pg-no-such-cache", tmp_path)
