"""The gate's case catalogue: file mutations plus engine-setting shifts.

File recipes live in :mod:`fixtures.mutations` (one table, one row per
recipe); this module does not repeat them. It adds what only the gate
needs: the engine settings of each case and the outcome the cached engine
must have. A case whose candidate weights equal the base's under the
daemon's settings must *hit*; every other case must *miss loudly* (a miss
event naming its reason, then a disk load that matches ``auto``).

Engine-setting cases keep the base's bytes and change what the engine asks
for: the data-parallel size, the tensor-parallel size, the dtype. Each also
has a key-level check that needs no engine: the ``WeightCacheKey`` built for
the daemon's settings against the one built for the engine's must differ in
the named fields. Where the platform cannot run a case end to end, the
case says why and the report shows it as not run; the key check still runs.

>>> [c.name for c in select_cases("zeroed_norm,dtype_change")]
['zeroed_norm', 'dtype_change']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fixtures.mutations import MUTATIONS, Mutation
from pgbase.errors import PreloadGateError
from preload.identity.key import WeightCacheKey


class CaseSelectionError(PreloadGateError):
    """``--mutations`` named a case the catalogue does not have."""


@dataclass(frozen=True)
class EngineSettings:
    """The settings a case's engines run with (the daemon keeps the base's)."""

    dtype: str = "bfloat16"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1

    def to_json(self) -> dict[str, Any]:
        """The settings as engine-spec keywords (and a report's settings column)."""
        return {"dtype": self.dtype, "tensor_parallel_size": self.tensor_parallel_size,
                "data_parallel_size": self.data_parallel_size}


BASE_SETTINGS = EngineSettings()


@dataclass(frozen=True)
class KeyCheck:
    """Outcome of comparing the daemon's key with the engine's for one case."""

    expected_fields: tuple[str, ...]
    mismatched_fields: tuple[str, ...]
    note: str = ""

    @property
    def ok(self) -> bool:
        return set(self.expected_fields) <= set(self.mismatched_fields) and (
            bool(self.expected_fields) or not self.mismatched_fields
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "expected_fields": list(self.expected_fields),
            "mismatched_fields": list(self.mismatched_fields),
            "note": self.note,
        }


@dataclass(frozen=True)
class GateCase:
    """One row of the gate: a candidate recipe, engine settings, a required outcome.

    ``recipe`` is a :class:`fixtures.mutations.Mutation` (None: the candidate
    is the base itself). ``cpu_skip`` is the reason the CPU platform does not
    run the case end to end (empty: it runs).
    """

    name: str
    description: str
    recipe: Mutation | None
    weights_equal: bool
    settings: EngineSettings = BASE_SETTINGS
    expected_fields: tuple[str, ...] = ()
    cpu_skip: str = ""
    # The settings the cache was prepared with (a daemon, a saved sharded state).
    cache_settings: EngineSettings = BASE_SETTINGS
    # Run through the OpenAI server (the offline LLM cannot do the setting).
    server: bool = False
    # The daemon holds the base while the candidate is asked for (promotion
    # gate with --base); otherwise it holds what the case's digest says.
    holds_base: bool = False
    key_builder: Callable[[str, EngineSettings], WeightCacheKey] | None = field(
        default=None, compare=False
    )

    @property
    def expect(self) -> str:
        """The catalogue's reading for a dense model: ``hit`` when the weights
        are equal and the settings leave the key unchanged. The gate itself
        decides from the digests and keys it computes
        (:func:`harness.verdict.expected_outcome`), never from this name."""
        return "hit" if self.weights_equal and not self.key_check("0" * 64).mismatched_fields else "miss"

    @property
    def in_place(self) -> bool:
        return bool(self.recipe and self.recipe.in_place)

    def key_check(self, digest: str, is_moe: bool = False) -> KeyCheck:
        """Build the daemon's key and the engine's key for this case with the
        product's own rule (:func:`preload.vllm_key.rank_key`, what the
        loader and the daemon use); compare."""
        held = self.cache_settings  # what the daemon (or saved cache) was prepared with
        if self.key_builder is not None:
            daemon, engine = self.key_builder(digest, held), self.key_builder(digest, self.settings)
        else:
            daemon, engine = settings_key(digest, held, is_moe), settings_key(digest, self.settings, is_moe)
        note = "keyed as a MoE model (DP shards the experts)" if is_moe else (
            "keyed as a dense model: DP replicas hold the full weights, so DP does not change the key")
        return KeyCheck(self.expected_fields, tuple(daemon.mismatched_fields(engine)), note)


def settings_key(digest: str, s: EngineSettings, is_moe: bool, rank: int = 0) -> WeightCacheKey:
    """Rank ``rank``'s key under settings ``s``, by the loader's and daemon's rule."""
    from preload.vllm_key import rank_key

    return rank_key(digest, is_moe=is_moe, dtype=s.dtype, tp_size=s.tensor_parallel_size, tp_rank=rank,
                    dp_size=s.data_parallel_size, enable_expert_parallel=is_moe)


def dense_key(digest: str, s: EngineSettings, rank: int = 0) -> WeightCacheKey:
    """Rank 0's key for a dense model: DP does not change its tensors."""
    return settings_key(digest, s, is_moe=False, rank=rank)


def moe_key(digest: str, s: EngineSettings, rank: int = 0) -> WeightCacheKey:
    """Rank 0's key for a MoE model with expert parallelism: DP shards the experts."""
    return settings_key(digest, s, is_moe=True, rank=rank)


def _from_recipe(row: Mutation) -> GateCase:
    return GateCase(
        name=row.name,
        description=row.description,
        recipe=row,
        weights_equal=row.weights_equal,
        expected_fields=() if row.weights_equal else ("content_digest",),
    )


SETTING_CASES: tuple[GateCase, ...] = (
    GateCase(
        "dtype_change", "the base's bytes served as float32 (the daemon holds bfloat16)",
        recipe=None, weights_equal=True, settings=EngineSettings(dtype="float32"),
        expected_fields=("dtype",),
    ),
    GateCase(
        "tp_shift", "the base's bytes at tensor-parallel size 2 (the daemon holds TP=1)",
        recipe=None, weights_equal=True, settings=EngineSettings(tensor_parallel_size=2),
        expected_fields=("tp_size",),
        cpu_skip=(
            "TP=2 on CPU binds both cores (VLLM_CPU_OMP_THREADS_BIND=0|1) for an auto and a "
            "cached engine of two ranks each (about 2.5 min on a loaded 2-core runner), while "
            "the key check below already decides the outcome; run it with --run-tp"
        ),
    ),
    GateCase(
        "dp_shift", "the base's bytes at data-parallel size 2 (the daemon holds DP=1)",
        recipe=None, weights_equal=True, settings=EngineSettings(data_parallel_size=2),
        # A dense model's DP replicas hold the full weights: the key (and so
        # the required outcome) does not change; a MoE model's would.
        expected_fields=(), server=True,
    ),
)

CASES: tuple[GateCase, ...] = tuple(_from_recipe(r) for r in MUTATIONS) + SETTING_CASES

# Cases only some targets run (``preload-gate gate --target``): the cache is
# prepared under other settings than the engine's.
TARGET_CASES: tuple[GateCase, ...] = (
    GateCase(
        "tp_2_to_1", "the base's bytes at TP=1 from a cache prepared at TP=2 (a sharded state saved by two ranks)",
        recipe=None, weights_equal=True, cache_settings=EngineSettings(tensor_parallel_size=2),
        expected_fields=("tp_size",),
    ),
)


def case_by_name(name: str) -> GateCase:
    """A case of :data:`CASES` or :data:`TARGET_CASES`; unknown names list the known ones."""
    known = {c.name: c for c in CASES + TARGET_CASES}
    if name not in known:
        raise CaseSelectionError(f"unknown mutation {name}; known: {', '.join(known)}")
    return known[name]


def select_cases(spec: str) -> list[GateCase]:
    """``all`` or a comma-separated list of case names, in catalogue order."""
    if spec.strip() in ("", "all"):
        return list(CASES)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    known = {c.name: c for c in CASES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise CaseSelectionError(
            f"unknown mutation {', '.join(unknown)}; known: {', '.join(known)}"
        )
    return [c for c in CASES if c.name in names]
