"""A public module that moved keeps its old import path, with a warning."""

from __future__ import annotations

import importlib
import sys

import pytest

import pgbase.shards

pytestmark = pytest.mark.unit


def test_preload_identity_shards_still_imports_and_says_where_it_went():
    sys.modules.pop("preload.identity.shards", None)
    with pytest.warns(DeprecationWarning, match="pgbase.shards"):
        old = importlib.import_module("preload.identity.shards")
    assert old.shard_paths is pgbase.shards.shard_paths and old.read_header is pgbase.shards.read_header
