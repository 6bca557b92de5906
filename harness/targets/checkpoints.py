"""Checkpoints in the format a target reads, and the two digests the runner uses.

- ``file_digest``: SHA-256 of the weight files as they are on disk
  (safetensors shards, or the ``.bin``), in the project's checkpoint-digest
  form: the identity a cache must be judged against.
- ``values_digest``: what an engine at a given dtype holds after loading:
  every tensor cast to that dtype, by sorted name, plus config.json and
  the answer files (:mod:`preload.identity.answer_files`). Two checkpoints with the same values digest give an
  ``auto`` engine the same parameters, so one ``auto`` reference serves
  both (a ``.bin`` written in float32 from bf16 safetensors casts back to
  the same bf16 values). The tensors are read by safetensors and by
  ``torch.load``, never by our own parser.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from fixtures.binformat import BIN_NAME, bin_path, bin_transform, is_bin, to_bin
from fixtures.mutations import copy_checkpoint
from harness.mutations import GateCase
from pgbase.shards import shard_paths
from preload.identity.answer_files import answer_files
from preload.identity.digest import checkpoint_digest, content_digest, hash_file


def weight_files(ckpt: str | os.PathLike[str]) -> list[Path]:
    return [bin_path(ckpt)] if is_bin(ckpt) else shard_paths(ckpt)


def file_digest(ckpt: str | os.PathLike[str]) -> str:
    if is_bin(ckpt):
        return checkpoint_digest({BIN_NAME: hash_file(bin_path(ckpt))})
    return content_digest(ckpt)


def values_digest(ckpt: str | os.PathLike[str], dtype: str = "bfloat16") -> str:
    """SHA-256 over the side files and every tensor's name, dtype, shape and
    bytes after the cast an engine at ``dtype`` makes (vLLM's ``--dtype``
    names: ``bfloat16``, ``half``, ``float``...). ``auto`` casts nothing:
    which dtype vLLM picks then depends on the config and the platform, and
    uncast values can only tell two checkpoints apart more often, never less.
    """
    import torch

    target = None if dtype == "auto" else getattr(torch, dtype)
    h = hashlib.sha256()
    root = Path(ckpt)
    # Besides the weights, what decides an engine's answers: config.json and
    # the answer files, by the one rule goldens and references are keyed by.
    side = {"config.json": hash_file(root / "config.json")} if (root / "config.json").is_file() else {}
    for name, digest in sorted({**side, **answer_files(root)}.items()):
        h.update(f"{name}\0".encode() + bytes.fromhex(digest))
    state: dict[str, torch.Tensor] = {}
    if is_bin(root):
        state = torch.load(bin_path(root), map_location="cpu", weights_only=True)
    else:
        from safetensors.torch import load_file

        for p in shard_paths(root):
            state.update(load_file(str(p)))
    for name in sorted(state):
        t = state[name]
        t = (t.to(target) if target is not None and t.is_floating_point() else t).contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def stage_base(base: str | os.PathLike[str], fmt: str, dest: Path) -> Path:
    """A private copy of ``base`` in ``fmt`` (a target may write into it: npcache does)."""
    out = copy_checkpoint(base, dest)
    if fmt == "bin" and not is_bin(out):
        to_bin(out)
    return out


# vLLM's npcache dump directory and the file whose presence makes it read-only.
_NP_DIR = "np"
_NP_DONE = "weight_names.json"


def derive_copy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """A new directory ``dst`` holding ``src``'s files, as ``cp -a`` would give them.

    Every file is a real copy (its own inode, metadata kept), except a
    *finished* npcache dump (``np/`` holding ``np/weight_names.json``), whose
    files are hard-linked. Why that is safe:

    - no mutation recipe writes there: the recipes of
      :mod:`fixtures.mutations` ``pwrite`` into the safetensors shards, and
      :func:`fixtures.binformat.bin_transform` rewrites ``pytorch_model.bin``
      in place and adds (then removes) ``model.safetensors``; those are
      copies here, so an in-place recipe never reaches the source's inode;
    - no engine writes there: vLLM 0.32 ``model_loader/weight_utils.py``,
      ``np_cache_weights_iterator``, dumps into ``np/`` only
      ``if not os.path.exists(weight_names_file)`` and otherwise only opens
      the files ``"rb"``. Without ``weight_names.json`` an engine would
      write the dump, so an unfinished ``np/`` is copied, never linked.

    A link, should anything still write through it, would show in every
    candidate's dump digest (:func:`harness.targets.npcache.dump_digest`,
    taken per candidate before its engine starts) as a dump the gate did
    not make. Raises :class:`fixtures.mutations.MutationError` when ``dst``
    exists; an ``OSError`` from the file system otherwise (a link across
    file systems falls back to a copy).
    """
    src_p, dst_p = Path(src), Path(dst)
    if dst_p.exists():
        from fixtures.mutations import MutationError

        raise MutationError(f"{dst_p} already exists; a candidate goes into a new directory")
    link_np = (src_p / _NP_DIR / _NP_DONE).is_file()

    def copy(s: str, d: str) -> object:
        if link_np and Path(s).parent == src_p / _NP_DIR:
            try:
                os.link(s, d)
                return d
            except OSError:
                pass
        return shutil.copy2(s, d)

    shutil.copytree(src_p, dst_p, symlinks=False, copy_function=copy)
    return dst_p


def make_candidate(case: GateCase, staged_base: Path, workdir: Path, fmt: str,
                   before_edit: Callable[[Path], None] | None = None) -> Path:
    """The case's candidate, derived from the staged base in the target's format.

    Everything in the base directory travels with the candidate (as ``cp -a``
    does), derived caches included; an in-place row rewrites a private copy
    (where :meth:`fixtures.mutations.Mutation.stage` puts it), never the
    staged base: see :func:`derive_copy` for which files are copies and
    which are links. One copy per candidate. ``before_edit`` is called on an
    in-place row's private copy before the recipe overwrites it (the gate
    fingerprints and promotes it there, as an operator had).
    """
    if case.recipe is None:
        return staged_base
    row = case.recipe
    if row.in_place:
        target = derive_copy(staged_base, workdir / "stage" / f"{row.name}.base")
        if before_edit is not None:
            before_edit(target)
    else:
        target = derive_copy(staged_base, workdir / "cand" / row.name)
    transform = bin_transform(row.transform) if fmt == "bin" else row.transform
    transform(target)
    return target
