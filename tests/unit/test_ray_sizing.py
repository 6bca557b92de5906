"""scripts/ray_sizing.py's schedule: one engine a node, cached engines first, each reference after its case's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

_SPEC = importlib.util.spec_from_file_location("ray_sizing", Path(__file__).parents[2] / "scripts" / "ray_sizing.py")
assert _SPEC is not None and _SPEC.loader is not None
sizing = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sizing)


@pytest.mark.parametrize("nodes, wall", [
    (1, 60 + 14 * (40 + 45)),  # one after another
    (14, 60 + 40 + 45),  # every case on its own node
    # 14 cached in rounds of 4, 4, 4, 2: the two nodes the last round leaves idle start references at
    # 180 s; the 14 references then end at 360 s (the busy time, 14 x 85 s over 4 nodes, bounds it: 357.5).
    (4, 360),
    (20, 60 + 40 + 45),  # more nodes than engines at once buy nothing
])
def test_wall_of_the_self_test_on_n_nodes(nodes, wall):
    assert sizing.wall(nodes, 14, 40.0, 45.0, 60.0) == wall


def test_the_catalogue_is_what_the_table_counts():
    from harness.gate import select_target_cases
    from harness.targets import get_target

    assert len(sizing.cases()) == len(select_target_cases(get_target("verified_cache"), "all")) == 14
