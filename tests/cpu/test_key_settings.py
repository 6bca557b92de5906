"""Each engine setting the key carries moves the key, as vLLM builds the config.

``tests/unit/test_identity_key_fields.py`` decides every EngineArgs field
(keyed, or why not). Here the keyed ones that the tiny checkpoint can build
on CPU are built by vLLM itself (``EngineArgs(...).create_engine_config()``,
as an engine does; no process group, no weights) and ``key_from_vllm`` must
differ from the default's on the field the table names, and on that field
only. Neighbours: settings the table says hold no tensors leave the key as
it is, and the daemon's own config for the same settings (``preload
--model-impl``) gives the engine's key: a field that moves without cause
would be a miss on every restart.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from preload.daemon.loaded import build_vllm_config  # noqa: E402
from preload.daemon.stage import RankConfig  # noqa: E402
from preload.identity.key import WeightCacheKey  # noqa: E402
from preload.vllm_key import key_from_vllm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_identity_key_fields import KEYED, NOT_WEIGHTS  # noqa: E402

pytestmark = pytest.mark.cpu

PLACE = {"tp_size": 1, "tp_rank": 0, "pp_size": 1, "pp_rank": 0, "dp_size": 1, "dp_rank": 0,
         "export_stage": "loaded", "transport": "shm"}


def _key(vllm_config: Any) -> WeightCacheKey:
    return key_from_vllm(vllm_config, "ab" * 32, **PLACE)


def _engine(ckpt: Path, **settings: Any) -> WeightCacheKey:
    args = EngineArgs(model=str(ckpt), max_model_len=128, enforce_eager=True, load_format="verified_cache",
                      **{"dtype": "bfloat16", **settings})
    return _key(args.create_engine_config())


# (EngineArgs setting, a value other than its default) for every keyed setting the tiny
# qwen3 checkpoint builds on CPU; the multimodal, EPLB and context-parallel ones need
# a multimodal or MoE model or several ranks, which vLLM refuses to configure here.
MOVES = [
    ("model_impl", "transformers"),
    ("hf_overrides", {"num_hidden_layers": 1}),
    ("convert", "embed"),
    ("model_class_overrides", {"Qwen3ForCausalLM": "vllm.model_executor.models.qwen3:Qwen3ForCausalLM"}),
    ("additional_config", {"gdn_prefill_backend": "triton"}),
    ("kv_cache_dtype", "fp8"),
    ("dtype", "float16"),
]
STAYS = [("max_num_seqs", 7), ("seed", 3), ("enable_prefix_caching", False), ("max_logprobs", 3),
         ("tokenizer_mode", "slow"), ("enable_lora", True)]


@pytest.fixture(scope="module")
def base(tiny_ckpt: Path) -> WeightCacheKey:
    return _engine(tiny_ckpt)


@pytest.mark.parametrize(("setting", "value"), MOVES, ids=[m[0] for m in MOVES])
def test_a_keyed_setting_moves_its_field(tiny_ckpt: Path, base: WeightCacheKey, setting: str, value: Any) -> None:
    changed = _engine(tiny_ckpt, **{setting: value})
    moved = base.mismatched_fields(changed)
    assert KEYED[setting] in moved, (setting, moved)
    # Only that field, and what vLLM derives from the same setting: the pooling
    # adapter is a runner and a conversion; a layer count is the effective config.
    allowed = {KEYED[setting], *({"runner_type", "convert_type"} if setting == "convert" else ())}
    assert set(moved) <= allowed, (setting, moved)


@pytest.mark.parametrize(("setting", "value"), STAYS, ids=[s[0] for s in STAYS])
def test_a_setting_that_holds_no_tensors_leaves_the_key(tiny_ckpt: Path, base: WeightCacheKey, setting: str,
                                                        value: Any) -> None:
    assert any(setting in names for names in NOT_WEIGHTS.values())
    assert base.mismatched_fields(_engine(tiny_ckpt, **{setting: value})) == []


def test_the_daemons_config_gives_the_engines_key(tiny_ckpt: Path, base: WeightCacheKey) -> None:
    """What ``preload`` builds for a rank (its own EngineArgs) keys like the
    engine for the same settings, --model-impl included; control: a daemon
    left at the default model_impl misses an engine that set it, by name."""
    def daemon(**engine: Any) -> WeightCacheKey:
        cfg = RankConfig(checkpoint=str(tiny_ckpt), stage="loaded", engine={"dtype": "bfloat16", **engine})
        return _key(build_vllm_config(cfg))

    assert daemon().mismatched_fields(base) == []
    impl = _engine(tiny_ckpt, model_impl="transformers")
    assert daemon(model_impl="transformers").mismatched_fields(impl) == []
    assert daemon().mismatched_fields(impl) == ["model_impl"]
