"""The core binding the gate hands a pinned engine is one vLLM accepts for
every rank (differential: vLLM's own parser, OMPProcessManager).

With ``--jobs 2`` each engine is pinned to a core. A data-parallel engine
(the self-test's ``dp_shift``) got a one-entry ``VLLM_CPU_OMP_THREADS_BIND``;
vLLM gives each DP engine core its slice of the list, so DP rank 1 got none
and the engine failed to start: the self-test BLOCKed a correct cache.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.engine import CorePool, EngineSpec

pytestmark = pytest.mark.unit

SHAPES = [(1, 1, 1), (1, 1, 2), (1, 2, 1), (1, 2, 2)]  # (tp, pp, dp) a pinned engine can have


def _vllm_cpu_lists(bind: str, world: int, dp_rank: int, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """What vLLM's CPU worker makes of ``bind`` for one DP engine core."""
    ompmp = pytest.importorskip("vllm.utils.ompmultiprocessing")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU platform decides the binding; this vLLM is not the CPU build")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    config = SimpleNamespace(kv_transfer_config=None, parallel_config=SimpleNamespace(
        local_world_size=world, data_parallel_rank_local=dp_rank, _api_process_count=1))
    return ompmp.OMPProcessManager(config).cpu_lists


@pytest.mark.parametrize("tp,pp,dp", SHAPES, ids=[f"tp{t}-pp{p}-dp{d}" for t, p, d in SHAPES])
def test_vllm_accepts_the_pinned_binding_for_every_rank(tp, pp, dp, monkeypatch):
    spec = EngineSpec(checkpoint="/x", tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp)
    with CorePool(1, cores=(1,)).pinned(spec) as pinned:
        bind = pinned.env["VLLM_CPU_OMP_THREADS_BIND"]
    for dp_rank in range(dp):
        assert _vllm_cpu_lists(bind, tp * pp, dp_rank, monkeypatch) == [[1]] * (tp * pp), (bind, dp_rank)


def test_control_a_one_entry_binding_fails_vllm_for_dp_rank_1(monkeypatch):
    # What the pool handed a DP=2 engine before: vLLM refuses it for rank 1.
    assert _vllm_cpu_lists("1", 1, 0, monkeypatch) == [[1]]
    with pytest.raises(AssertionError, match="doesn't match local world size"):
        _vllm_cpu_lists("1", 1, 1, monkeypatch)


def test_ranks_go_round_robin_over_the_cores_given():
    from harness.engine import omp_bind

    spec = EngineSpec(checkpoint="/x", tensor_parallel_size=2, data_parallel_size=2)
    assert omp_bind(spec, ["0", "1"]) == "0|1|0|1"
    assert omp_bind(EngineSpec(checkpoint="/x"), ["3"]) == "3"
