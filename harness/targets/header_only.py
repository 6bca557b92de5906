"""Our daemon keyed as vLLM's ``ipc_cache`` keys it: the upstream bug, on CPU.

vLLM 0.33's ``ipc_cache`` fingerprints a checkpoint by an MD5 of its file
names and safetensors headers (``weight_cache/protocol.py``,
``hash_checkpoint``), and refuses CPU even with fallback on
(``check_ipc_platform_support``). The same identity runs here through the
daemon's and loader's negative-control switch (``--unsafe-identity
header_only``): a value edit that keeps the header gets a hit on the
base's weights. The switch is allowed only with
``PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS=1``, which the gate sets for its own
children (daemon and engines) and nowhere else.
"""

from __future__ import annotations

from harness.targets.base import UNSAFE_CONTROLS_ENV
from harness.targets.verified_cache import VerifiedCacheTarget


class HeaderOnlyTarget(VerifiedCacheTarget):
    name = "header_only"
    summary = "our daemon under vLLM's header-only key (file names + safetensors headers)"
    unsafe_identity: str | None = "header_only"
    default_cases = ("identical_copy", "zeroed_norm", "tail_edit", "mid_row_zeroed", "single_element",
                     "finetune_noise", "constant_shift", "first_row_zeroed", "inplace_overwrite")

    def child_env(self) -> dict[str, str]:
        return {UNSAFE_CONTROLS_ENV: "1"}
