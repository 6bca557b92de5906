"""The rollout's "can both checkpoints be resident" check uses the daemon's
memory budget (preload.budget: the least of MemAvailable, the memory cgroup,
strict overcommit and RLIMIT_AS), not a MemAvailable read of its own."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from harness.rollout.residency import BudgetError, check_budget

pytestmark = pytest.mark.unit

GIB = 1 << 30


def test_without_a_budget_the_binding_limit_decides_and_is_named() -> None:
    line = check_budget("B", 1, [("A", GIB)], None)
    assert "the memory budget is" in line and "A 1.00 GiB" in line
    with pytest.raises(BudgetError, match="cannot hold both checkpoints.*memory budget is.*--evict-first"):
        check_budget("B", 1 << 60, [("A", GIB)], None)


def test_an_address_space_limit_binds_the_rollout_as_it_binds_the_daemon() -> None:
    """Under RLIMIT_AS of 6 GiB, 8 GiB does not fit although MemAvailable may
    hold it; control: the same 8 GiB without that limit is compared with MemAvailable."""
    code = ("import resource,sys\n"
            "from harness.rollout.residency import BudgetError, check_budget\n"
            "if sys.argv[1] == 'limit': resource.setrlimit(resource.RLIMIT_AS, (6 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))\n"
            "try:\n    print(check_budget('B', 8 << 30, [], None))\nexcept BudgetError as e:\n    print('REFUSED', e)\n")
    limited = subprocess.run([sys.executable, "-c", code, "limit"], capture_output=True, text=True, timeout=120)
    assert "REFUSED" in limited.stdout and "RLIMIT_AS" in limited.stdout, limited.stdout + limited.stderr
    free = subprocess.run([sys.executable, "-c", code, "none"], capture_output=True, text=True, timeout=120)
    assert "RLIMIT_AS" not in free.stdout, free.stdout + free.stderr
    assert resource.getrlimit(resource.RLIMIT_AS)  # this process untouched


def test_a_memory_budget_counts_what_is_resident() -> None:
    assert "of a 3.00 GiB --memory-budget" in check_budget("B", GIB, [("A", GIB)], 3 * GIB)
    with pytest.raises(BudgetError, match="3.00 GiB of a 2.00 GiB --memory-budget"):
        check_budget("B", 2 * GIB, [("A", GIB)], 2 * GIB)
