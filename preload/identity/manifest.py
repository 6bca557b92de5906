"""The promotion manifest and the restart identity check.

``promote`` hashes a checkpoint once and writes a manifest (per shard: name,
size, sha256 and the stat fields ``size, mtime_ns, ctime_ns, ino, dev``) into
a cache directory, keyed by the checkpoint's real path: model stores are
often read-only, and a manifest inside the checkpoint could be copied along
with different weights.

At restart the digest is resolved in one of three modes:

- ``stat`` (default): stat the checkpoint directory, the index vLLM
  consults and every shard, all at once (one worker thread per stat, so
  the cost is one round trip, not one per shard:
  :func:`preload.identity.filestat.stat_all`); no
  file is opened. Any difference from the manifest means it is stale, and a stale or missing manifest is a
  :class:`StaleManifestError` naming what changed and the command to run:
  an engine never re-hashes the checkpoint or rewrites the manifest, since
  re-promotion is an operator's act. The directory's own stat changes when
  a file is added, removed or renamed, which is how a change of vLLM's file
  set (a new ``consolidated.safetensors``) is seen without listing it (only
  a changed folder is listed, and diffed with the listing promote recorded,
  so every change is named: :mod:`preload.identity.entries`).
  ``ctime`` cannot be set from user space, so an edit that restores
  ``mtime`` is seen.
- ``pinned``: the operator passes the digest printed at promotion; no
  checkpoint I/O at all. The daemon still proves its bytes hash to it.
- ``full``: re-hash every byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from pgbase import atomic
from pgbase.digest_text import parse_digest
from pgbase.errors import CheckpointError, DigestFormatError, ManifestError
from pgbase.fileset import select_files, servable
from pgbase.oscause import describe
from pgbase.shards import INDEX_NAME, check_unique_tensors, not_a_directory, read_header
from preload import trust
from preload.identity.config import config_digest
from preload.identity.digest import Progress, checkpoint_digest, content_digest, hash_shards
from preload.identity.entries import TOP, WEIGHT_SUFFIXES, folder_changes, tree_entries
from preload.identity.filestat import (
    STAT_BLIND_FILESYSTEMS,
    FileStat,
    filesystem_type_of_dev,
    stat_all,
    subdir_stats,
)

MANIFEST_VERSION = 2
MODES = ("stat", "pinned", "full")  # the restart check's modes, named once (loader, CLI, anchors)


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
    # The directory's own stat (entries added, removed, renamed), the index
    # vLLM consults for this file set, and who picked the files.
    dir_stat: FileStat | None = None
    # Every folder below it, by relative path: vLLM's `auto` switches to the
    # mistral file set when a consolidated*.safetensors exists at ANY depth
    # (vllm.transformers_utils.repo_utils.list_repo_files: rglob("*")), and a
    # file added to a folder changes only that folder's stat. None: a
    # manifest from before they were recorded (stale by construction).
    subdir_stats: dict[str, FileStat] | None = None
    # Each folder's entries at promotion (name -> inode; "." the top): a
    # changed folder is diffed against them, so the miss names every entry
    # added, removed, renamed or replaced. None: a manifest from before they
    # were recorded (its shards and index are then all that is named).
    entries: dict[str, dict[str, int]] | None = None
    index_file: str = INDEX_NAME
    selection: str = ""
    created: float = field(default_factory=time.time)
    version: int = MANIFEST_VERSION

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any, source: str = "manifest") -> Manifest:
        """Parse a manifest read from ``source`` (its path, for the message).

        Another version is a :class:`StaleManifestError` (re-promote); a
        wrong shape is a :class:`ManifestError` naming ``source``, msgspec's
        path to the field (``$.shards[0].stat.ino``) and the command to run.
        """
        checkpoint = obj.get("checkpoint") if isinstance(obj, dict) else None
        try:
            # The version first: an older manifest may lack fields this one requires.
            version = msgspec.convert(obj, _Versioned).version
            if version != MANIFEST_VERSION:
                raise StaleManifestError(
                    f"{source} has version {version!r}, not {MANIFEST_VERSION}; run: {promote_command(checkpoint)}")
            manifest = msgspec.convert(obj, cls)
        except msgspec.ValidationError as exc:
            raise ManifestError(
                f"{source} is malformed ({exc}); run: {promote_command(checkpoint)}") from exc
        manifest = _read_digests(manifest, source)
        # The digest an engine trusts is the one its own shard list implies: an
        # edited "digest" (another checkpoint's, or no digest at all) is refused.
        implied = checkpoint_digest({r.name: r.sha256 for r in manifest.shards})
        if manifest.digest != implied:
            raise ManifestError(
                f"{source} is malformed (its digest {str(manifest.digest)[:16]} is not the one its shard list "
                f"implies, {implied[:16]}); run: {promote_command(manifest.checkpoint)}")
        return manifest


class _Versioned(msgspec.Struct):
    version: Any


def _read_digests(m: Manifest, source: str) -> Manifest:
    """``m`` with every digest it holds read by :func:`parse_digest` (lower case)."""
    where = f"{source} is malformed:"
    try:
        shards = tuple(replace(r, sha256=parse_digest(r.sha256, f"{where} shard {r.name}'s sha256")) for r in m.shards)
        config = None if m.config_digest is None else parse_digest(m.config_digest, f"{where} config_digest")
        digest = parse_digest(m.digest, f"{where} digest")
    except DigestFormatError as exc:
        raise ManifestError(f"{exc}; run: {promote_command(m.checkpoint)}") from exc
    return replace(m, shards=shards, config_digest=config, digest=digest)


def default_cache_dir(env: bool = True) -> Path:
    """``$PRELOAD_GATE_CACHE`` (``env``), else ``$XDG_CACHE_HOME/preload-gate``, else ``~/.cache/preload-gate``."""
    if env and os.environ.get("PRELOAD_GATE_CACHE"):
        return Path(os.environ["PRELOAD_GATE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "preload-gate"


def promote_command(checkpoint: object, cache_dir: str | os.PathLike[str] | None = None,
                    verb: str = "promote") -> str:
    """The command that re-promotes ``checkpoint`` into the cache its engines read (``verb``: or runs
    another verb on it against that cache): absolute, quoted, with ``--cache-dir`` unless that cache is the
    plain default (an operator's shell may not set PRELOAD_GATE_CACHE).

    A promote writes: into a cache it cannot write (model stores and their
    caches are often mounted read-only, :func:`cache_unwritable`) the command
    would only fail, so it names a writable cache of this user's instead (the
    default, or the one PRELOAD_GATE_CACHE names; else ``DIR``), says why, and
    how the engines then read it.

    >>> promote_command("/m/a b")  # doctest: +SKIP
    "preload-gate promote '/m/a b'"
    """
    cache = Path(cache_dir or default_cache_dir())
    ckpt = shlex.quote(os.path.abspath(checkpoint)) if isinstance(checkpoint, str | Path) else "CKPT"
    instead = cache_instead(cache) if verb == "promote" else None
    if instead is not None:
        why, other = instead
        to = shlex.quote(os.path.abspath(other)) if other is not None else "DIR"
        mine = "" if other is not None else "; DIR: a writable directory of yours"
        return (f"preload-gate {verb} {ckpt} --cache-dir {to} (the cache {os.path.abspath(cache)} {why}{mine}; "
                f"engines read {'it' if other is None else 'the new one'} with PRELOAD_GATE_CACHE={to})")
    where = "" if cache == default_cache_dir(env=False) else f" --cache-dir {shlex.quote(os.path.abspath(cache))}"
    return f"preload-gate {verb} {ckpt}{where}"


def cache_instead(cache_dir: str | os.PathLike[str]) -> tuple[str, Path | None] | None:
    """None when a manifest can be written into ``cache_dir``; else why not
    (:func:`cache_unwritable`) and the writable cache of this user's that a
    promote goes to instead (the one PRELOAD_GATE_CACHE names, or the plain
    default; None when neither can be written)."""
    why = cache_unwritable(cache_dir)
    if why is None:
        return None
    other = next((Path(c) for c in (default_cache_dir(), default_cache_dir(env=False))
                  if os.path.abspath(c) != os.path.abspath(cache_dir) and cache_unwritable(c) is None), None)
    return why, other


def cache_unwritable(cache_dir: str | os.PathLike[str]) -> str | None:
    """Why a manifest cannot be written into ``cache_dir`` (its ``manifests``
    directory, or the nearest existing directory it would be made in), by
    stat and access(2) alone, nothing written: the words follow
    ``the cache DIR``. None: it can be, as far as these say (root passes
    access(2) on any permission bits, never on a read-only mount).

    The one rule for promote's preflight (:func:`preload.preflight.check_cache_dir`)
    and for every promote command a message prints (:func:`promote_command`).
    """
    mdir = Path(cache_dir) / "manifests"
    probe = mdir
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"cannot be created: {probe} is not a directory"
    # Read-only first: access(2) says EROFS as "not writable", and the mount is what to name.
    try:
        st = os.statvfs(probe)
    except OSError:
        st = None
    if st is not None and st.f_flag & os.ST_RDONLY:
        return "is on a read-only filesystem"
    if not os.access(probe, os.W_OK | os.X_OK):
        return "is not writable" if probe == mdir else f"is not writable (its nearest existing parent {probe})"
    return None


def manifest_path(checkpoint: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None,
                  resolve: bool = True) -> Path:
    """Where the manifest of ``checkpoint`` lives: keyed by its real path
    (``resolve=False``: by the absolute path as given, no I/O)."""
    real = os.path.realpath(checkpoint) if resolve else os.path.abspath(checkpoint)
    key = hashlib.sha256(os.fsencode(real)).hexdigest()  # any bytes a path can hold
    return Path(cache_dir or default_cache_dir()) / "manifests" / f"{key}.json"


def build_manifest(
    checkpoint: str | os.PathLike[str],
    workers: int | None = None,
    progress: Progress = None,
) -> Manifest:
    """Validate every header, hash every shard, and record what was hashed.

    The shard set is vLLM's own selection (:mod:`pgbase.fileset`).
    The stat of each shard and of the directory is taken before and after
    hashing; a change while reading is an error, not a manifest.
    """
    ckpt = Path(checkpoint)
    if not ckpt.is_dir():
        raise CheckpointError(not_a_directory(ckpt))
    dir_before = FileStat.of(ckpt)
    subdirs_before = subdir_stats(ckpt)
    entries = tree_entries(ckpt, subdirs_before)
    fs = servable(select_files(ckpt))
    paths = fs.paths
    headers = []
    for p in paths:
        if p.stat().st_size == 0:
            raise CheckpointError("shard is empty", p.name)
        headers.append(read_header(p))
    check_unique_tensors(headers)
    # A dtype safetensors knows and torch has no type for cannot be served by
    # any stage: refused here, before the first weight byte is hashed.
    # (Imported here: it imports torch, which preload.identity does not need.)
    from pgbase.dtypes import check_header

    for h in headers:
        check_header(h)
    before = {p.name: FileStat.of(p) for p in paths}
    digests = hash_shards(paths, workers=workers, progress=progress)
    records = []
    for p in paths:
        after = FileStat.of(p)
        if after != before[p.name]:
            raise CheckpointError("shard changed while it was being hashed; promote again", p.name)
        records.append(ShardRecord(p.name, after.size, digests[p.name], after))
    if FileStat.of(ckpt) != dir_before or subdir_stats(ckpt) != subdirs_before:
        raise CheckpointError(f"files were added, removed or renamed in {ckpt} while it was hashed; promote again")
    index = ckpt / fs.index_file
    return Manifest(
        checkpoint=os.path.realpath(ckpt),
        digest=checkpoint_digest(digests),
        config_digest=config_digest(ckpt),
        shards=tuple(records),
        index_stat=FileStat.of(index) if index.is_file() else None,
        dir_stat=dir_before,
        subdir_stats=subdirs_before,
        entries=entries,
        index_file=fs.index_file,
        selection=fs.source,
    )


def write_manifest(manifest: Manifest, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    path = manifest_path(manifest.checkpoint, cache_dir)
    trust.prepare_manifest_dir(path.parent)
    atomic.write_json(path, manifest.to_json(), mode=0o600)
    return path


def load_manifest(
    checkpoint: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None
) -> Manifest | None:
    # The path as given first: resolving it costs an lstat, a round trip on
    # remote storage. A hit is safe: the directory's stat (dev, ino) in the
    # manifest is checked through that same path, so a path that now leads
    # elsewhere reads as stale. A symlinked path falls back to the real one.
    for resolve in (False, True):
        path = manifest_path(checkpoint, cache_dir, resolve=resolve)
        if not os.path.lexists(path):
            continue
        # Whoever can write a manifest decides which daemon an engine attaches to.
        trust.verify_private_file(path, "manifest")
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise ManifestError(f"unreadable manifest {path}: {describe(exc, path)}") from exc
        except ValueError as exc:
            raise ManifestError(f"unreadable manifest {path}: {exc}") from exc
        return Manifest.from_json(obj, source=f"manifest {path}")
    return None


@dataclass(frozen=True)
class Resolution:
    """The outcome of a restart identity check."""

    digest: str
    mode: str
    source: str  # "manifest" (stat matched), "pinned", "rehashed" (full)
    stale_reason: str | None = None


class StaleManifestError(ManifestError):
    """The promotion manifest is missing or no longer describes the checkpoint.

    ``shard`` names the file that changed or went missing (None: the manifest
    is missing, or entries other than its shards changed). Never repaired by
    an engine: re-promotion is an operator's act, so the message carries the
    command.
    """

    def __init__(self, message: str, shard: str | None = None) -> None:
        self.shard = shard
        super().__init__(message)


class StatBlindError(StaleManifestError):
    """Stats cannot vouch for a checkpoint on a stat-blind filesystem (tmpfs):
    no promotion fixes that, so the message names pinned and full, not promote."""


def restart_targets(checkpoint: str | os.PathLike[str], manifest: Manifest) -> list[str]:
    """The paths the restart check stats, in the order :func:`stale_reason`
    reads them back: the directory, the index, every shard, every folder below."""
    # str joins, not Path ones: at 1,000 shards the Path objects alone took
    # ~15 ms, a third of a 50 ms round trip, on a 2-core box.
    base, join = os.fspath(checkpoint), os.path.join
    return ([base, join(base, manifest.index_file)] + [join(base, r.name) for r in manifest.shards]
            + [join(base, d) for d in sorted(manifest.subdir_stats or ())])


def stale_reason(checkpoint: str | os.PathLike[str], manifest: Manifest,
                 stat_blind_ok: bool = False,
                 stats: list[FileStat | OSError] | None = None) -> tuple[str, str | None] | None:
    """Why ``manifest`` no longer describes the checkpoint, as ``(reason,
    shard)``, or None if it does.

    One concurrent round of stats (directory, every folder below it, index,
    every shard); no checkpoint file is opened, and only a changed folder
    is listed, so that ``reason`` names every entry added, removed, renamed
    or replaced (:mod:`preload.identity.entries`), every shard changed and
    the index; ``shard`` is the first shard (or index) named. The filesystem type
    of the directory's device comes from /proc/self/mountinfo: on a
    stat-blind one (``STAT_BLIND_FILESYSTEMS``) the manifest cannot be
    trusted by stats (:class:`StatBlindError`), unless ``stat_blind_ok``
    (the daemon, which proves every byte it serves, compares them anyway).
    ``stats``: those of :func:`restart_targets`, already taken (``status``
    takes every daemon's folder's in one :func:`stat_all`, one round trip).
    """
    ckpt = Path(checkpoint)
    if manifest.dir_stat is None:
        return "the manifest predates directory stats", None
    if manifest.subdir_stats is None:
        return "the manifest predates subfolder stats", None
    subdirs = sorted(manifest.subdir_stats)
    n_shards = len(manifest.shards)
    base = os.fspath(ckpt)
    now = stats if stats is not None else stat_all(restart_targets(ckpt, manifest))
    d = now[0]
    if isinstance(d, OSError):
        return f"cannot stat the checkpoint directory: {d}", None
    # Asked of the stat just taken (its device), so it costs no round trip.
    fstype = filesystem_type_of_dev(d.dev)
    if fstype in STAT_BLIND_FILESYSTEMS and not stat_blind_ok:
        raise StatBlindError(
            f"identity 'stat' cannot vouch for {ckpt}: it is on {fstype}, where a write through mmap changes no "
            "stat field, so stats cannot prove the bytes are the promoted ones; use identity 'pinned' "
            "(expected_digest: the digest promote printed) or 'full'")
    shard_stats = now[2:2 + n_shards]
    shard_names = {r.name for r in manifest.shards}
    # What a manifest without listings still knows of its folder, by inode.
    known = {r.name: r.stat.ino for r in manifest.shards} | (
        {manifest.index_file: manifest.index_stat.ino} if manifest.index_stat else {})
    folder_level = False
    found: list[tuple[str, str]] = []  # (the entry's name, what happened to it)
    if d != manifest.dir_stat:
        folder_level = True
        found += folder_changes(base, TOP, manifest.entries, known, shard_names) or [
            ("", f"the checkpoint directory's {d.changed_fields(manifest.dir_stat)} changed, though its entries "
                 "are the promoted ones (an entry added and removed again)")]
    told = {n for n, _ in found}
    idx = now[1]
    idx_now = None if isinstance(idx, OSError) else idx
    if idx_now != manifest.index_stat and manifest.index_file not in told:
        what = ("removed" if idx_now is None else "added" if manifest.index_stat is None
                else f"changed ({idx_now.changed_fields(manifest.index_stat)})")
        found.append((manifest.index_file, f"{manifest.index_file} {what}"))
    for rec, st in zip(manifest.shards, shard_stats, strict=True):
        if rec.name in told:
            continue
        if isinstance(st, OSError):
            found.append((rec.name, f"shard {rec.name} is missing ({st.strerror or st})"))
        elif st != rec.stat:
            found.append((rec.name, f"shard {rec.name} changed ({st.changed_fields(rec.stat)})"))
    for sub, st in zip(subdirs, now[2 + n_shards:], strict=True):
        if not isinstance(st, OSError) and st == manifest.subdir_stats[sub]:
            continue
        folder_level = True
        if isinstance(st, OSError):
            if f"{sub}/" not in {n for n, _ in found}:  # else its parent's listing named it
                found.append((sub, f"folder {sub}/ is gone ({st.strerror or st})"))
            continue
        found += folder_changes(base, sub, manifest.entries, known, shard_names) or [
            (sub, f"files were added, removed or renamed under {sub}/ (a consolidated*.safetensors at any "
                  "depth switches vLLM's file set)")]
    if not found:
        return None
    shard = next((n for n, _ in found if n in shard_names or n == manifest.index_file), None)
    reason = "; ".join(w for _, w in found)
    # Where what changed can change which files vLLM reads, say so: a weight
    # file, the index, a folder (vLLM's mistral switch looks at any depth).
    if folder_level and any(n == "" or n == manifest.index_file or n.endswith(("/", *WEIGHT_SUFFIXES))
                            or n in subdirs for n, _ in found):
        reason += ", so vLLM's file set may differ"
    return reason, shard


def check_fresh(checkpoint: str | os.PathLike[str], manifest: Manifest | None,
                cache_dir: str | os.PathLike[str] | None = None, stat_blind_ok: bool = False) -> Manifest:
    """``manifest`` if it still describes ``checkpoint`` (:func:`stale_reason`),
    else the :class:`StaleManifestError` an engine's ``stat`` check raises; the
    one message both the engine and ``preload`` (and its ``--dry-run``) print."""
    if manifest is None:
        raise StaleManifestError(_no_manifest(checkpoint, Path(cache_dir or default_cache_dir())))
    found = stale_reason(checkpoint, manifest, stat_blind_ok)
    if found is not None:
        raise StaleManifestError(
            f"the promotion manifest for {checkpoint} is stale: {found[0]}; engines do not re-hash: "
            f"run: {promote_command(checkpoint, cache_dir)}", found[1])
    return manifest


def _no_manifest(checkpoint: str | os.PathLike[str], cache: Path) -> str:
    """The missing-manifest line: which cache was asked and why it was that one,
    and, where the other cache this user has (the default, or the one
    PRELOAD_GATE_CACHE names) holds a manifest for it, how to use that one.
    Only asked on this miss path (one lstat)."""
    chosen = "PRELOAD_GATE_CACHE names it" if os.environ.get("PRELOAD_GATE_CACHE") else "the default"
    where = f"in the cache {cache} ({chosen}; looked for {manifest_path(checkpoint, cache)})"
    for other in (default_cache_dir(), default_cache_dir(env=False)):
        if other != cache and os.path.lexists(manifest_path(checkpoint, other)):
            use = (f"no promotion manifest for {checkpoint} {where}, but the cache {other} holds one: use that "
                   f"cache (PRELOAD_GATE_CACHE={shlex.quote(str(other))} for engines and verbs, or --cache-dir "
                   "for verbs)")
            why = cache_unwritable(cache)
            if why is not None:  # nothing can be promoted into this one
                return f"{use}; this one {why}"
            return f"{use}, or promote into this one: run: {promote_command(checkpoint, cache)}"
    return (f"no promotion manifest for {checkpoint} {where}; promoted into another cache? give that one as "
            f"PRELOAD_GATE_CACHE=DIR; else run: {promote_command(checkpoint, cache)}")


def resolve_digest(
    checkpoint: str | os.PathLike[str],
    mode: str = "stat",
    expected_digest: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Resolution:
    """The content digest of ``checkpoint`` as a restarting engine sees it.

    ``stat`` raises :class:`StaleManifestError` for a missing or stale
    manifest; it never hashes the checkpoint and never writes a manifest.
    ``pinned`` reads ``expected_digest`` by :func:`parse_digest` (either
    case, returned lower case; anything but 64 hex is a DigestFormatError).

    >>> resolve_digest("/models/smollm2", mode="pinned", expected_digest="ab" * 32).source  # doctest: +SKIP
    'pinned'
    """
    if mode not in MODES:
        raise ValueError(f"identity mode {mode!r} is not one of {', '.join(MODES)}")
    if mode == "pinned":
        if expected_digest is None:
            raise ManifestError("identity mode 'pinned' needs expected_digest (the digest promote prints)")
        return Resolution(parse_digest(expected_digest, "expected_digest (identity 'pinned')"), mode, "pinned")
    if mode == "stat":
        manifest = check_fresh(checkpoint, load_manifest(checkpoint, cache_dir), cache_dir)
        return Resolution(manifest.digest, mode, "manifest")
    return Resolution(content_digest(checkpoint), mode, "rehashed")
