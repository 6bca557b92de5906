"""The promotion manifest and the restart identity check.

``promote`` hashes a checkpoint once and writes a manifest (per shard: name,
size, sha256 and the stat fields ``size, mtime_ns, ctime_ns, ino, dev``) into
a cache directory, keyed by the checkpoint's real path: model stores are
often read-only, and a manifest inside the checkpoint could be copied along
with different weights.

At restart the digest is resolved in one of three modes:

- ``stat`` (default): list the directory and stat every shard (no shard is
  opened). Any difference from the manifest means it is stale; the content
  is then re-hashed (``on_stale="rehash"``) or the cache is refused
  (``on_stale="refuse"``). A stale manifest is never trusted. ``ctime``
  cannot be set from user space, so an edit that restores ``mtime`` is seen.
- ``pinned``: the operator passes the digest printed at promotion; no
  checkpoint I/O at all. The daemon still proves its bytes hash to it.
- ``full``: re-hash every byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from preload import _atomic
from preload.errors import CheckpointError, ManifestError
from preload.identity.digest import checkpoint_digest, hash_shards
from preload.identity.shards import INDEX_NAME, read_header, shard_paths

MANIFEST_VERSION = 1
MODES = ("stat", "pinned", "full")


@dataclass(frozen=True)
class FileStat:
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    dev: int

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> FileStat:
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


@dataclass(frozen=True)
class ShardRecord:
    name: str
    size: int
    sha256: str
    stat: FileStat
    tensor_digests: dict[str, str] | None = None


@dataclass(frozen=True)
class Manifest:
    checkpoint: str
    digest: str
    config_digest: str | None
    shards: tuple[ShardRecord, ...]
    index_stat: FileStat | None
    created: float = field(default_factory=time.time)
    version: int = MANIFEST_VERSION

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> Manifest:
        try:
            if obj["version"] != MANIFEST_VERSION:
                raise ManifestError(f"manifest version {obj['version']} is not {MANIFEST_VERSION}")
            shards = tuple(
                ShardRecord(
                    name=s["name"],
                    size=s["size"],
                    sha256=s["sha256"],
                    stat=FileStat(**s["stat"]),
                    tensor_digests=s.get("tensor_digests"),
                )
                for s in obj["shards"]
            )
            index = obj.get("index_stat")
            return cls(
                checkpoint=obj["checkpoint"],
                digest=obj["digest"],
                config_digest=obj.get("config_digest"),
                shards=shards,
                index_stat=FileStat(**index) if index else None,
                created=obj.get("created", 0.0),
                version=obj["version"],
            )
        except (KeyError, TypeError) as exc:
            raise ManifestError(f"malformed manifest: {exc}") from exc


def default_cache_dir() -> Path:
    env = os.environ.get("PRELOAD_GATE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "preload-gate"


def manifest_path(checkpoint: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    real = os.path.realpath(checkpoint)
    key = hashlib.sha256(real.encode()).hexdigest()
    return Path(cache_dir or default_cache_dir()) / "manifests" / f"{key}.json"


def config_digest(checkpoint: str | os.PathLike[str]) -> str | None:
    """SHA-256 of ``config.json`` in canonical form (sorted keys, no spaces)."""
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"config.json is not readable JSON: {exc}") from exc
    canon = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode()).hexdigest()


def build_manifest(
    checkpoint: str | os.PathLike[str],
    workers: int | None = None,
    progress: bool | None = None,
) -> Manifest:
    """Validate every header, hash every shard, and record what was hashed.

    The stat of each shard is taken before and after hashing; a shard that
    changed while it was read is an error, not a manifest.
    """
    ckpt = Path(checkpoint)
    paths = shard_paths(ckpt)
    for p in paths:
        if p.stat().st_size == 0:
            raise CheckpointError("shard is empty", p.name)
        read_header(p)
    before = {p.name: FileStat.of(p) for p in paths}
    digests = hash_shards(paths, workers=workers, progress=progress)
    records = []
    for p in paths:
        after = FileStat.of(p)
        if after != before[p.name]:
            raise CheckpointError("shard changed while it was being hashed; promote again", p.name)
        records.append(ShardRecord(p.name, after.size, digests[p.name], after))
    index = ckpt / INDEX_NAME
    return Manifest(
        checkpoint=os.path.realpath(ckpt),
        digest=checkpoint_digest(digests),
        config_digest=config_digest(ckpt),
        shards=tuple(records),
        index_stat=FileStat.of(index) if index.is_file() else None,
    )


def write_manifest(manifest: Manifest, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    path = manifest_path(manifest.checkpoint, cache_dir)
    _atomic.write_json(path, manifest.to_json())
    return path


def load_manifest(
    checkpoint: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None
) -> Manifest | None:
    path = manifest_path(checkpoint, cache_dir)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ManifestError(f"unreadable manifest {path}: {exc}") from exc
    return Manifest.from_json(obj)


@dataclass(frozen=True)
class Resolution:
    """The outcome of a restart identity check."""

    digest: str
    mode: str
    # "manifest" (stat matched), "pinned", "rehashed" (full, or a stale or
    # missing manifest in stat mode).
    source: str
    stale_reason: str | None = None


def stale_reason(checkpoint: str | os.PathLike[str], manifest: Manifest) -> str | None:
    """Why ``manifest`` no longer describes the checkpoint, or None if it does.

    Costs one directory listing and one stat per shard (and of the index);
    no shard file is opened.
    """
    ckpt = Path(checkpoint)
    index = ckpt / INDEX_NAME
    try:
        index_now = FileStat.of(index)
    except FileNotFoundError:
        index_now = None
    if index_now != manifest.index_stat:
        return f"{INDEX_NAME} changed"
    names = {r.name for r in manifest.shards}
    if manifest.index_stat is None:
        try:
            present = {e.name for e in os.scandir(ckpt) if e.name.endswith(".safetensors")}
        except OSError as exc:
            return f"cannot list checkpoint: {exc}"
        if present != names:
            added, removed = sorted(present - names), sorted(names - present)
            return f"shard set changed (added {added}, removed {removed})"
    for rec in manifest.shards:
        try:
            now = FileStat.of(ckpt / rec.name)
        except OSError:
            return f"{rec.name} is missing"
        if now != rec.stat:
            diff = [f for f in ("size", "mtime_ns", "ctime_ns", "ino", "dev")
                    if getattr(now, f) != getattr(rec.stat, f)]
            return f"{rec.name} changed ({', '.join(diff)})"
    return None


def resolve_digest(
    checkpoint: str | os.PathLike[str],
    mode: str = "stat",
    expected_digest: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    on_stale: str = "rehash",
) -> Resolution:
    """The content digest of ``checkpoint`` as a restarting engine sees it.

    >>> resolve_digest("/models/smollm2", mode="pinned", expected_digest="ab" * 32).source  # doctest: +SKIP
    'pinned'
    """
    if mode not in MODES:
        raise ValueError(f"identity mode {mode!r} is not one of {', '.join(MODES)}")
    if mode == "pinned":
        if not expected_digest or len(expected_digest) != 64:
            raise ManifestError("identity mode 'pinned' needs expected_digest (64 hex chars from promote)")
        return Resolution(expected_digest.lower(), mode, "pinned")
    if mode == "stat":
        manifest = load_manifest(checkpoint, cache_dir)
        reason = "no manifest (run: preload-gate promote CKPT)" if manifest is None else stale_reason(checkpoint, manifest)
        if manifest is not None and reason is None:
            return Resolution(manifest.digest, mode, "manifest")
        if on_stale == "refuse":
            raise ManifestError(f"manifest for {checkpoint} is stale: {reason}")
        fresh = build_manifest(checkpoint, progress=False)
        write_manifest(fresh, cache_dir)
        return Resolution(fresh.digest, mode, "rehashed", reason)
    digests = hash_shards(shard_paths(checkpoint), progress=False)
    return Resolution(checkpoint_digest(digests), mode, "rehashed")
