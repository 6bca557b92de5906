"""Content digests: SHA-256 of every shard, and of the checkpoint as a whole.

The checkpoint digest is the SHA-256 of the ``sha256sum`` lines of its shards
(``<hex>  <name>\\n``, sorted by the byte order of the name), so an operator
can reproduce it without this project:

    cd CKPT && LC_ALL=C sha256sum *.safetensors | sha256sum

Shards are hashed in parallel threads: ``hashlib`` releases the GIL while it
hashes a large buffer, so N cores hash N shards at once. One shard is one
sequential SHA-256 and cannot be split.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pgbase.errors import CheckpointError
from pgbase.oscause import describe
from pgbase.shards import shard_paths
from preload.budget import reserve_open_files

CHUNK_BYTES = 8 << 20
# hash_shards' progress: a bar (True), none (False), a bar on a terminal (None), or lines to a callable.
Progress = bool | None | Callable[[str], None]
PROGRESS_LINE_S = 2.0  # plain progress lines (no terminal): at most one per this many seconds


def checkpoint_digest(shard_digests: Mapping[str, str]) -> str:
    """Combine per-shard hex digests into the checkpoint digest.

    >>> checkpoint_digest({"model.safetensors": "ab" * 32})[:12]
    '8e4680f145c7'
    """
    lines = "".join(
        f"{shard_digests[name]}  {name}\n" for name in sorted(shard_digests, key=str.encode)
    )
    return hashlib.sha256(lines.encode()).hexdigest()


def hash_file(
    path: str | os.PathLike[str],
    on_bytes: Callable[[int], None] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> str:
    """SHA-256 of one file, read in fixed chunks into one reused buffer."""
    h = hashlib.sha256()
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    try:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
                if on_bytes is not None:
                    on_bytes(n)
    except OSError as exc:
        raise CheckpointError(f"cannot read shard: {describe(exc, path)}", Path(path).name) from exc
    return h.hexdigest()


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def hash_shards(
    paths: Iterable[str | os.PathLike[str]],
    workers: int | None = None,
    progress: Progress = None,
) -> dict[str, str]:
    """Hash shards in parallel; returns ``{basename: hex}``.

    ``progress=None`` shows a byte progress bar only when stderr is a terminal;
    a callable is given plain lines instead (where no terminal is: a log, CI):
    one before the first byte, one per shard done at most every
    :data:`PROGRESS_LINE_S` seconds, and the last.
    """
    # One stat per file (on remote storage each is a round trip).
    sizes = {Path(p): Path(p).stat().st_size for p in paths}
    # Largest first: the slowest file starts earliest, so the pool drains evenly.
    files = sorted(sizes, key=lambda p: sizes[p], reverse=True)
    total = sum(sizes.values())
    say = progress if callable(progress) else None
    if progress is None:
        progress = sys.stderr.isatty()
    bar = None
    lock = threading.Lock()
    if progress is True:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="sha256", leave=False)
    done = {"files": 0, "bytes": 0, "said": time.monotonic()}

    def on_bytes(n: int) -> None:
        if bar is not None:
            with lock:
                bar.update(n)

    def hashed(p: Path) -> str:
        digest = hash_file(p, on_bytes)
        if say is not None:
            with lock:
                done["files"] += 1
                done["bytes"] += sizes[p]
                now = time.monotonic()
                if done["files"] == len(files) or now - done["said"] >= PROGRESS_LINE_S:
                    done["said"] = now
                    say(f"hashed {done['files']}/{len(files)} shards, {done['bytes']} of {total} bytes "
                        f"({100 * done['bytes'] / max(total, 1):.0f}%)")
        return digest

    n_workers = min(workers or default_workers(), max(1, len(files)))
    # Each worker holds one shard open: as many as the open-file limit leaves room for.
    n_workers = min(n_workers, reserve_open_files(1, f"hashing {len(files)} shards", want=n_workers))
    if say is not None:
        say(f"sha256 of {len(files)} shards, {total} bytes, {n_workers} thread(s)")
    try:
        with ThreadPoolExecutor(max_workers=n_workers) as pool:
            digests = list(pool.map(hashed, files))
    finally:
        if bar is not None:
            bar.close()
    return {p.name: d for p, d in zip(files, digests, strict=True)}


def content_digest(checkpoint: str | os.PathLike[str], workers: int | None = None) -> str:
    """The checkpoint digest hashed now from every byte of its shards (no
    manifest trusted): the ``full`` identity mode, and the independent witness
    the gate and the canaries compare a served digest with.

    >>> content_digest("/models/smollm2")  # doctest: +SKIP
    '3f0c...'
    """
    return checkpoint_digest(hash_shards(shard_paths(checkpoint), workers=workers, progress=False))
