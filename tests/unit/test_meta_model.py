"""preload.meta_model: parameters on meta, init-computed buffers real, no
patch left behind.

The control is torch's own ``with torch.device("meta"):``: it also sends the
rotary ``inv_freq`` to meta, which is why meta_model does not use it (its
docstring says so); if a transformers release stopped computing buffers at
init, the control row would fail and the choice could be revisited.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.unit
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(arch="llama")


def _real_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b for n, b in model.named_buffers() if b.device.type != "meta"}


def test_parameters_on_meta_buffers_real_and_equal_to_a_real_build(ckpt: Path) -> None:
    from preload.meta_model import build_meta_model

    register = torch.nn.Module.register_parameter
    model = build_meta_model(ckpt)
    assert torch.nn.Module.register_parameter is register  # nothing patched after
    params = dict(model.named_parameters())
    assert params and all(p.device.type == "meta" for p in params.values())
    buffers = dict(model.named_buffers())
    assert any("inv_freq" in n for n in buffers), "the tiny llama has rotary buffers to check"
    assert set(_real_buffers(model)) == set(buffers)
    # The values a real build computes, not uninitialised memory.
    config = transformers.AutoConfig.from_pretrained(str(ckpt))
    real = transformers.AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    for name, buf in real.named_buffers():
        torch.testing.assert_close(buffers[name], buf)
    # A parameter created after the build is an ordinary one again.
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"


def test_control_torch_device_meta_loses_the_init_computed_buffers(ckpt: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(str(ckpt))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    buffers = dict(model.named_buffers())
    assert buffers and not _real_buffers(model)
