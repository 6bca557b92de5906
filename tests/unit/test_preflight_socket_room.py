"""The suite's own temp paths leave room for a daemon socket.

CI failed once because pytest's default base temp (``pytest-of-root/pytest-116/...``)
grew past what an AF_UNIX socket under ``tmp_path`` can hold; ``tests/conftest.py``
now gives the run a short base temp. This pins it: the longest tmp_path pytest
makes here (a 30-character test-name stem plus a counter) still fits a rank-15
socket under ``<tmp_path>/sockets/<16 hex>/``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from preload.preflight import check_socket_root

pytestmark = pytest.mark.unit


def test_longest_tmp_path_fits_a_socket_root(tmp_path_factory: pytest.TempPathFactory) -> None:
    longest = tmp_path_factory.getbasetemp() / ("x" * 30 + "99")
    longest.mkdir()
    check_socket_root(longest / "sockets", ranks=(15,))  # raises PreflightError when it does not fit


def test_control_a_long_root_is_refused() -> None:
    from preload.preflight import PreflightError

    with pytest.raises(PreflightError, match="AF_UNIX"):
        check_socket_root(Path("/tmp") / ("y" * 80) / "sockets", ranks=(15,))
