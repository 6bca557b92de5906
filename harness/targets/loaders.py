"""vLLM's fast loaders as gate targets: ``fastsafetensors``, ``instanttensor``, ``runai_streamer``.

Users who want fast starts pick a loader before they pick a cache. None of
these checks what it loaded against what ``auto`` would have loaded (vLLM
#50772: fastsafetensors served incoherent greedy text for a TP+EP model), so
each is judged here like a cache with no events: PASS only when its tokens
and logprobs on the candidate equal ``auto``'s on the candidate, else BLOCK
with both answers. A loader target keeps no daemon and builds nothing: the
engine reads the candidate's own safetensors through the loader.

What each needs is read from vLLM 0.33 (``model_loader/weight_utils.py``,
``default_loader.py``, ``runai_streamer_loader.py``), not guessed:

- ``fastsafetensors``: ``fastsafetensors_weights_iterator`` puts every
  tensor on ``cuda:<device>``: CUDA, and the ``fastsafetensors`` package;
- ``instanttensor``: ``instanttensor_weights_iterator`` raises
  "InstantTensor requires NVIDIA GPUs" unless ``current_platform.is_cuda()``
  (ROCm is refused too), and needs the ``instanttensor`` package;
- ``runai_streamer``: ``runai_safetensors_weights_iterator`` streams into
  CPU memory on one rank (``cuda:`` only when distributed): it runs on CPU
  with the ``runai-model-streamer`` package.

Where a requirement is missing, :meth:`LoaderTarget.unavailable` names it
and every case is NOT_RUN, never PASS. :data:`VLLM_LOAD_FORMATS` says, for
every load format vLLM registers, which target judges it or why none does;
a test holds it against the installed vLLM's own registry.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.engine import EngineResult, EngineSpec
from harness.mutations import EngineSettings, GateCase
from harness.targets.base import CacheTarget, PrepareContext, PreparedCache, Served
from harness.targets.ipc_cache import cuda_devices, installed_vllm


@dataclass(frozen=True)
class FastLoader:
    """One of vLLM's load formats and what vLLM's code needs to run it.

    ``module`` is what vLLM imports (looked up without importing it);
    ``dist`` is the pip name; ``gpu``: None (runs on CPU), ``"cuda"`` (a CUDA
    or ROCm device) or ``"nvidia"`` (CUDA on NVIDIA only); ``why_gpu`` is
    the line of vLLM that decides it; ``log_line``: the progress line vLLM
    writes while this loader reads (empty: none known)."""

    load_format: str
    module: str
    dist: str
    gpu: str | None = None
    why_gpu: str = ""
    log_line: str = ""


FASTSAFETENSORS = FastLoader(
    "fastsafetensors", "fastsafetensors", "fastsafetensors", gpu="cuda",
    why_gpu="vLLM's fastsafetensors_weights_iterator loads every tensor onto cuda:<device>")
INSTANTTENSOR = FastLoader(
    "instanttensor", "instanttensor", "instanttensor", gpu="nvidia",
    why_gpu="vLLM's instanttensor_weights_iterator raises 'InstantTensor requires NVIDIA GPUs' "
            "unless current_platform.is_cuda()",
    log_line="Loading safetensors using InstantTensor loader")
RUNAI_STREAMER = FastLoader("runai_streamer", "runai_model_streamer", "runai-model-streamer",
                            log_line="Loading safetensors using Runai Model Streamer")
TENSORIZER = FastLoader("tensorizer", "tensorizer", "tensorizer")
LOADERS: dict[str, FastLoader] = {x.load_format: x for x in (FASTSAFETENSORS, INSTANTTENSOR, RUNAI_STREAMER,
                                                              TENSORIZER)}

# Every load format vLLM registers (model_loader/__init__.py,
# _LOAD_FORMAT_TO_MODEL_LOADER) and the target that judges it, or why none
# does. A format vLLM adds fails the differential test until it has a row.
VLLM_LOAD_FORMATS: dict[str, str] = {
    "auto": "the reference every target is judged against",
    "hf": "auto's own path (DefaultModelLoader, *.safetensors then *.bin): the reference",
    "safetensors": "auto's own path restricted to *.safetensors: the reference",
    "pt": "auto's iterator over *.pt files: no fast path, no cache",
    "mistral": "auto's iterator over consolidated*.safetensors (Mistral's layout): no fast path, no cache",
    "dummy": "random weights: nothing to compare with auto",
    "modelexpress": "weights from a ModelExpress server over the network: no server here",
    "npcache": "target npcache",
    "sharded_state": "target sharded_state",
    "runai_streamer_sharded": "sharded_state's files read through the Run:ai streamer: targets "
                              "sharded_state and runai_streamer between them",
    "ipc_cache": "target ipc_cache",
    "fastsafetensors": "target fastsafetensors",
    "instanttensor": "target instanttensor",
    "runai_streamer": "target runai_streamer",
    "tensorizer": "target tensorizer",
}


def _nvidia() -> bool:
    """torch sees a CUDA device and is not a ROCm build (vLLM's is_cuda())."""
    if cuda_devices() == 0:
        return False
    import torch  # here, not at the top: seconds to import, and only unavailable() needs it

    return torch.version.hip is None


def package_present(module: str) -> bool:
    """``module`` is importable here, looked up without importing it (an import costs seconds)."""
    return importlib.util.find_spec(module) is not None


def missing_requirements(loader: FastLoader) -> list[str]:
    """What this machine lacks for ``loader`` (empty: nothing), each naming what to get.

    >>> missing_requirements(RUNAI_STREAMER)  # doctest: +SKIP
    ['the Python package runai_model_streamer (pip install runai-model-streamer; vLLM imports it for runai_streamer)']
    """
    missing = []
    if loader.gpu == "nvidia" and not _nvidia():
        missing.append(f"an NVIDIA CUDA device ({loader.why_gpu}; torch sees "
                       f"{'a non-NVIDIA GPU' if cuda_devices() else 'none'})")
    elif loader.gpu == "cuda" and cuda_devices() == 0:
        missing.append(f"a CUDA device ({loader.why_gpu}; torch sees none)")
    if not package_present(loader.module):
        missing.append(f"the Python package {loader.module} (pip install {loader.dist}; "
                       f"vLLM imports it for {loader.load_format})")
    if installed_vllm() is None:
        missing.append("vLLM (not installed)")
    return missing


class LoaderTarget(CacheTarget):
    """A load path with no cache in between: the engine reads the candidate itself.

    Subclasses set ``loader``; :meth:`extra_config` is the engine's
    ``model_loader_extra_config`` (None: vLLM's defaults)."""

    loader: FastLoader = FASTSAFETENSORS
    records_events = False
    checkpoint_format = "safetensors"
    default_cases: tuple[str, ...] = ()  # `all`: the whole catalogue, like the caches
    stages_base = False  # a loader writes nothing into the base or the candidate

    def unavailable(self) -> str | None:
        missing = missing_requirements(self.loader)
        if missing:
            return f"vLLM's {self.loader.load_format} loader was not run: this machine lacks " + "; and ".join(missing)
        return None

    def prepare(self, base: Path, settings: EngineSettings, ctx: PrepareContext) -> PreparedCache:
        """Nothing to build: the base's digest, for the notes (what a cache would have held)."""
        return PreparedCache(settings, base, ctx.digest_of(base))

    def extra_config(self, cache: PreparedCache) -> dict[str, Any] | None:
        return None

    def cached_spec(self, cache: PreparedCache, case: GateCase, candidate: Path,
                    common: dict[str, Any], expect: str) -> EngineSpec:
        return EngineSpec(checkpoint=str(candidate), load_format=self.loader.load_format,
                          extra_config=self.extra_config(cache), **common)

    def served(self, cache: PreparedCache, case: GateCase, candidate: Path, candidate_digest: str,
               result: EngineResult, log: str) -> Served:
        notes = [f"no cache: the engine read the candidate's own safetensors ({candidate_digest[:16]}) through "
                 f"vLLM's {self.loader.load_format} loader; judged on its output against auto on the same files"]
        if self.loader.log_line:
            seen = self.loader.log_line in log
            notes.append(f"vLLM {'logged' if seen else 'did not log'} '{self.loader.log_line}'")
        return Served(hit_proven=False, notes=notes)


class FastsafetensorsTarget(LoaderTarget):
    name = "fastsafetensors"
    summary = "vLLM's --load-format fastsafetensors: safetensors read straight into GPU memory (GDS where it can)"
    loader = FASTSAFETENSORS


class InstanttensorTarget(LoaderTarget):
    name = "instanttensor"
    summary = "vLLM's --load-format instanttensor: whole files read into NVIDIA GPU memory, collectively"
    loader = INSTANTTENSOR


class RunaiStreamerTarget(LoaderTarget):
    name = "runai_streamer"
    summary = "vLLM's --load-format runai_streamer: the Run:ai streamer reads tensors concurrently into CPU memory"
    loader = RUNAI_STREAMER
