"""Budgets decided before the first byte: open files and memory.

A load that runs out of descriptors or memory halfway costs minutes and
then fails with a library's guess at the cause (safetensors calls EMFILE "No
such file or directory"). So every path that reads shards asks here first,
with what it will hold, and is refused in one line naming the limit, the
sizes and the fix; or it goes on, inside the limit.

Open files (``RLIMIT_NOFILE``): :func:`reserve_open_files` makes room for
what a step needs (raising the soft limit up to the hard one when it must,
saying so in one log line) and :func:`open_file_room` says how much there is,
so a pool or a server sizes itself to it (:func:`preload.identity.digest.hash_shards`,
the rank's connection cap). What the daemon's stages hold, from their source:

- :class:`preload.daemon.proof.ProvenShard` keeps no descriptor between a
  shard's header and its data, and each stage reads one shard at a time:
  one shard file open at once, whatever the shard count (``SHARD_FILES``).
- vLLM's own weight iterator (vLLM 0.32's ``safetensors_weights_iterator``)
  also holds one ``safe_open`` at a time, plus one per prefetch thread when
  it prefetches (``safetensors_load_strategy="prefetch"``, or a network
  filesystem), or ``max_workers`` files with multithreaded loading; the
  loaded stage never runs it: it hands vLLM's ``load_weights`` our iterator
  (:class:`preload.daemon.loaded.ProvenWeights`).
- an arena: at most one descriptor (the CPU memfd), sent with every state reply
  as a duplicate (``ARENA_FILES``); while it is mapped (the daemon filling it,
  an engine attached to it) one more: CPython's ``mmap.mmap`` keeps its own
  duplicate of the descriptor it maps for the mapping's life
  (``Modules/mmapmodule.c``; ``trackfd=False`` only arrives in Python 3.13)
  (``MAPPING_FILES``).
- so a load holds (:func:`load_open_files`): the raw and loaded stages
  make their arena after every header is read and before the first tensor,
  then read one shard at a time into it (a shard, the memfd, its mapping);
  the processed stage lets vLLM's ``load_weights`` take the whole checkpoint
  through our iterator first and makes the arena after the last shard is
  closed (the larger of the two). The dtype table
  (:mod:`pgbase.dtypes`) asks the libraries in memory and opens no file.
- serving: the listening socket and the rank lock, then per engine
  connection its socket and the arena's duplicates while a reply is sent.

``tests/unit/test_open_file_budget.py`` (the raw stage) and
``tests/cpu/test_open_file_budget_vllm.py`` (loaded, processed) measure the
loads with the kernel: each runs under a soft limit leaving exactly
:func:`load_open_files` free, and fails, with the cause named, with one fewer.

Memory: :func:`memory_budget` is the least of every limit on this process
(``MemAvailable``, the memory cgroup less its working set, strict
overcommit, ``RLIMIT_AS``: :func:`pgbase.limits.memory_limits`) or the free
memory of a CUDA device; :func:`check_memory` refuses a set of resident
sizes that does not fit, naming each size, the budget and what binds it.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Sequence
from dataclasses import dataclass

from pgbase.errors import PreflightError
from pgbase.limits import MemoryLimit, gib, memory_limits, nofile_fix, open_file_limit, open_files

log = logging.getLogger("preload.budget")

SHARD_FILES = 1
ARENA_FILES = 1
MAPPING_FILES = 1
# A rank's own: the lock file and the listening socket.
RANK_FILES = 2
# Engine connections one rank serves at once (more are turned away); its budget
# is :func:`rank_open_files` of it. Here, not in the server, so that what sizes
# itself to it (``bench --param clients``) need not import the daemon.
MAX_CONNECTIONS = 256


def connection_files(arena_fds: int = ARENA_FILES) -> int:
    """Descriptors one engine connection can hold in the daemon at once:
    its socket, and the arena's duplicates while a state reply is sent."""
    return 1 + arena_fds


def load_open_files(stage: str, arena_fds: int = ARENA_FILES) -> int:
    """Descriptors a stage's load (``"raw"``, ``"loaded"``, ``"processed"``)
    holds at once beyond what its process held before it, whatever the
    shard count: a shard beside the arena and its mapping, except the
    processed stage's, whose arena comes after the last shard."""
    arena = arena_fds + MAPPING_FILES
    if stage == "processed":
        return max(SHARD_FILES, arena)
    return SHARD_FILES + arena


def rank_open_files(max_connections: int, stage: str = "raw", arena_fds: int = ARENA_FILES) -> tuple[int, int]:
    """``(need, want)`` of a daemon rank beyond what it holds before loading:
    ``need`` loads and serves one engine (its state and watch connections),
    ``want`` serves ``max_connections`` connections. An upper bound: the
    load's part is exact (:func:`load_open_files`), serving's is added to it
    though the load's shard and mapping are closed by then."""
    base = load_open_files(stage, arena_fds) + RANK_FILES
    return base + 2 * connection_files(arena_fds), base + max_connections * connection_files(arena_fds)


def attach_open_files(arena_fds: int = ARENA_FILES) -> int:
    """Descriptors an engine takes to attach one rank's arena: the ones the
    state reply carries, and the mapping's duplicate made before they close."""
    return arena_fds + MAPPING_FILES


def open_file_room() -> int:
    """Descriptors this process can still open before EMFILE."""
    soft, _ = open_file_limit()
    return max(0, soft - open_files())


def reserve_open_files(need: int, what: str, want: int | None = None) -> int:
    """Make room for ``need`` more open files (and ``want``, if the limits
    allow), before a step that opens them; returns the room there is then.

    Where the soft limit leaves less than asked and the hard limit more, the
    soft limit is raised (never above what is asked, never lowered) with one
    warning line. Where even ``need`` does not fit, :class:`PreflightError`:
    one line naming ``what``, the counts, the limit and the fix
    (``ulimit -n``, ``LimitNOFILE=``).

    >>> reserve_open_files(6, "rank 0 (raw stage, 1,500 shards)", want=514)  # doctest: +SKIP
    514
    """
    want = max(need, want or need)
    soft, hard = open_file_limit()
    held = open_files()
    room = soft - held
    if room < want and soft < hard:
        target = min(hard, held + want)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        log.warning("%s: raised this process's open-file soft limit from %d to %d (hard limit %d) to hold %d more "
                    "files beside the %d open", what, soft, target, hard, want, held)
        room = target - open_files()  # a descriptor numbered above the old soft limit takes room now
    if room < need:
        raise _too_few_files(what, need, want, held, room)
    return room


def check_open_file_limit(need: int, what: str, want: int | None = None) -> None:
    """:func:`reserve_open_files`'s refusal, asked before the processes that
    open the files start (the launcher's preflight, so ``preload --dry-run``
    too): they inherit this process's limits and may raise their soft limit
    up to the hard one, so the hard limit less what this process holds must
    leave ``need``. Changes no limit; each rank asks again, exactly, before
    its first shard. Raises :class:`PreflightError` as that does."""
    _soft, hard = open_file_limit()
    held = open_files()
    if hard - held < need:
        raise _too_few_files(what, need, max(need, want or need), held, hard - held)


def _too_few_files(what: str, need: int, want: int, held: int, room: int) -> PreflightError:
    soft, hard = open_file_limit()
    return PreflightError(
        f"{what} needs {need} more open files beside the {held} open, and the open-file limit leaves "
        f"{max(0, room)} (RLIMIT_NOFILE soft {soft}, hard {hard}); {nofile_fix(held + want)}")


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes this process may still make resident on ``device``, and the
    limit that binds (None for a CUDA device: its free memory)."""

    available: int
    device: str
    limit: MemoryLimit | None

    def describe(self) -> str:
        if self.limit is None:
            return f"{gib(self.available)} free on {self.device}"
        return f"{gib(self.available)} under {self.limit.name} ({self.limit.detail})"

    @property
    def fix(self) -> str:
        if self.limit is None:
            return f"free memory on {self.device} (nvidia-smi lists what holds it) or use a larger device"
        return self.limit.fix


def memory_budget(device: str = "cpu") -> MemoryBudget:
    """What can still be made resident now: on ``"cpu"`` the least of every
    memory limit on this process (:func:`pgbase.limits.memory_limits`); on
    ``"cuda"``/``"cuda:N"`` the device's free memory (``torch.cuda.mem_get_info``).

    The host side counts what the kernel can give without swapping
    (``MemAvailable``; a memfd arena is shared memory, counted there and in
    the cgroup), so a budget is a ceiling on one more allocation, not a
    reservation: two processes that check at once can both pass.

    >>> memory_budget().available  # doctest: +SKIP
    17179869184
    """
    if device.startswith("cuda"):
        import torch

        index = int(device.partition(":")[2] or torch.cuda.current_device())
        free, _total = torch.cuda.mem_get_info(index)
        return MemoryBudget(int(free), f"cuda:{index}", None)
    tight = min(memory_limits(), key=lambda m: m.available)
    return MemoryBudget(tight.available, "cpu", tight)


def check_memory(needs: Sequence[tuple[str, int]], device: str = "cpu",
                 budget: MemoryBudget | None = None) -> MemoryBudget:
    """Refuse, before a byte is read, resident sizes that cannot fit.

    ``needs``: ``(what, bytes)`` pairs that will be resident together (a
    rank's arena; two checkpoints side by side). Raises
    :class:`PreflightError` naming each size, their sum, the budget and the
    limit that binds with its fix; returns the budget checked against.

    >>> check_memory([("rank 0's arena (raw stage)", 3 << 30)])  # doctest: +SKIP
    PreflightError: rank 0's arena (raw stage) needs 3.00 GiB resident; the memory budget is 1.20 GiB ...
    """
    budget = budget or memory_budget(device)
    total = sum(n for _, n in needs)
    if total <= budget.available:
        return budget
    parts = " + ".join(f"{what} {gib(n)}" for what, n in needs)
    summed = "" if len(needs) == 1 else f" = {gib(total)}"
    raise PreflightError(f"not enough memory: {parts}{summed} resident; the memory budget is {budget.describe()}; "
                         f"{budget.fix}")
