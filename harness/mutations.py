"""The gate's cases: the rows of :data:`fixtures.mutations.CATALOGUE`, with
the check only the harness can make.

The rows themselves (file recipes and engine-setting shifts, with the key
fields each must change) live in the one table in :mod:`fixtures.mutations`;
this module does not repeat them. It adds what needs the product: a case
whose candidate weights equal the base's under the daemon's settings must
*hit*; every other case must *miss loudly* (a miss event naming its reason,
then a disk load that matches ``auto``). A setting row also has a key-level
check that needs no engine: the ``WeightCacheKey`` built for the daemon's
settings against the one built for the engine's, by the product's own rule,
must differ in the row's key fields. Where the platform cannot run a case
end to end, the case says why and the report shows it as not run; the key
check still runs.

>>> [c.name for c in select_cases("zeroed_norm,dtype_change")]
['zeroed_norm', 'dtype_change']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fixtures.mutations import BASE_SETTINGS, CATALOGUE, EngineSettings, Mutation
from pgbase.errors import PreloadGateError
from preload.identity.key import WeightCacheKey


class CaseSelectionError(PreloadGateError):
    """``--mutations`` named a case the catalogue does not have."""


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

    def engine_kwargs(self) -> dict[str, Any]:
        """The case's engine settings as :class:`harness.engine.EngineSpec` keywords."""
        return self.settings.to_json()

    def key_check(self, digest: str, is_moe: bool = False) -> KeyCheck:
        """Build the daemon's key and the engine's key for this case with the
        product's own rule (:func:`preload.vllm_key.rank_key`, what the
        loader and the daemon use); compare."""
        held = self.cache_settings  # what the daemon (or saved cache) was prepared with
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


def _case(row: Mutation) -> GateCase:
    return GateCase(
        name=row.name,
        description=row.description,
        recipe=row if row.is_file else None,
        weights_equal=row.weights_equal,
        settings=row.settings,
        expected_fields=row.key_fields,
        cpu_skip=row.cpu_skip,
        cache_settings=row.cache_settings,
        server=row.server,
    )


# What ``--mutations all`` runs, in catalogue order.
CASES: tuple[GateCase, ...] = tuple(_case(r) for r in CATALOGUE if not r.target_only)
# Cases only some targets run (``preload-gate gate --target``): the cache is
# prepared under other settings than the engine's.
TARGET_CASES: tuple[GateCase, ...] = tuple(_case(r) for r in CATALOGUE if r.target_only)


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
