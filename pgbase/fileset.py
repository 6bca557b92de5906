"""Which files an engine reads: vLLM's own selection, or a mirror proven equal.

The shard set we hash, serve and stat must be exactly the set vLLM's
``DefaultModelLoader._prepare_weights`` picks for the load format, or a hit
could serve other weights than ``auto`` loads (a ``consolidated.safetensors``
beside indexed ``model-*`` shards switches vLLM to the mistral file set).

- When vLLM imports, :func:`select_files` calls ``_prepare_weights`` itself
  (no engine needed), so the rule is vLLM's, not a copy.
- Without vLLM (the raw stage, the GPU machine) :func:`mirror_selection`
  follows the same steps with the same stdlib calls; its equality with
  vLLM's answer is held by ``tests/cpu/test_fileset_differential.py`` over a
  generated corpus of layouts.

A selection the cache cannot serve exactly (``.bin``/``.pt`` weights, a
directory named ``*.safetensors``) is a :class:`CheckpointError` with one
line naming the problem, never a different set.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from pgbase.errors import CheckpointError
from pgbase.oscause import file_kind, reason

HF_INDEX = "model.safetensors.index.json"
MISTRAL_INDEX = "consolidated.safetensors.index.json"
LOAD_FORMATS = ("auto", "hf", "safetensors", "mistral")
# transformers' trainer files that vLLM drops from a non-safetensors set.
_NOT_FOR_INFERENCE = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")
# PRELOAD_GATE_FILESET=mirror forces the mirror (tests, hosts with a broken vLLM).
ENV_SOURCE = "PRELOAD_GATE_FILESET"


@dataclass(frozen=True)
class FileSet:
    """The weight files vLLM reads from ``folder`` for ``load_format``."""

    folder: Path
    files: tuple[str, ...]  # basenames, sorted by byte order
    use_safetensors: bool
    index_file: str  # the index vLLM consults (it may not exist)
    source: str  # "vllm <version> _prepare_weights" or "mirror"

    @property
    def paths(self) -> list[Path]:
        return [self.folder / n for n in self.files]


class SelectionError(CheckpointError):
    """vLLM itself cannot pick weight files here (it raises too)."""


def _sorted_names(paths: list[str]) -> tuple[str, ...]:
    return tuple(sorted((os.path.basename(p) for p in paths), key=str.encode))


def vllm_selection(checkpoint: str | os.PathLike[str], load_format: str = "auto") -> FileSet:
    """Ask the installed vLLM which files its loader reads (ImportError without vLLM)."""
    from vllm import __version__ as vllm_version
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.transformers_utils import repo_utils

    folder = os.fspath(checkpoint)
    # vLLM memoizes its directory listing per process; an engine lists once at
    # start, so a fresh listing is what a starting engine sees.
    repo_utils.list_repo_files.cache_clear()
    loader = DefaultModelLoader(LoadConfig(load_format=load_format))
    try:
        hf_folder, files, use_st, index = loader._prepare_weights(folder, None, None, True, None)
    except (RuntimeError, FileNotFoundError, OSError, ValueError, KeyError, TypeError) as exc:
        raise SelectionError(f"vLLM cannot pick weight files in {folder}: {reason(exc)}") from exc
    return FileSet(Path(hf_folder), _sorted_names(files), bool(use_st), index,
                   f"vllm {vllm_version} DefaultModelLoader._prepare_weights")


def _mistral_switch(folder: str) -> bool:
    """vLLM's ``list_filtered_repo_files(folder, ["consolidated*.safetensors"])``
    for a local folder: every regular file below it, hidden ones and
    subdirectories included, matched on its basename."""
    local = Path(folder)
    if not local.exists():
        return False
    try:
        names = [str(f.relative_to(local)) for f in local.rglob("*") if f.is_file()]
    except Exception:
        return False  # vLLM logs and treats an unlistable repo as empty
    return any(fnmatch.fnmatch(os.path.basename(n), "consolidated*.safetensors") for n in names)


def mirror_selection(checkpoint: str | os.PathLike[str], load_format: str = "auto") -> FileSet:
    """vLLM 0.32's ``_prepare_weights`` for a local folder, step for step."""
    folder = os.fspath(checkpoint)
    if load_format not in LOAD_FORMATS:
        raise SelectionError(f"load format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    use_st = False
    index_file = HF_INDEX
    fmt = load_format
    if fmt == "auto":
        fmt = "mistral" if _mistral_switch(folder) else "hf"
    if fmt == "hf":
        patterns = ["*.safetensors", "*.bin"]
    elif fmt == "safetensors":
        use_st, patterns = True, ["*.safetensors"]
    else:
        use_st, patterns, index_file = True, ["consolidated*.safetensors"], MISTRAL_INDEX
    if not use_st:
        patterns += ["*.pt"]  # fall_back_to_pt
    files: list[str] = []
    for pattern in patterns:
        files += glob.glob(os.path.join(folder, pattern))
        if files:
            if pattern.endswith(".safetensors"):
                use_st = True
            break
    if use_st:
        index_path = os.path.join(folder, index_file)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
                wanted = {os.path.join(folder, weight_map[k]) for k in weight_map}
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise SelectionError(f"vLLM cannot pick weight files in {folder}: {reason(exc, index_path)}") from exc
            missing = wanted - set(files)
            if missing:
                raise SelectionError(f"vLLM cannot pick weight files in {folder}: FileNotFoundError: "
                                     f"Weight files referenced in index but missing: {missing}")
            files = [f for f in files if f in wanted]
    else:
        files = [f for f in files if not any(f.endswith(x) for x in _NOT_FOR_INFERENCE)]
    if not files:
        raise SelectionError(f"vLLM cannot pick weight files in {folder}: RuntimeError: "
                             f"Cannot find any model weights with `{folder}`")
    return FileSet(Path(folder), _sorted_names(files), use_st, index_file, "mirror")


def _import_vllm_loader() -> None:
    """Import vLLM's loader; when this process has not imported vLLM yet (a
    CLI verb), its import-time notices (Triton probing) are kept off the
    terminal, so a bad checkpoint is still one line."""
    import sys

    if "vllm" in sys.modules:
        import vllm.model_executor.model_loader.default_loader  # noqa: F401
        return
    import logging

    saved = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        import vllm.model_executor.model_loader.default_loader  # noqa: F401
    finally:
        logging.disable(saved)


def _vllm_wanted() -> bool:
    choice = os.environ.get(ENV_SOURCE, "auto")
    if choice == "mirror":
        return False
    try:
        _import_vllm_loader()
    except ImportError:
        if choice == "vllm":
            raise
        return False
    return True


def select_files(checkpoint: str | os.PathLike[str], load_format: str = "auto",
                 prefer_vllm: bool = True) -> FileSet:
    """vLLM's selection when vLLM imports (and ``prefer_vllm``), else the mirror."""
    if prefer_vllm and _vllm_wanted():
        return vllm_selection(checkpoint, load_format)
    return mirror_selection(checkpoint, load_format)


def servable(fs: FileSet) -> FileSet:
    """``fs`` if the cache can serve exactly these files, else one line why.

    The daemon reads safetensors only; a ``.bin``/``.pt`` set is refused
    rather than replaced by some other set of files.
    """
    if not fs.use_safetensors:
        kinds = sorted({os.path.splitext(n)[1] for n in fs.files})
        raise CheckpointError(
            f"vLLM loads {', '.join(kinds)} weights from {fs.folder} ({', '.join(fs.files[:3])}"
            f"{', ...' if len(fs.files) > 3 else ''}), as it finds no *.safetensors there; preload-gate serves "
            "safetensors only: convert the checkpoint to safetensors, or serve it with --load-format auto"
        )
    for name in fs.files:
        p = fs.folder / name
        try:
            st = os.stat(p)
        except OSError as exc:  # a broken symlink names its target here
            raise CheckpointError(reason(exc, p), name) from exc
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"is {file_kind(p)}, not a regular file", name)
    return fs
