"""vLLM's ``--load-format sharded_state``: per-rank files saved earlier, found by a glob.

vLLM 0.32 (``model_loader/sharded_state_loader.py``) globs
``model-rank-{rank}-part-*.safetensors`` in the model directory and copies
each saved tensor into the parameter of the same name: a dtype mismatch is
a warning, a saved tensor smaller than the parameter is a warning and a
partial copy. Nothing ties the files to a checkpoint: a state saved from the
base serves a fine-tune, a state saved at TP=2 serves a TP=1 engine.

Prepare: save the base's state at the case's cache TP, before weight
processing (see :mod:`harness.targets._sharded_save`), into a derived
directory with the base's config and tokenizer, as vLLM's
``save_sharded_state`` example lays it out. The engine for every candidate
serves that directory: it reads nothing else. No load event is recorded;
the gate judges output against ``auto`` and lists vLLM's shape and dtype
warnings from the engine log.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from harness.engine import EngineResult, EngineSpec
from harness.mutations import EngineSettings, GateCase
from harness.targets._procs import run_all
from harness.targets.base import CacheTarget, PrepareContext, PreparedCache, Served
from harness.targets.checkpoints import weight_files
from pgbase.ports import free_port

_WARNINGS = re.compile(r"(loading tensor of shape .*|Attempted to load weight .*)")


class ShardedStateTarget(CacheTarget):
    name = "sharded_state"
    summary = "vLLM's per-rank state files, saved once and globbed by rank at every start"
    records_events = False
    checkpoint_format = "safetensors"
    default_cases = ("identical_copy", "zeroed_norm", "stale_derivation", "inplace_overwrite", "tp_2_to_1")

    def prepare(self, base: Path, settings: EngineSettings, ctx: PrepareContext) -> PreparedCache:
        workdir = ctx.workdir
        out = workdir / "sharded"
        out.mkdir(parents=True, exist_ok=True)
        weights = {p.name for p in weight_files(base)}
        for p in base.iterdir():  # config, tokenizer: everything but the weights
            if p.is_file() and p.name not in weights and not p.name.endswith(".index.json"):
                shutil.copy2(p, out / p.name)
        tp = settings.tensor_parallel_size
        init = f"tcp://127.0.0.1:{free_port()}"
        cmds = [["-m", "harness.targets._sharded_save", str(base), str(out), str(tp), str(r), init, settings.dtype]
                for r in range(tp)]
        run_all(cmds, [workdir / f"save-rank{r}.log" for r in range(tp)], timeout_s=ctx.engine_timeout_s)
        files = sorted(p.name for p in out.glob("model-rank-*-part-*.safetensors"))
        return PreparedCache(settings, out, ctx.digest_of(base), info={"files": files, "tp": tp})

    def cached_spec(self, cache: PreparedCache, case: GateCase, candidate: Path,
                    common: dict[str, Any], expect: str) -> EngineSpec:
        return EngineSpec(checkpoint=str(cache.location), load_format="sharded_state", **common)

    def served(self, cache: PreparedCache, case: GateCase, candidate: Path, candidate_digest: str,
               result: EngineResult, log: str) -> Served:
        same = candidate_digest == cache.source_digest
        # vLLM globs model-rank-{rank}-part-*: each engine rank reads its own rank's files only.
        ranks = range(case.settings.tensor_parallel_size)
        read = [f for f in cache.info["files"] if any(f.startswith(f"model-rank-{r}-part-") for r in ranks)]
        notes = [f"the engine reads only {', '.join(read) or 'nothing'} in {cache.location}, saved at "
                 f"TP={cache.info['tp']} from content {cache.source_digest[:16]} "
                 f"({'the candidate' if same else 'NOT the candidate, ' + candidate_digest[:16]})"]
        warned = sorted(set(_WARNINGS.findall(log)))
        if warned:
            notes.append(f"vLLM warned {len(warned)} time(s) and loaded anyway, e.g. {warned[0]}")
        return Served(hit_proven=False, notes=notes)
