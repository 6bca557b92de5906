"""``preload.loader.register`` (vLLM's general-plugin entry point) with vLLM's
registry replaced at its public boundary, so the unit tier runs it without vLLM."""

from __future__ import annotations

import sys
import types

import pytest

import preload.loader as loader_pkg
from preload.identity import filestat, stat_pool

pytestmark = pytest.mark.unit


@pytest.fixture
def fake_registry(monkeypatch):
    registered: dict[str, type] = {}

    def register_model_loader(name):
        def deco(cls):
            registered[name] = cls
            return cls

        return deco

    mod = types.ModuleType("vllm.model_executor.model_loader")
    mod.register_model_loader = register_model_loader
    for name in ("vllm", "vllm.model_executor"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader", mod)
    monkeypatch.setattr(loader_pkg, "loader_class", lambda: type("FakeLoader", (), {}))
    started: list[int] = []
    monkeypatch.setattr(filestat, "prestart_stats", lambda n: started.append(n))
    return registered, started


def test_register_without_the_env_starts_no_pool(fake_registry, monkeypatch):
    registered, started = fake_registry
    monkeypatch.delenv(stat_pool.STAT_WORKERS_ENV, raising=False)
    loader_pkg.register()
    assert list(registered) == [loader_pkg.LOAD_FORMAT]
    assert started == [0], "prestart is asked for 0 workers, which starts nothing"


def test_register_starts_the_pool_the_env_asks_for(fake_registry, monkeypatch):
    registered, started = fake_registry
    monkeypatch.setenv(stat_pool.STAT_WORKERS_ENV, "1000")
    loader_pkg.register()
    assert started == [1000] and loader_pkg.LOAD_FORMAT in registered


def test_a_bad_pool_size_is_one_warning_and_no_pool(fake_registry, monkeypatch, caplog):
    """The plugin loads in every vLLM process: a typo must not fail unrelated engines."""
    registered, started = fake_registry
    monkeypatch.setenv(stat_pool.STAT_WORKERS_ENV, "lots")
    with caplog.at_level("WARNING", logger="preload.loader"):
        loader_pkg.register()
    assert loader_pkg.LOAD_FORMAT in registered and started == [], "the loader is registered; no pool starts"
    (rec,) = [r for r in caplog.records if r.name == "preload.loader"]
    assert f"{stat_pool.STAT_WORKERS_ENV}='lots'" in rec.getMessage() and "unset it" in rec.getMessage()
