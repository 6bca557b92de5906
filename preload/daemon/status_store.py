"""The fd store section of ``preload-gate status`` (issues 26, 39).

Per socket root: whether a store runs, none runs, or its keeper is
unreachable (its socket is there and nobody answers: the keeper died, and
what it held with it), never nothing. Per stored arena: held or orphan, the
orphan's TTL left as the keeper counts it (the keeper's own ``ttl_left_s``,
so ``status`` and the keeper agree), and whether its folder is still there
with that digest (:func:`folder_check`), with the command that fixes it.
Split from :mod:`preload.daemon.status`; asks without starting a keeper.
"""

from __future__ import annotations

import os
from typing import Literal

import msgspec

from pgbase.digest_text import short_digest
from pgbase.errors import PreloadGateError

# What status says of a stored arena's checkpoint folder.
FolderState = Literal["intact", "missing", "changed", "unknown"]


class StoredRecord(msgspec.Struct, kw_only=True):
    """One arena an fd store keeps (:meth:`preload.daemon.fdstore.FdStore.list`):
    ``ArenaRecord.summary()`` plus ``held`` (a live depositor holds it; else
    an orphan, kept ``ttl_left_s`` more seconds as the keeper counts them,
    None: until ``stop``, or unknown), its ``orphan_ttl_s`` (0: until stop),
    the store's name and its socket root; ``folder`` whether its checkpoint
    folder is still there with that digest (``intact``, ``missing``,
    ``changed``, ``unknown``), why (``folder_why``) and the command to run (``fix``)."""

    socket_root: str
    store: str
    digest: str
    rank: int
    stage: str
    transport: str
    bytes: int
    held: bool
    tensors: int = 0
    origin: str = ""
    generation: int = 0
    checkpoint: str = ""
    daemon_id: str = ""
    pid: int = 0
    deposited_at: float = 0.0
    orphan_ttl_s: float | None = None
    ttl_left_s: float | None = None
    folder: FolderState = "unknown"
    folder_why: str = ""
    fix: str = ""


class StoreState(msgspec.Struct):
    """The fd store of one socket root: its name (None: none runs), its
    ``state`` (``running``, ``none``: no keeper runs, ``unreachable``: its
    socket is there and nobody answers, ``error``: it answered badly) and why
    it could not be listed (``error``)."""

    socket_root: str
    store: str | None
    error: str | None = None
    state: Literal["running", "none", "unreachable", "error"] = "running"


def folder_check(a: StoredRecord) -> tuple[FolderState, str, str]:
    """``(folder, why, fix)`` for a stored arena's checkpoint folder: still
    there with the digest the arena proved (its promotion manifest names that
    digest and the engines' stat check passes), gone, or changed."""
    from preload.identity.manifest import load_manifest, promote_command, stale_reason

    d16, ckpt = short_digest(a.digest), a.checkpoint
    free = f"preload-gate stop {d16}"
    if not ckpt:
        return "unknown", "the record names no checkpoint folder", ""
    if not os.path.isdir(ckpt):
        return ("missing", f"its folder {ckpt} is gone: no engine started on that path can use this arena",
                f"restore {ckpt}, or free the arena: {free}")
    try:
        manifest = load_manifest(ckpt)
    except PreloadGateError as exc:
        return "unknown", f"cannot read the promotion manifest of {ckpt}: {exc}", promote_command(ckpt)
    if manifest is None:
        return ("unknown", f"{ckpt} has no promotion manifest: its digest is unknown without hashing it",
                promote_command(ckpt))
    if manifest.digest != a.digest:
        return ("changed", f"{ckpt} was promoted as other weights ({short_digest(manifest.digest)}), not "
                f"{d16}: engines on it will not use this arena", f"free the arena: {free}")
    stale = stale_reason(ckpt, manifest)
    if stale is not None:
        return ("changed", f"{ckpt} changed since promotion ({stale[0]}): its digest may no longer be {d16}",
                f"{promote_command(ckpt)} (if it now holds other weights, free the arena: {free})")
    return "intact", f"{ckpt} still holds {d16} (its manifest and the stat check agree)", ""


def scan_store(root: str | os.PathLike[str]) -> tuple[StoreState, list[StoredRecord]]:
    """What the fd store of ``root`` keeps, asked without starting one
    (``open_store(root, start=False)``). A store that cannot be reached or
    answers badly is reported in :attr:`StoreState.error`, not raised:
    ``status`` shows what it can."""
    from preload.daemon import fdstore

    where = str(root)
    try:
        store = fdstore.open_store(where, start=False)
    except NotImplementedError:  # a tree built without a store (before the keeper): none runs
        return StoreState(where, None, state="none"), []
    except (PreloadGateError, OSError) as exc:
        return StoreState(where, None, error=str(exc) or type(exc).__name__, state="error"), []
    if store is None:
        keeper = fdstore.keeper_state(where)
        if keeper == "unreachable":
            return StoreState(where, None, state="unreachable", error=(
                f"{where}/keeper.sock is there but no keeper answers (it died, e.g. kill -9): every arena it "
                "held is lost; a serving daemon starts a new one within a second, or the next start does")), []
        if keeper == "running":  # it accepts (its backlog) but did not answer the hello in time
            return StoreState(where, None, state="unreachable", error=(
                f"a keeper listens on {where}/keeper.sock but does not answer (stopped or hung: SIGSTOP, a "
                "debugger, an overloaded host); what it holds is out of reach until it answers: "
                "kill -CONT it, or stop it and let the next daemon start a new one")), []
        return StoreState(where, None, state="none"), []
    try:
        listed = store.list()
        records = [msgspec.convert({**a, "socket_root": where, "store": store.name}, StoredRecord) for a in listed]
    except (PreloadGateError, OSError, msgspec.ValidationError) as exc:
        return StoreState(where, store.name, error=str(exc), state="error"), []
    finally:
        store.close()
    for r in records:
        r.folder, r.folder_why, r.fix = folder_check(r)
    return StoreState(where, store.name), sorted(records, key=lambda r: (r.digest, r.rank))


def store_lines(report: object) -> list[str]:
    """The fd store section: per root, the store and each arena it keeps, or that none runs."""
    out: list[str] = []
    for st in getattr(report, "stores", []):
        if st.state == "unreachable":
            out.append(f"fd store of {st.socket_root}: UNREACHABLE: {st.error}")
            continue
        if st.error:
            out.append(f"note: cannot list the fd store of {st.socket_root}: {st.error}")
            continue
        if st.store is None:
            out.append(f"fd store of {st.socket_root}: none runs (no keeper): no arena outlives its daemon here "
                       "until a daemon starts one")
            continue
        kept = [a for a in getattr(report, "stored", []) if a.socket_root == st.socket_root]
        total = sum(a.bytes for a in kept)
        out.append(f"fd store ({st.store}) of {st.socket_root}: {len(kept)} arena(s), {total} bytes")
        for a in kept:
            if a.held:
                who = f"held by pid {a.pid}"
            elif a.ttl_left_s is None:
                who = "orphan (kept until preload-gate stop)"
            else:
                who = f"orphan ({a.ttl_left_s:.0f} s of its TTL left)"
            out.append(f"    {short_digest(a.digest)} rank {a.rank} {a.stage}/{a.transport} {a.bytes} bytes, "
                       f"{a.origin or '?'} gen {a.generation}, {who}  {a.checkpoint}".rstrip())
            if a.folder != "intact":
                out.append(f"        folder {a.folder}: {a.folder_why}" + (f"; run: {a.fix}" if a.fix else ""))
    return out
