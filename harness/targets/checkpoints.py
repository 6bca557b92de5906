"""Checkpoints in the format a target reads, and the two digests the runner uses.

- ``file_digest``: SHA-256 of the weight files as they are on disk
  (safetensors shards, or the ``.bin``), in the project's checkpoint-digest
  form: the identity a cache must be judged against.
- ``values_digest``: what an engine at a given dtype holds after loading:
  every tensor cast to that dtype, by sorted name, plus the config and
  tokenizer files. Two checkpoints with the same values digest give an
  ``auto`` engine the same parameters, so one ``auto`` reference serves
  both (a ``.bin`` written in float32 from bf16 safetensors casts back to
  the same bf16 values). The tensors are read by safetensors and by
  ``torch.load``, never by our own parser.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from fixtures.binformat import BIN_NAME, bin_path, bin_transform, is_bin, to_bin
from fixtures.mutations import copy_checkpoint
from harness.mutations import GateCase
from preload.identity.digest import checkpoint_digest, hash_file, hash_shards
from preload.identity.shards import shard_paths

# Files besides the weights that decide what an engine computes.
_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja")


def weight_files(ckpt: str | os.PathLike[str]) -> list[Path]:
    return [bin_path(ckpt)] if is_bin(ckpt) else shard_paths(ckpt)


def file_digest(ckpt: str | os.PathLike[str]) -> str:
    if is_bin(ckpt):
        return checkpoint_digest({BIN_NAME: hash_file(bin_path(ckpt))})
    return checkpoint_digest(hash_shards(shard_paths(ckpt), progress=False))


def values_digest(ckpt: str | os.PathLike[str], dtype: str = "bfloat16") -> str:
    import torch

    target = getattr(torch, dtype)
    h = hashlib.sha256()
    root = Path(ckpt)
    for name in _SIDE_FILES:
        p = root / name
        if p.is_file():
            h.update(f"{name}\0".encode() + hashlib.sha256(p.read_bytes()).digest())
    state: dict[str, torch.Tensor] = {}
    if is_bin(root):
        state = torch.load(bin_path(root), map_location="cpu", weights_only=True)
    else:
        from safetensors.torch import load_file

        for p in shard_paths(root):
            state.update(load_file(str(p)))
    for name in sorted(state):
        t = state[name]
        t = (t.to(target) if t.is_floating_point() else t).contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def stage_base(base: str | os.PathLike[str], fmt: str, dest: Path) -> Path:
    """A private copy of ``base`` in ``fmt`` (a target may write into it: npcache does)."""
    out = copy_checkpoint(base, dest)
    if fmt == "bin" and not is_bin(out):
        to_bin(out)
    return out


def make_candidate(case: GateCase, staged_base: Path, workdir: Path, fmt: str) -> Path:
    """The case's candidate, derived from the staged base in the target's format.

    Everything in the base directory travels with a copy (as ``cp -a`` does),
    derived caches included; an in-place row rewrites a private copy.
    """
    if case.recipe is None:
        return staged_base
    row = case.recipe
    staged = row.stage(staged_base, workdir / "stage")
    target = staged if row.in_place else copy_checkpoint(staged, workdir / "cand" / row.name)
    transform = bin_transform(row.transform) if fmt == "bin" else row.transform
    transform(target)
    return target
