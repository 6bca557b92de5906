"""vLLM's ``--load-format npcache``: a numpy dump of the weights in ``<ckpt>/np/``.

vLLM 0.32 (``model_loader/weight_utils.py``, ``np_cache_weights_iterator``)
dumps every tensor of the ``.bin`` files to ``np/`` on the first load and,
whenever ``np/weight_names.json`` exists, reads the dump instead of the
``.bin`` files: it is never compared with them and never invalidated. An
in-place overwrite of the ``.bin`` is served stale; a copy of the directory
carries the dump along.

Prepare: vLLM's own dump function on a private ``.bin`` copy of the base
(the candidates are made from that directory afterwards, so the dump
travels as it does for an operator). The engine records no load event;
the gate can say only what sat in ``np/`` when it started, and judges the
output against ``auto``.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

from harness.engine import EngineResult, EngineSpec
from harness.mutations import BASE_SETTINGS, EngineSettings, GateCase
from harness.targets._procs import run_all
from harness.targets.base import CacheTarget, PrepareContext, PreparedCache, Served


def dump_digest(ckpt: Path) -> str | None:
    """SHA-256 over the ``np/`` dump (names and bytes), or None when there is none."""
    np_dir = ckpt / "np"
    if not (np_dir / "weight_names.json").is_file():
        return None
    h = hashlib.sha256()
    for p in sorted(np_dir.iterdir()):
        if p.is_file():
            h.update(p.name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


class NpcacheTarget(CacheTarget):
    name = "npcache"
    summary = "vLLM's np/ dump beside the .bin files; reused whenever np/weight_names.json exists"
    records_events = False
    checkpoint_format = "bin"
    default_cases = ("identical_copy", "zeroed_norm", "finetune_noise", "stale_derivation", "inplace_overwrite")

    def case_unavailable(self, case: GateCase) -> str | None:
        if case.cache_settings != BASE_SETTINGS:
            return "npcache keeps one dump per checkpoint directory, with no parallel layout to prepare"
        return None

    def prepare(self, base: Path, settings: EngineSettings, ctx: PrepareContext) -> PreparedCache:
        run_all([["-m", "harness.targets._npcache_dump", str(base)]], [ctx.workdir / "npcache-dump.log"],
                timeout_s=ctx.engine_timeout_s)
        return PreparedCache(settings, base / "np", ctx.digest_of(base), info={"dump": dump_digest(base),
                                                                            "before": {}})

    def place(self, cache: PreparedCache, candidate: Path, ctx: PrepareContext) -> None:
        """A candidate given as is (promotion) gets the base's dump, as a directory
        copied from the served base would; candidates made from the base carry it."""
        if not (candidate / "np").exists():
            shutil.copytree(cache.location, candidate / "np", copy_function=shutil.copy2)

    def cached_spec(self, cache: PreparedCache, case: GateCase, candidate: Path,
                    common: dict[str, Any], expect: str) -> EngineSpec:
        # What sits in np/ when the engine starts (after this, the engine may write a dump).
        cache.info["before"][str(candidate)] = dump_digest(candidate)
        return EngineSpec(checkpoint=str(candidate), load_format="npcache", **common)

    def served(self, cache: PreparedCache, case: GateCase, candidate: Path, candidate_digest: str,
               result: EngineResult, log: str) -> Served:
        before = cache.info["before"].get(str(candidate))
        notes = []
        if before is None:
            notes.append("no np/ dump in the candidate directory: the load dumped the candidate's own .bin")
        elif before == cache.info["dump"]:
            same = candidate_digest == cache.source_digest
            notes.append(
                f"np/ held the dump made from the base's .bin ({cache.source_digest[:16]}); vLLM reads it whenever "
                f"np/weight_names.json exists and never compares it with the .bin files "
                f"({'the same content as' if same else 'NOT the content of'} the candidate, {candidate_digest[:16]})")
        else:
            notes.append(f"np/ held a dump the gate did not make ({before[:16]})")
        return Served(hit_proven=False, notes=notes)

