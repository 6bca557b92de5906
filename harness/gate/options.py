"""What one gate run is asked to do, and the error for a gate that cannot start."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from harness.engine import DEFAULT_TIMEOUT_S
from harness.verdict import LOGPROB_TOLERANCE
from pgbase.errors import PreloadGateError
from preload.deployment import DeploymentSettings


class GateSetupError(PreloadGateError):
    """The gate cannot start: a bad target, checkpoint or directory."""


@dataclass
class GateOptions:
    """Everything one gate run needs; defaults are the CPU self-test's."""

    candidate: str
    base: str | None = None
    target: str = "verified_cache"
    mutations: str | None = None  # None: promotion gate on the candidate
    report_dir: str | None = None
    workdir: str | None = None
    socket_root: str | None = None
    reference_cache: str | None = None
    # Negative controls (unsafe on purpose): show the gate can fail.
    unsafe_identity: str | None = None
    unsafe_silent_fallback: bool = False
    run_tp: bool = False
    jobs: int = 1
    # The CPU cores this run's single-rank engines are bound to, ``jobs`` of
    # them (None: the first ``jobs`` of the process's, bound only when
    # jobs > 1). The demo gives two gates running side by side one core each.
    cores: tuple[int, ...] | None = None
    engine_timeout_s: float = DEFAULT_TIMEOUT_S
    tolerance: float = LOGPROB_TOLERANCE
    record_golden: bool = True
    # The deployment's engine settings (promotion): the daemon, both engines
    # and the golden run with them. None: the self-test's own settings.
    settings: DeploymentSettings | None = None
    progress: Callable[[str, str], None] | None = None  # (stage, message)

    def note(self, stage: str, msg: str) -> None:
        """Report progress to the ``progress`` callback, if there is one."""
        if self.progress is not None:
            self.progress(stage, msg)
