"""Preflight's ``--dtype`` and tensor-parallel rules are vLLM's own.

``preload/preflight.py`` keeps the two rules so that ``preload`` (and its
``--dry-run``) refuses in milliseconds, where vLLM is not installed too; here
they are held equal to the installed vLLM:

- ``VLLM_DTYPES`` equals ``"auto"`` plus ``_STR_DTYPE_TO_TORCH_DTYPE``'s keys
  and vLLM's ``ModelDType`` literal;
- ``check_tensor_parallel`` refuses exactly where vLLM does, over a table of
  (attention heads, KV heads, tp): ``ModelConfig.verify_with_parallel_config``
  (heads % tp) and the attention layer ``QKVParallelLinear`` (KV heads split
  or replicated), each called as vLLM calls it, with the TP world size
  patched in (no process group is started).

Control: a rule that checks the attention heads only (the KV rule dropped)
is run through the same table and must disagree with vLLM.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

pytest.importorskip("vllm")

import vllm.model_executor.layers.linear as vllm_linear  # noqa: E402
import vllm.model_executor.parameter as vllm_parameter  # noqa: E402
from vllm.config import model as vllm_model  # noqa: E402

from preload.preflight import VLLM_DTYPES, PreflightError, check_dtype, check_tensor_parallel  # noqa: E402

pytestmark = pytest.mark.cpu

HEADS_KV = [(h, kv) for h in (1, 2, 3, 4, 6, 8, 12, 32) for kv in range(1, h + 1) if h % kv == 0]
TPS = range(1, 17)


def test_dtypes_are_vllms():
    assert set(VLLM_DTYPES) == {"auto", *vllm_model._STR_DTYPE_TO_TORCH_DTYPE}
    assert set(VLLM_DTYPES) == set(typing.get_args(vllm_model.ModelDType))
    for d in VLLM_DTYPES:
        check_dtype(d.upper())  # vLLM lowercases
    with pytest.raises(PreflightError, match="bf16"):
        check_dtype("bf16")


def _vllm_takes(heads: int, kv: int, tp: int) -> bool:
    me = SimpleNamespace(model_arch_config=SimpleNamespace(total_num_attention_heads=heads), multimodal_config=None)
    parallel = SimpleNamespace(enable_hc_sp=False, tensor_parallel_size=tp, enable_expert_parallel=False,
                               pipeline_parallel_size=1, decode_context_parallel_size=1)
    try:
        vllm_model.ModelConfig.verify_with_parallel_config(me, parallel)
    except ValueError:
        return False
    patches = [mock.patch.object(mod, name, return_value=value)
               for mod in (vllm_linear, vllm_parameter)
               for name, value in (("get_tensor_model_parallel_world_size", tp),
                                   ("get_tensor_model_parallel_rank", 0))]
    for p in patches:
        p.start()
    try:
        vllm_linear.QKVParallelLinear(hidden_size=8, head_size=2, total_num_heads=heads, total_num_kv_heads=kv,
                                      bias=False)
    except AssertionError as exc:
        if "is not divisible by" not in str(exc):
            raise
        return False
    finally:
        for p in patches:
            p.stop()
    return True


def _ours_takes(ckpt: Path, heads: int, kv: int, tp: int) -> bool:
    (ckpt / "config.json").write_text(json.dumps({"num_attention_heads": heads, "num_key_value_heads": kv}))
    try:
        check_tensor_parallel(ckpt, tp)
    except PreflightError:
        return False
    return True


def _heads_only(ckpt: Path, heads: int, kv: int, tp: int) -> bool:
    return heads % tp == 0


def _disagreements(rule, ckpt: Path) -> list[tuple[int, int, int, bool]]:
    return [(h, kv, tp, vllm) for h, kv in HEADS_KV for tp in TPS
            if (vllm := _vllm_takes(h, kv, tp)) != rule(ckpt, h, kv, tp)]


def test_tensor_parallel_rule_is_vllms(tmp_path):
    assert _disagreements(_ours_takes, tmp_path) == []
    # Control: dropping the KV-head rule is caught by the same table.
    assert _disagreements(_heads_only, tmp_path)
