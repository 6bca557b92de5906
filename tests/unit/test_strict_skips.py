"""PRELOAD_GATE_STRICT_SKIPS=1 turns the privileged skips (another uid,
chown, a real full tmpfs, a writable /dev/shm tmpfs, a mount namespace)
into failures; CI sets it, since CI runs as root where every one of them can
run. Every such skip in tests/ goes through ``skip_privileged`` (checked
below on the sources, with a planted plain skip as the control)."""

from __future__ import annotations

import ast
import re
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


# What a skip's reason says when the test needs a root power or a real
# tmpfs / full disk that CI has.
_PRIVILEGED = re.compile(r"\b(root|uid|chown|tmpfs|mount|unshare|ENOSPC|full disk|privileged)\b", re.IGNORECASE)


def plain_privileged_skips(source: str, where: str) -> list[str]:
    """``pytest.skip(...)`` / ``pytest.mark.skipif(..., reason=...)`` calls in
    ``source`` whose reason names a privilege: they would skip quietly in CI."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if name not in ("pytest.skip", "pytest.mark.skipif", "skip", "skipif"):
            continue
        texts = [c.value for arg in [*node.args, *(k.value for k in node.keywords)]
                 for c in ast.walk(arg) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        if any(_PRIVILEGED.search(t) for t in texts):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)[:100]}")
    return found


def test_every_privileged_skip_goes_through_the_switch() -> None:
    found = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        found += plain_privileged_skips(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    assert found == [], "use reliability_support.skip_privileged so CI fails instead of skipping"


@pytest.mark.parametrize("planted", [
    'pytest.skip("chown to another uid needs root")',
    'pytest.skip(f"no writable tmpfs at {shm}")',
    '@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")\ndef test_x(): pass',
])
def test_control_a_plain_privileged_skip_is_found(planted: str) -> None:
    assert plain_privileged_skips(planted, "x.py")
    # ... and the same reason through the switch is not.
    assert not plain_privileged_skips('skip_privileged("chown to another uid needs root")', "x.py")
