"""GPU tier: a daemon process serving the raw stage over the cuda transport,
and engine processes (``engine_probe.py``) attaching from it (helpers in
``gpu_support``). Every test here is skipped, with the reason, where CUDA is
not available.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def _cuda_missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "CUDA is not available (torch.cuda.is_available() is False): GPU tier skipped"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    why = _cuda_missing()
    if why is None:
        return
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def synthetic_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~2 GiB in 16 bf16 tensors of 128 MiB: large enough that a second copy
    shows in free device memory, and past 64 MiB per tensor (the checksum's
    high block lane)."""
    from harness.bench.identity import write_synthetic

    out = tmp_path_factory.mktemp("synthetic") / "ckpt"
    write_synthetic(out, shards=2, shard_bytes=1 << 30, tensors_per_shard=8, seed=11)
    return out
