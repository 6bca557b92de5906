"""A bench row's synthetic checkpoint is refused before its first byte when
it cannot fit on the disk (was: 17 GB written in 20 s toward 6.5 PB)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.bench.errors import BenchError
from harness.bench.synthetic import write_synthetic

pytestmark = pytest.mark.unit


def test_a_checkpoint_larger_than_the_free_space_is_refused_unwritten(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    with pytest.raises(BenchError, match="does not fit in .* free on its filesystem"):
        write_synthetic(tmp_path / "ckpt", 4, free // 2)  # twice the free space
    assert list(tmp_path.iterdir()) == []


def test_control_a_checkpoint_that_fits_is_written(tmp_path: Path) -> None:
    paths = write_synthetic(tmp_path / "ckpt", 2, 4096)
    assert len(paths) == 2 and all(p.stat().st_size > 4096 for p in paths)
