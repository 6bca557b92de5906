"""What changed among a checkpoint folder's entries since promotion, by name.

A folder's own stat says that an entry was added, removed or renamed, not
which. ``promote`` records every folder's entries (name -> inode, from one
``scandir`` each: the inode is in the directory entry itself, so no file is
stat'ed); the restart check lists only a folder whose stat changed and
diffs the two. The inode tells a rename (the same inode under a new name)
and a replacement (the same name on a new inode: a file written beside and
renamed over, as atomic writers do) from a removal and an addition.

Folders are named with a trailing ``/``; names below the top folder carry
their relative path (``original/consolidated.safetensors``).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping

# The top folder's key in a tree of entries.
TOP = "."

# Every name vLLM's _prepare_weights globs for (pgbase.fileset: *.safetensors,
# *.bin, then *.pt): without a recorded listing, only a new one of these is
# known to be new.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def scan_entries(folder: str | os.PathLike[str]) -> dict[str, int]:
    """``{name: inode}`` of ``folder``'s entries, folders as ``name/``; one
    ``scandir``, no stat (links are entries, never followed).

    Raises OSError as ``os.scandir`` does.
    """
    with os.scandir(folder) as it:
        return {(e.name + "/" if e.is_dir(follow_symlinks=False) else e.name): e.inode() for e in it}


def tree_entries(checkpoint: str | os.PathLike[str], subdirs: Collection[str]) -> dict[str, dict[str, int]]:
    """:func:`scan_entries` of the top folder (key :data:`TOP`) and of each
    of ``subdirs`` (relative POSIX paths, as ``Manifest.subdir_stats``)."""
    base = os.fspath(checkpoint)
    return {rel: scan_entries(base if rel == TOP else os.path.join(base, rel)) for rel in [TOP, *sorted(subdirs)]}


def entry_changes(recorded: Mapping[str, int], now: Mapping[str, int], shards: Collection[str] = (),
                  prefix: str = "", only_weights_are_known: bool = False) -> list[tuple[str, str]]:
    """The differences between two :func:`scan_entries` of one folder, as
    ``(recorded or new name, words)``: ``shard X removed``, ``shard X renamed
    to Y``, ``X added``, ``X replaced (new inode)``; names in ``shards`` are
    called shards. ``prefix`` is the folder's path for the words (``original/``).

    ``only_weights_are_known``: ``recorded`` holds only the shards and the
    index (a manifest from before listings were recorded), so an added name
    is reported only if it is a weight file, and nothing is called replaced
    (the caller's stats of those files show it).

    >>> [w for _, w in entry_changes({"a.safetensors": 1, "b.json": 2}, {"c.safetensors": 1, "b.json": 3},
    ...                              {"a.safetensors"})]
    ['shard a.safetensors renamed to c.safetensors', 'b.json replaced (new inode)']
    """
    def name(n: str) -> str:
        return f"shard {prefix}{n}" if n in shards else f"{prefix}{n}"

    removed = [n for n in recorded if n not in now]
    added = [n for n in now if n not in recorded]
    if only_weights_are_known:
        added = [n for n in added if n.endswith(WEIGHT_SUFFIXES)]
    by_inode = {now[n]: n for n in added}
    out: list[tuple[str, str]] = []
    for n in sorted(removed, key=str.encode):
        to = by_inode.pop(recorded[n], None)
        out.append((n, f"{name(n)} renamed to {prefix}{to}" if to is not None else f"{name(n)} removed"))
    out += [(n, f"{prefix}{n} added") for n in sorted(by_inode.values(), key=str.encode)]
    if not only_weights_are_known:
        out += [(n, f"{name(n)} replaced (new inode)") for n in sorted(recorded, key=str.encode)
                if n in now and now[n] != recorded[n]]
    return out


def folder_changes(base: str, rel: str, recorded: Mapping[str, Mapping[str, int]] | None,
                   known: Mapping[str, int], shards: Collection[str]) -> list[tuple[str, str]]:
    """What changed among the entries of folder ``rel`` (:data:`TOP` or a
    path relative to the checkpoint ``base``) since promotion, as
    :func:`entry_changes` gives it, names relative to ``base``: one listing,
    diffed with the one promote recorded (``recorded``, a manifest's
    ``entries``). Without recorded listings (an older manifest), the top
    folder is diffed against ``known`` (its shards and index) and a
    subfolder gives ``[]``. A folder that cannot be listed is one entry
    saying so.
    """
    prefix = "" if rel == TOP else f"{rel}/"
    try:
        now = scan_entries(os.path.join(base, rel) if prefix else base)
    except OSError as exc:
        return [(rel, f"cannot list {prefix or 'the checkpoint directory'}: {exc.strerror or exc}")]
    listing = (recorded or {}).get(rel)
    if listing is not None:
        return [(prefix + n, w) for n, w in entry_changes(listing, now, shards if not prefix else (), prefix)]
    if prefix:
        return []
    return entry_changes(known, now, shards, only_weights_are_known=True)


__all__ = ["TOP", "WEIGHT_SUFFIXES", "entry_changes", "folder_changes", "scan_entries", "tree_entries"]
