"""The raw-stage consumer on CPU: a transformers model built on the meta
device, its tensors attached from a real daemon process (shm transport),
decodes token for token like ``from_pretrained``. The GPU tier runs the
same over the cuda transport (tests/gpu/test_gpu_hf_attach.py).

No vLLM is imported; transformers is (it ships with the cpu extra).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_support import repo_pythonpath

from preload.daemon.ready import READY, NotReadyError, start_preload, stop_daemon, wait_ready

pytestmark = pytest.mark.unit
transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]
# The second prompt starts with a special token; its greedy continuation
# depends on generation_config.json's eos id (min_new_tokens suppresses it).
PROMPTS = [[1, 5, 77, 300, 12, 9], [256, 3, 3, 3, 500]]


@pytest.fixture(scope="module")
def raw_daemon(tiny_checkpoint: Callable[..., Path]) -> Iterator[dict[str, Any]]:
    ckpt = tiny_checkpoint(arch="llama")
    root = Path(tempfile.mkdtemp(prefix="pg-hf-"))  # short: AF_UNIX paths are limited
    os.chmod(root, 0o700)
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    proc = start_preload([str(ckpt), "--stage", "raw", "--transport", "shm", "--identity", "full",
                          "--socket-root", str(root)], env=env, cwd=str(REPO))
    try:
        try:
            ready = wait_ready(proc, READY, timeout_s=None)
        except NotReadyError as exc:
            raise AssertionError(f"daemon exited with {exc.returncode}") from None
        yield {**ready, "checkpoint": ckpt}
    finally:
        stop_daemon(proc, 60)
        shutil.rmtree(root, ignore_errors=True)


def _decode(model: Any) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        g = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        out.append(g[0, len(p):].tolist())
    return out


def test_meta_model_on_attached_tensors_decodes_like_from_pretrained(raw_daemon: dict[str, Any]) -> None:
    from preload.hf_attach import attach_model

    ckpt = raw_daemon["checkpoint"]
    attached = attach_model(
        ckpt, device="cpu", socket_dir=raw_daemon["socket_dir"], identity="pinned",
        expected_digest=raw_daemon["digest"], verify=False, watch=False,
    )
    try:
        model = attached.model
        assert attached.tensors == len(dict(model.named_parameters()))
        assert not any(p.is_meta for p in model.parameters())
        reference = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16).eval()
        ours = _decode(model)
        assert ours == _decode(reference)
        with torch.no_grad():
            ids = torch.tensor([PROMPTS[0]])
            assert torch.equal(model(ids).logits, reference(ids).logits)
        # Control: without the checkpoint's generation_config.json (what a bare
        # from_config model has) the same weights decode the second prompt differently.
        model.generation_config = transformers.GenerationConfig.from_model_config(model.config)
        assert _decode(model)[1] != ours[1]
    finally:
        attached.close()


def test_verify_against_a_daemon_without_checksums_is_refused_not_skipped(raw_daemon: dict[str, Any]) -> None:
    from pgbase.errors import WeightCacheUnavailableError
    from preload.hf_attach import attach_model

    with pytest.raises(WeightCacheUnavailableError, match="no resident checksums"):
        attach_model(
            raw_daemon["checkpoint"], device="cpu", socket_dir=raw_daemon["socket_dir"], identity="pinned",
            expected_digest=raw_daemon["digest"], verify=True, watch=False,
        )


def test_tensors_the_model_has_no_place_for_are_named() -> None:
    from preload.hf_attach import AttachError, place_tensors

    model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False))
    with pytest.raises(AttachError, match="no place for .*extra.weight"):
        place_tensors(model, {"0.weight": torch.zeros(2, 2), "extra.weight": torch.zeros(1)})
    with pytest.raises(AttachError, match="shape"):
        place_tensors(model, {"0.weight": torch.zeros(3, 2)})
