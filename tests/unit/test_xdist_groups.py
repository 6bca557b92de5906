"""The README's test command (`pytest -n 2 --dist loadgroup`) keeps each
xdist_group on one worker: the engine tests share module and session
fixtures (a canary scene is two servers and a pipeline, ~8 minutes) through
their group. pytest 9.2 with pytest-xdist 3.8 ignored every group silently
(pyproject pins pytest below 9.2); this runs a small generated suite the
same way and looks at where each test ran."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SUITE = {
    "test_grouped.py": (
        "import pytest, time\n"
        "pytestmark = [pytest.mark.xdist_group(name='scene')]\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_grouped(i):\n    time.sleep(0.05)\n"
    ),
    "test_free.py": (
        "import pytest, time\n"
        "@pytest.mark.parametrize('i', range(10))\n"
        "def test_free(i):\n    time.sleep(0.05)\n"
    ),
}


def _workers_of_group(tmp_path: Path, dist: str) -> set[str]:
    for name, text in SUITE.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    p = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", dist, "-v", "-p", "no:cacheprovider",
                        "-p", "no:preload_gate", "-c", str(tmp_path / "pytest.ini"), str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ran = re.findall(r"\[(gw\d+)\] \[ *\d+%\] PASSED \S*test_grouped\.py::test_grouped", p.stdout)
    assert len(ran) == 6, p.stdout[-3000:]
    return set(ran)


def test_a_group_runs_on_one_worker(tmp_path: Path) -> None:
    assert len(_workers_of_group(tmp_path, "loadgroup")) == 1


def test_control_without_loadgroup_the_same_tests_spread(tmp_path: Path) -> None:
    """What the suite did under pytest 9.2: the group's tests on both workers."""
    assert len(_workers_of_group(tmp_path, "load")) == 2
