"""PRELOAD_GATE_STRICT_SKIPS=1 turns the privileged skips (another uid,
chown, a real full tmpfs: tests/unit/test_hostile_peers.py and
tests/unit/test_atomic_writes.py) into failures; CI sets it, since CI runs
as root where every one of them can run."""

from __future__ import annotations

from pathlib import Path

import pytest
from reliability_support import STRICT_SKIPS, skip_privileged

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_without_the_switch_it_skips(monkeypatch) -> None:
    monkeypatch.delenv(STRICT_SKIPS, raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs root"):
        skip_privileged("mounting a tmpfs needs root")


@pytest.mark.parametrize("value", ["0", ""])
def test_only_1_turns_it_on(monkeypatch, value: str) -> None:
    monkeypatch.setenv(STRICT_SKIPS, value)
    with pytest.raises(pytest.skip.Exception):
        skip_privileged("x")


def test_with_the_switch_it_fails_naming_why(monkeypatch) -> None:
    monkeypatch.setenv(STRICT_SKIPS, "1")
    with pytest.raises(pytest.fail.Exception, match=r"needs root; PRELOAD_GATE_STRICT_SKIPS=1 says"):
        skip_privileged("mounting a tmpfs needs root")


def test_ci_sets_the_switch() -> None:
    assert f"export {STRICT_SKIPS}=1" in (REPO / ".ci" / "run").read_text()
