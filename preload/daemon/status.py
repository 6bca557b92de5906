"""What ``preload-gate status`` reports: one record per rank socket, checked against the disk.

Each rank that answers is asked for ``stats`` (identity, key, counters) and
its folder is put to the engines' own restart check
(:func:`preload.identity.manifest.stale_reason` against the manifest in the
cache the rank read): every daemon's folder in one :func:`stat_all`, one
round trip. config.json is no shard (an edit in place moves no stat the
manifest holds), so it is read once per folder and the key's folder fields
recomputed from it by the key's own functions: an engine would miss on
them. So ``status`` says what an engine started on that folder would
find: this daemon (``fresh``), a miss (``stale``: the folder changed, has
no manifest, or was promoted again), another daemon (``superseded``), or
that it cannot tell (``unknown``), with the command that fixes it.

:class:`DaemonRecord` is the one per-rank record: ``--json`` is it encoded
as it is (every field present, null where it does not apply; the shape is
documented in docs/daemon.md), and :func:`render` prints it. A new field is
a line in the record and, to show it, one in :func:`render`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Literal

import msgspec

from pgbase.digest_text import short_digest
from pgbase.errors import PreloadGateError
from preload.daemon.status_fix import Fixes, fixes_for, launcher_command
from preload.daemon.status_store import StoredRecord, StoreState, scan_store, store_lines
from preload.daemon.status_text import _key_text, _last_failure, origin_line

__all__ = ["DaemonRecord", "DiskCheck", "StatusReport", "StoreState", "StoredRecord", "check_disk", "render",
           "scan", "scan_store", "store_lines"]
from preload.identity.key import WeightCacheKey

FORMAT = "preload-gate-status/1"


class DiskCheck(msgspec.Struct):
    """The folder a daemon serves, as an engine's ``stat`` restart check
    sees it now. ``fix``: the command to run; ``manifest_digest``: what the
    manifest names (None without one); ``shard`` and ``fields``: the file
    that changed and its stat fields that differ."""

    state: Literal["fresh", "stale", "superseded", "unknown"]
    # Why stale: the folder changed since promotion, it has no manifest (or one
    # of another version), it was promoted again as other content, or its
    # config.json no longer gives the daemon's key (shard "config.json").
    cause: Literal["changed", "no_manifest", "promoted_again", "config", ""] = ""
    reason: str = ""
    shard: str | None = None
    fields: str = ""
    manifest_digest: str | None = None
    manifest: str | None = None
    fix: str = ""


class DaemonRecord(msgspec.Struct, kw_only=True):
    """One rank socket: where it is, whether and how it answers, what it holds,
    what it counted (:mod:`preload.daemon.counters`) and its disk check."""

    socket: str
    socket_root: str
    serving: bool
    # Nothing serves: what stands there, or who holds the rank's lock; or it answered and refused us.
    not_a_socket: str | None = None
    lock_holder: str | None = None  # the pid its lock file names ("unknown" when empty)
    refused: str | None = None
    busy: str | None = None  # a daemon listens, its backlog full for the connect timeout: alive, not stale
    # A serving rank: identity and what it holds.
    pid: int | None = None
    rank: int | None = None
    daemon_id: str | None = None
    digest: str | None = None
    checkpoint: str | None = None
    key: dict[str, Any] | None = None
    stage: str | None = None
    transport: str | None = None
    gpu_uuid: str | None = None
    resident_bytes: int = 0
    tensors: int = 0
    released: bool = False
    load_seconds: float = 0.0
    uptime_s: float = 0.0
    # Where its arena came from (issue 26/39): disk or adopted, how many daemons held it before, a take-over's
    # predecessor ({pid, daemon_id}).
    origin: str | None = None
    generation: int = 0
    took_over_from: dict[str, Any] | None = None
    cache_dir: str | None = None
    launcher_pid: int | None = None
    command: str | None = None
    # The command's port flags this daemon still holds: its fix stops it first.
    ports_held: list[str] = msgspec.field(default_factory=list)
    # Engines: watching now, attaches confirmed / failed / in progress, misses by reason.
    attached: int = 0
    hits: int = 0
    served: int = 0
    attach_failures: dict[str, int] = msgspec.field(default_factory=dict)
    attaching: int = 0
    last_attach_failure: dict[str, Any] | None = None
    misses: dict[str, int] = msgspec.field(default_factory=dict)
    requests: int = 0
    bad_frames: int = 0
    disk: DiskCheck | None = None


class StatusReport(msgspec.Struct):
    """``status --json``: every rank found (``ranks``), serving daemons under
    roots engines do not look in (``elsewhere``), registry entries refused,
    and what the fd store of each root keeps (``stores``, ``stored``)."""

    socket_root: str
    socket_roots: list[str]
    registry: str
    ranks: list[DaemonRecord]
    elsewhere: list[DaemonRecord]
    refused: list[dict[str, str]]
    format: str = FORMAT
    stores: list[StoreState] = msgspec.field(default_factory=list)
    stored: list[StoredRecord] = msgspec.field(default_factory=list)


def scan(root: str | os.PathLike[str] | None) -> list[DaemonRecord]:
    """Every rank socket under the socket root (dirs ``<digest[:16]>``), answering or not."""
    from preload.daemon.health import ask_rank
    from preload.daemon.lock import lock_holder
    from preload.sockets import default_socket_root

    base = Path(root or default_socket_root())
    found: list[DaemonRecord] = []
    if not base.is_dir():
        return found
    for d in sorted(base.iterdir()):
        if d.is_symlink() or not d.is_dir():
            continue
        for sock in sorted(d.glob("rank*.sock")):
            reply = ask_rank(sock)
            answer = reply.stats
            if answer is not None:
                record = msgspec.convert({**answer, "socket": str(sock), "socket_root": str(base), "serving": True},
                                         DaemonRecord)
                record.command, record.ports_held = launcher_command(record)
                found.append(record)
                continue
            # Stale only when nothing answers AND no live process holds the lock.
            found.append(DaemonRecord(socket=str(sock), socket_root=str(base), serving=False, refused=reply.refused,
                                      busy=reply.busy,
                                      not_a_socket=_not_a_socket(sock),
                                      lock_holder=lock_holder(d, int(sock.stem.removeprefix("rank")))))
    return found


def _not_a_socket(path: Path) -> str | None:
    """What stands at a rank's socket path when it is not a socket ("a
    regular file", "a symlink", ...); None for a socket or nothing."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    return "a symlink" if stat.S_ISLNK(mode) else "a regular file" if stat.S_ISREG(mode) else "a non-socket file"


def check_disk(records: list[DaemonRecord]) -> None:
    """Set ``disk`` on every serving record: the engines' restart check of its
    folder against the manifest in the cache it read, every folder's stats
    taken in one :func:`stat_all` (one round trip)."""
    from preload.identity.filestat import stat_all
    from preload.identity.manifest import (
        Manifest,
        StaleManifestError,
        load_manifest,
        manifest_path,
        restart_targets,
    )

    serving = [r for r in records if r.serving and r.checkpoint]
    # config.json, read once per folder: the key's folder-derived fields (no stat sees an edit of it).
    configs = {str(r.checkpoint): _folder_config(str(r.checkpoint)) for r in serving}
    manifests: dict[tuple[str, str | None], Manifest | DiskCheck | None] = {}
    for r in serving:
        where = (str(r.checkpoint), r.cache_dir)
        if where not in manifests:
            try:
                manifests[where] = load_manifest(*where)
            except StaleManifestError as exc:  # of another version: engines refuse it too
                manifests[where] = DiskCheck("stale", "no_manifest", reason=str(exc).split("; run:")[0],
                                             manifest=str(manifest_path(*where)))
            except PreloadGateError as exc:  # untrusted, unreadable or malformed
                manifests[where] = DiskCheck("unknown", reason=str(exc), manifest=str(manifest_path(*where)))
    pairs = [(w, m) for w, m in manifests.items() if isinstance(m, Manifest)]
    targets = [restart_targets(w[0], m) for w, m in pairs]
    flat = stat_all([t for ts in targets for t in ts])
    stats: dict[tuple[str, str | None], list[Any]] = {}
    for (w, _m), ts in zip(pairs, targets, strict=True):
        stats[w], flat = flat[:len(ts)], flat[len(ts):]
    for r in serving:
        where = (str(r.checkpoint), r.cache_dir)
        found = manifests[where]
        if isinstance(found, DiskCheck):
            r.disk = msgspec.structs.replace(found, fix=fixes_for(r).promote if found.state == "stale" else "")
        else:
            r.disk = _judge(r, found, stats.get(where), serving, configs[str(r.checkpoint)])


def _folder_config(checkpoint: str) -> Any:
    """The folder's config.json as the key reads it (:func:`preload.identity.config.read_config`):
    the parsed object, None without one, or the :class:`CheckpointError` an engine would get."""
    from pgbase.errors import CheckpointError
    from preload.identity.config import read_config

    try:
        return read_config(checkpoint)
    except CheckpointError as exc:
        return exc


def _config_check(r: DaemonRecord, cfg: Any, where: str, fixes: Fixes) -> DiskCheck | None:
    """Stale when the key an engine builds from the folder now differs from
    the daemon's in a field config.json gives (:data:`preload.daemon.key_flags.FROM_FOLDER`);
    None when they agree or the daemon sent no key this release reads.

    Recomputed by the key's own functions: ``config_digest`` (every stage
    keys it, by :func:`preload.identity.config.config_digest`) and, for the
    raw stage, ``architecture`` as :func:`preload.daemon.raw.raw_key` reads
    it. vLLM's stages derive ``architecture``, ``quant_config_digest`` and
    ``rope_digest`` from the config vLLM builds (not computable without
    vLLM); each follows from config.json, so its digest changes with them."""
    from pgbase.errors import CheckpointError
    from preload.daemon.key_flags import FROM_FOLDER
    from preload.identity.config import canonical_digest, first_architecture

    try:
        key = WeightCacheKey.from_json(r.key) if r.key else None
    except ValueError:  # a key of another release: the disk check alone
        key = None
    if key is None:
        return None
    path = os.path.join(str(r.checkpoint), "config.json")
    restore = (f"restore {path} (the daemon read one: config_digest {_shown(key.config_digest)}); "
               "engines cannot build the model without it")
    if isinstance(cfg, CheckpointError):
        return DiskCheck("stale", "config", reason=str(cfg), shard="config.json", fields=str(cfg), manifest=where,
                         manifest_digest=r.digest, fix=restore)
    now: dict[str, Any] = {"config_digest": None if cfg is None else canonical_digest(cfg)}
    if key.export_stage == "raw":
        now["architecture"] = first_architecture(cfg)
    assert set(now) <= FROM_FOLDER
    differ = [f for f in now if getattr(key, f) != now[f]]
    if not differ:
        return None
    fields = ", ".join(f"{f} {_shown(getattr(key, f))} -> {_shown(now[f])}" for f in differ)
    if cfg is None and key.config_digest is not None:
        return DiskCheck("stale", "config", reason="config.json removed", shard="config.json",
                         fields=f"removed ({fields})", manifest=where, manifest_digest=r.digest, fix=restore)
    return DiskCheck("stale", "config", reason=f"config.json changed since the daemon started: {fields}",
                     shard="config.json", fields=fields, manifest=where, manifest_digest=r.digest,
                     fix=fixes.restart)


def _shown(value: Any) -> str:
    """A key value in a line: a digest by its first 16 hex, nothing as "none"."""
    if value is None:
        return "none"
    return short_digest(value) if isinstance(value, str) and len(value) == 64 else str(value or '""')


def _judge(r: DaemonRecord, manifest: Any, stats: list[Any] | None, serving: list[DaemonRecord],
           cfg: Any = None) -> DiskCheck:
    from preload.identity.filestat import STAT_BLIND_FILESYSTEMS, FileStat, filesystem_type_of_dev
    from preload.identity.manifest import manifest_path, stale_reason

    ckpt, digest = str(r.checkpoint), str(r.digest)
    fixes = fixes_for(r)
    then, restart, stop = fixes.promote, fixes.start_new, fixes.stop
    if manifest is None:
        return DiskCheck("stale", "no_manifest", reason=f"no promotion manifest in {r.cache_dir}",
                         manifest=str(manifest_path(ckpt, r.cache_dir)), fix=then)
    where = str(manifest_path(ckpt, r.cache_dir))
    # The weights may be the promoted ones while the key's other folder fields
    # are not (a folder gone is the stat check's alone to name).
    config = _config_check(r, cfg, where, fixes) if os.path.isdir(ckpt) else None
    # stat_blind_ok, as the daemon itself: on tmpfs the stats are still compared.
    found = stale_reason(ckpt, manifest, stat_blind_ok=True, stats=stats)
    if found is not None:
        reason, shard = found
        if not os.path.isdir(ckpt):  # a promote of a path that is gone fails too: stop it, and say where to go
            how = f"as this one was: {r.command}" if r.command else "with this one's settings"
            then = (f"{stop}: {ckpt} is gone, so no engine can start on it; if the folder moved, promote it where "
                    f"it is now (preload-gate promote NEW_PATH) and start a daemon for it there ({how}, with "
                    "NEW_PATH for the folder)")
        elif config is not None and config.fix.startswith("restore"):  # promote alone keeps it missing
            then = f"{config.fix}, then {then}"
        elif config is not None:  # config.json replaced (a new inode): promote prints the same digest
            then += f"; if it prints {short_digest(digest)}, {fixes.restart}"
        return DiskCheck("stale", "changed", reason=reason, shard=shard, fields=_fields(manifest, shard, stats or []),
                         manifest_digest=manifest.digest, manifest=where, fix=then)
    if manifest.digest != digest:
        other = next((o for o in serving if o.digest == manifest.digest and o.rank == r.rank), None)
        if other is not None:
            return DiskCheck("superseded", reason=f"promoted again as {short_digest(manifest.digest)}, served by pid "
                             f"{other.pid}", manifest_digest=manifest.digest, manifest=where, fix=stop)
        return DiskCheck("stale", "promoted_again", reason=f"promoted again as {short_digest(manifest.digest)}",
                         manifest_digest=manifest.digest, manifest=where, fix=restart)
    if config is not None:
        return config
    d = stats[0] if stats else None
    blind = isinstance(d, FileStat) and filesystem_type_of_dev(d.dev) in STAT_BLIND_FILESYSTEMS
    return DiskCheck("fresh", manifest_digest=manifest.digest, manifest=where, reason=(
        "on a stat-blind filesystem: engines with identity stat refuse it; use identity pinned "
        f"(expected_digest {digest})" if blind else ""))


def _fields(manifest: Any, shard: str | None, stats: list[Any]) -> str:
    """The stat fields of ``shard`` that differ from the manifest's, from the stats just taken."""
    from preload.identity.filestat import FileStat

    if shard == manifest.index_file:
        now, then = (stats[1] if len(stats) > 1 else None), manifest.index_stat
    else:
        i = next((i for i, rec in enumerate(manifest.shards) if rec.name == shard), None)
        now, then = (stats[2 + i], manifest.shards[i].stat) if i is not None and len(stats) > 2 + i else (None, None)
    return now.changed_fields(then) if isinstance(now, FileStat) and isinstance(then, FileStat) else ""


# ------------------------------------------------------------------ text


def render(report: StatusReport, default_root: Path) -> list[str]:
    """The lines ``status`` prints for ``report``."""
    lines = [f"note: not following {bad['path']}: {bad['error']}" for bad in report.refused]
    for r in report.elsewhere:
        lines.append(f"note: a daemon serves {short_digest(str(r.digest))} under {r.socket_root}, not the "
                     f"socket root {default_root}; engines will not find it: restart it, or set "
                     "PRELOAD_GATE_SOCKET_ROOT to that directory everywhere")
    for r in report.ranks:
        lines += _serving(r, default_root) if r.serving else [_not_serving(r)]
    lines += store_lines(report)
    return lines


def _not_serving(r: DaemonRecord) -> str:
    if r.not_a_socket:  # a file or link in a socket's place: no daemon ever served through it
        return f"{r.socket}: {r.not_a_socket}, not a socket: nothing serves here; remove it"
    if r.refused:
        return f"{r.socket}: a daemon answers but refused us: {r.refused}"
    if r.busy:
        return f"{r.socket}: a daemon listens but is busy (not stale; do not start another): {r.busy}"
    if r.lock_holder:
        return f"{r.socket}: not answering, but pid {r.lock_holder} holds its lock (a daemon starting, or hung): not stale"
    return f"{r.socket}: not answering and its lock is free (stale socket)"


def _serving(r: DaemonRecord, default_root: Path) -> list[str]:
    # Engines find a daemon outside the default root only when told where it is.
    where = "" if Path(r.socket_root) == default_root else f"  socket_root={r.socket_root}"
    failures = sum(r.attach_failures.values())
    out = [f"{short_digest(str(r.digest))} rank {r.rank} pid {r.pid} {r.stage}/{r.transport} {r.resident_bytes} bytes, "
           f"{r.attached} attached, {r.hits} hits, {failures} attach failures, {sum(r.misses.values())} misses  "
           f"{r.checkpoint}{where}",
           f"    digest   {r.digest}",
           f"    key      {_key_text(r.key)}"]
    if failures or r.attaching:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(r.attach_failures.items())) or "none"
        out.append(f"    attach   {r.hits} done, {failures} failed ({kinds}), {r.attaching} in progress"
                   + _last_failure(r.last_attach_failure))
    if r.misses:
        out.append("    misses   " + ", ".join(f"{k} {n}" for k, n in sorted(r.misses.items())))
    out.append("    " + origin_line(r.origin, r.generation, r.took_over_from))
    if r.disk is not None:
        out.append("    " + disk_line(r))
    return out


def disk_line(r: DaemonRecord) -> str:
    """The one line on what engines started on ``r``'s folder would find."""
    d, ckpt, d16 = r.disk, r.checkpoint, short_digest(str(r.digest))
    assert d is not None
    if d.state == "fresh":
        return f"fresh: {ckpt} matches its promotion manifest ({d16}); engines on it find this daemon" + (
            f"; but it is {d.reason}" if d.reason else "")
    if d.state == "superseded":
        return f"superseded: {ckpt} was {d.reason}; engines on it use that one; {d.fix}"
    if d.state == "unknown":
        return f"unknown: cannot compare {ckpt} with its manifest: {d.reason}"
    if d.cause == "no_manifest":
        return f"stale: {ckpt}: {d.reason}; engines on it will miss; run: {d.fix}"
    if d.cause == "promoted_again":
        return f"stale: {ckpt} was {d.reason}, this daemon serves {d16}; engines on it will miss; run: {d.fix}"
    what = f"{d.shard}: {d.fields}" if d.shard and d.fields else d.reason
    return f"stale: {ckpt} changed ({what}); engines on it will miss; run: {d.fix}"
