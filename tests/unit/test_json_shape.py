"""Configs read back as JSON: one line naming the field, by msgspec.

Rows for each reader that goes through :func:`pgbase.json_shape.convert`
(deployment settings, a rank's orders, the cache key): the object its own
``to_json`` wrote is the control that parses back equal.
"""

from __future__ import annotations

import pytest

from preload.daemon.stage import RankConfig
from preload.deployment import DeploymentSettings, SettingsError
from preload.identity.key import WeightCacheKey

pytestmark = pytest.mark.unit

GOOD = {
    DeploymentSettings: DeploymentSettings(dtype="float16", tensor_parallel_size=2, max_model_len=256),
    RankConfig: RankConfig(checkpoint="/c", tp_rank=1, engine={"dtype": "float16"}, cpus=[0, 1]),
    WeightCacheKey: WeightCacheKey(content_digest="a" * 64, tp_size=2, quantization="fp8"),
}


@pytest.mark.parametrize("cls", list(GOOD), ids=lambda c: c.__name__)
def test_control_what_to_json_wrote_parses_back_equal(cls) -> None:
    assert cls.from_json(GOOD[cls].to_json()) == GOOD[cls]


@pytest.mark.parametrize("cls, change, error, message", [
    (DeploymentSettings, {"tensor_parallel_size": "2"}, SettingsError,
     r"deployment settings: Expected `int`, got `str` - at `\$.tensor_parallel_size`"),
    (DeploymentSettings, {"enable_expert_parallel": 1}, SettingsError, r"got `int` - at `\$.enable_expert_parallel`"),
    (DeploymentSettings, {"tensor_paralel_size": 2}, SettingsError, r"unknown fields \['tensor_paralel_size'\]"),
    # A range is __post_init__'s, by its flag, and passes through msgspec unchanged.
    (DeploymentSettings, {"max_model_len": 0}, SettingsError, "--max-model-len must be at least 1, got 0"),
    (RankConfig, {"tp_rank": True}, ValueError, r"rank config: Expected `int`, got `bool` - at `\$.tp_rank`"),
    (RankConfig, {"cpus": [0, "1"]}, ValueError, r"at `\$.cpus\[1\]`"),
    (RankConfig, {"stagee": "raw"}, ValueError, r"rank config: unknown fields \['stagee'\]"),
    (WeightCacheKey, {"vllm_version": 33}, ValueError, r"cache key: Expected `str \| null`, got `int`"),
    (WeightCacheKey, {"zz": 1}, ValueError, r"cache key: unknown fields \['zz'\]"),
])
def test_a_bad_field_is_one_line_naming_it(cls, change, error, message) -> None:
    obj = {**GOOD[cls].to_json(), **change}
    with pytest.raises(error, match=message) as info:
        cls.from_json(obj)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("cls", list(GOOD), ids=lambda c: c.__name__)
def test_not_an_object_is_refused(cls) -> None:
    with pytest.raises(ValueError if cls is not DeploymentSettings else SettingsError, match="got `array`"):
        cls.from_json([])
