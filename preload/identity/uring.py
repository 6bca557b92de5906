"""Batches of statx through io_uring, with ctypes and mmap only.

The restart check needs N stats at once; on remote storage each waits one
round trip. From Python threads that costs a thread per stat and a GIL
hand-off per result (~100-150 ms of CPU at 1,000 stats). io_uring issues
them from the kernel: one ``io_uring_enter`` submits a wave of
``IORING_OP_STATX`` requests and waits for all of them, with the GIL
released (a ``ctypes.CDLL`` call releases it), and the kernel's io-wq
threads wait the round trips in parallel.

The kernel may refuse io_uring (ENOSYS on old kernels, EPERM under Docker's
default seccomp profile, ``/proc/sys/kernel/io_uring_disabled`` = 2): then
:func:`unavailable` says why, once, and the caller uses its thread pool.

Memory safety: the kernel writes into a statx buffer from another thread
until that request's completion is posted, so every buffer and path of a
wave belongs to the ring object and a wave is always reaped in full before
its buffers are touched or reused. A wave interrupted by an exception
(KeyboardInterrupt while waiting) leaves its ring, buffers included, in
``_abandoned`` for the life of the process rather than freeing memory the
kernel may still write. Ordering: a completion's buffer is read only after
its ring tail is seen, which x86_64 orders for every load (``_SYSCALLS``).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import platform
import struct
import threading
from collections.abc import Sequence

from pgbase.oscause import FILE_LIMIT_ERRNOS

# Syscall numbers (io_uring_setup, _enter, _register) where the ring is used.
# Only x86_64: reading a completion needs its ring tail loaded with acquire
# order, which Python cannot ask for; x86's total store order gives it to
# every load. aarch64 has the same numbers (425-427, from the unified
# table) but weak ordering, so it reports io_uring unavailable.
_SYSCALLS = {"x86_64": (425, 426, 427)}
_IORING_OFF_SQ_RING = 0
_IORING_OFF_CQ_RING = 0x8000000
_IORING_OFF_SQES = 0x10000000
_IORING_SETUP_SUBMIT_ALL = 1 << 7  # a failing SQE does not stop the rest of the batch (5.18)
_IORING_ENTER_GETEVENTS = 1
_IORING_REGISTER_IOWQ_MAX_WORKERS = 19  # (5.15)
_IORING_OP_STATX = 21
_AT_FDCWD = -100
# stat(2) and fstatat(2), which os.stat calls, act as if AT_NO_AUTOMOUNT were
# set (statx(2)); statx does not unless asked, so it is asked.
_AT_NO_AUTOMOUNT = 0x800
_STATX_BASIC_STATS = 0x7FF
_SQE_SIZE, _CQE_SIZE, _STATX_SIZE = 64, 16, 256

# struct io_uring_params: 10 u32 (sq_entries .. resv[3]), then io_sqring_offsets
# (head, tail, ring_mask, ring_entries, flags, dropped, array, resv1, u64
# user_addr) and io_cqring_offsets (head, tail, ring_mask, ring_entries,
# overflow, cqes, flags, resv1, u64 user_addr): 120 bytes.
_PARAMS = struct.Struct("=10I8IQ8IQ")
# struct io_uring_sqe, as liburing's io_uring_prep_statx fills it: opcode, flags,
# ioprio, fd (dirfd), off (= addr2: the statx buffer), addr (the path), len
# (the mask), statx_flags, user_data; the rest zero.
_SQE = struct.Struct("=BBHiQQIIQ24x")
_CQE = struct.Struct("=QiI")  # user_data, res (-errno on failure), flags
# struct statx: stx_ino @32, stx_size @40, stx_ctime @96 and stx_mtime @112 as
# (s64 tv_sec, u32 tv_nsec, s32 pad), stx_dev_major/minor @136.
_STATX = struct.Struct("=32xQQ48xqI4xqI4x8xII")

# What a batch returns per path: (size, mtime_ns, ctime_ns, ino, dev), or the errno.
StatFields = tuple[int, int, int, int, int]

_log = logging.getLogger("preload.identity")


class _Ring:
    """One io_uring instance with ``entries`` SQEs and a statx buffer per SQE."""

    def __init__(self, entries: int, workers: int) -> None:
        setup, enter, register = _SYSCALLS[platform.machine()]
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        self._enter_nr, self._register_nr = enter, register
        params = ctypes.create_string_buffer(_PARAMS.size)
        _PARAMS.pack_into(params, 0, 0, 0, _IORING_SETUP_SUBMIT_ALL, *([0] * 25))
        fd = self._syscall(ctypes.c_long(setup), ctypes.c_long(entries), params)
        if fd < 0 and ctypes.get_errno() == errno.EINVAL:  # before 5.18: no SUBMIT_ALL
            ctypes.memset(params, 0, _PARAMS.size)
            fd = self._syscall(ctypes.c_long(setup), ctypes.c_long(entries), params)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_uring_setup: {os.strerror(err)}")
        self.fd = fd
        self._maps: list[mmap.mmap] = []
        try:
            p = _PARAMS.unpack_from(params)
            self.entries, cq_entries, self.submit_all = p[0], p[1], bool(p[2] & _IORING_SETUP_SUBMIT_ALL)
            sq_off, cq_off = p[10:17], p[19:25]
            self._sq = self._map(sq_off[6] + self.entries * 4, _IORING_OFF_SQ_RING)
            self._cq = self._map(cq_off[5] + cq_entries * _CQE_SIZE, _IORING_OFF_CQ_RING)
            self._sqes = self._map(self.entries * _SQE_SIZE, _IORING_OFF_SQES)
        except BaseException:
            self.close()
            raise
        self._sq_tail, self._sq_mask, self._sq_array = sq_off[1], self._u32(self._sq, sq_off[2]), sq_off[6]
        self._cq_head, self._cq_tail, self._cq_mask = cq_off[0], cq_off[1], self._u32(self._cq, cq_off[2])
        self._cqes = cq_off[5]
        self._buffers = ctypes.create_string_buffer(self.entries * _STATX_SIZE)
        self._base = ctypes.addressof(self._buffers)
        self._paths: ctypes.Array[ctypes.c_char] | None = None  # the wave in flight's paths
        self.workers = self._max_workers(workers)

    @staticmethod
    def _u32(m: mmap.mmap, off: int) -> int:
        return int(struct.unpack_from("=I", m, off)[0])

    def _map(self, length: int, offset: int) -> mmap.mmap:
        m = mmap.mmap(self.fd, length, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE,
                      offset=offset)
        self._maps.append(m)
        return m

    def _max_workers(self, n: int) -> int:
        """Let the kernel run ``n`` stats at once. STATX is io-wq's "bounded"
        work, whose default limit is min(entries, 4 x CPUs): 8 on a 2-core
        host, so 1,000 stats on remote storage would wait 125 round trips.
        Returns the limit in force (the kernel caps it at RLIMIT_NPROC)."""
        counts = (ctypes.c_uint * 2)(n, 0)  # [bounded, unbounded]; 0 leaves one as it is
        if self._register(_IORING_REGISTER_IOWQ_MAX_WORKERS, counts, 2) < 0:
            return 0  # before 5.15: the default limit
        ctypes.memset(counts, 0, ctypes.sizeof(counts))  # read back: both 0 only reports
        self._register(_IORING_REGISTER_IOWQ_MAX_WORKERS, counts, 2)
        return int(counts[0])

    def _register(self, opcode: int, arg: ctypes.Array[ctypes.c_uint], nr_args: int) -> int:
        # Every argument as a long: syscall(2) reads its variadic arguments so.
        return int(self._syscall(ctypes.c_long(self._register_nr), ctypes.c_long(self.fd), ctypes.c_long(opcode),
                                 arg, ctypes.c_long(nr_args)))

    def _enter(self, to_submit: int, min_complete: int) -> int:
        while True:
            ret = self._syscall(ctypes.c_long(self._enter_nr), ctypes.c_long(self.fd), ctypes.c_long(to_submit),
                                ctypes.c_long(min_complete), ctypes.c_long(_IORING_ENTER_GETEVENTS),
                                None, ctypes.c_long(0))
            if ret >= 0:
                return int(ret)
            err = ctypes.get_errno()
            if err != errno.EINTR:
                raise OSError(err, f"io_uring_enter: {os.strerror(err)}")

    def wave(self, paths: Sequence[bytes]) -> list[StatFields | int]:
        """statx every path (at most ``entries``; each a NUL-free bytes
        path) and return, in order, its fields or its errno."""
        n = len(paths)
        assert n <= self.entries
        # One buffer of NUL-terminated paths for the wave (create_string_buffer
        # adds the last NUL), alive on the ring until the wave is reaped.
        self._paths = ctypes.create_string_buffer(b"\0".join(paths))
        at = ctypes.addressof(self._paths)
        tail = self._u32(self._sq, self._sq_tail)
        for i, p in enumerate(paths):
            _SQE.pack_into(self._sqes, i * _SQE_SIZE, _IORING_OP_STATX, 0, 0, _AT_FDCWD,
                           self._base + i * _STATX_SIZE, at, _STATX_BASIC_STATS, _AT_NO_AUTOMOUNT, i)
            struct.pack_into("=I", self._sq, self._sq_array + ((tail + i) & self._sq_mask) * 4, i)
            at += len(p) + 1
        # The tail store is seen by the kernel in this thread's io_uring_enter below.
        struct.pack_into("=I", self._sq, self._sq_tail, (tail + n) & 0xFFFFFFFF)
        res: list[int | None] = [None] * n
        submitted = reaped = 0
        while reaped < n:
            # Wait for every request submitted so far: once the kernel returns
            # with all of them posted, each buffer is final (it wrote them
            # before posting), so no completion of this wave is read early.
            if submitted < n:
                got = self._enter(n - submitted, 0)
                if got == 0:
                    raise OSError(errno.EAGAIN, "io_uring_enter submitted nothing")
                submitted += got
            reaped = self._reap(res, reaped, submitted)
        self._paths = None
        out: list[StatFields | int] = []
        for i, r in enumerate(res):
            if r is None or r < 0:
                out.append(errno.EIO if r is None else -r)
                continue
            ino, size, c_s, c_ns, m_s, m_ns, major, minor = _STATX.unpack_from(self._buffers, i * _STATX_SIZE)
            out.append((size, m_s * 1_000_000_000 + m_ns, c_s * 1_000_000_000 + c_ns, ino, os.makedev(major, minor)))
        return out

    def _reap(self, res: list[int | None], reaped: int, submitted: int) -> int:
        """Wait until ``submitted`` completions are posted, read them, return the count."""
        head = self._u32(self._cq, self._cq_head)
        ready = (self._u32(self._cq, self._cq_tail) - head) & 0xFFFFFFFF
        if reaped + ready < submitted:
            self._enter(0, submitted - reaped - ready)
            ready = (self._u32(self._cq, self._cq_tail) - head) & 0xFFFFFFFF
        for k in range(ready):
            user_data, r, _ = _CQE.unpack_from(self._cq, self._cqes + ((head + k) & self._cq_mask) * _CQE_SIZE)
            res[user_data] = r
        struct.pack_into("=I", self._cq, self._cq_head, (head + ready) & 0xFFFFFFFF)
        return reaped + ready

    def close(self) -> None:
        for m in self._maps:
            m.close()
        self._maps = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_lock = threading.Lock()
_ring: _Ring | None = None
_refused: str | None = None  # why io_uring cannot be used here; None: not known to be refused
_abandoned: list[_Ring] = []  # rings a wave was interrupted on: never freed (see module doc)


def unavailable() -> str | None:
    """Why this process cannot batch stats through io_uring (``"io_uring_setup:
    Operation not permitted"``, ``"io_uring is not used on aarch64 ..."``...), or
    None when it can. Tries once per process (a ring is set up and kept);
    the first refusal is logged once at INFO and remembered."""
    with _lock:
        return _get()[1]


def _get() -> tuple[_Ring | None, str | None]:
    global _ring, _refused
    if _ring is None and _refused is None:
        if platform.machine() not in _SYSCALLS:
            _refused = f"io_uring is not used on {platform.machine()} (only x86_64's memory order is safe from Python)"
        else:
            try:
                _ring = _Ring(MAX_ENTRIES, MAX_ENTRIES)
            except OSError as exc:
                if exc.errno in FILE_LIMIT_ERRNOS:
                    # No descriptor for the ring now: the pool serves this
                    # call, a later one tries again. Not the kernel's refusal,
                    # so no line of its own (a verb that runs out for good
                    # says so in one line: preload_gate.cli).
                    why = exc.strerror or str(exc)
                    _log.debug("io_uring setup: %s; the thread pool serves this call", why)
                    return None, why
                _refused = exc.strerror or str(exc)
        if _refused is not None:
            _log.info("preload-gate: stats through io_uring unavailable (%s); using the thread pool", _refused)
    return _ring, _refused


# Ring size: the stats of one wave. More paths go in successive waves.
MAX_ENTRIES = 1024


def statx_many(paths: Sequence[bytes]) -> list[StatFields | int]:
    """statx (following symlinks, as ``os.stat``) every path, in waves of at
    most MAX_ENTRIES, and return per path ``(size, mtime_ns, ctime_ns, ino,
    dev)`` or the errno it failed with. Each path is bytes without a NUL.

    Raises OSError when io_uring is unavailable (:func:`unavailable`) or the
    ring fails; calls from several threads run one after another.
    """
    global _ring
    with _lock:
        ring, why = _get()
        if ring is None:
            raise OSError(errno.ENOSYS, why or "io_uring unavailable")
        out: list[StatFields | int] = []
        try:
            for start in range(0, len(paths), ring.entries):
                out += ring.wave(paths[start:start + ring.entries])
        except BaseException:
            _abandoned.append(ring)  # its buffers may still be written: keep them
            _ring = None
            raise
        return out


def setup() -> bool:
    """Create this process's ring now (a loader at plugin registration) and
    return whether io_uring is usable here."""
    with _lock:
        return _get()[0] is not None


def reset() -> None:
    """Close this process's ring (a benchmark measuring a cold start: its
    io-wq threads leave with it); the next batch creates a new one."""
    global _ring
    with _lock:
        if _ring is not None:
            _ring.close()
            _ring = None


def _after_fork_in_child() -> None:
    # A child shares the parent's ring fd (and mappings): a wave from both would
    # mix their completions. The child forgets it (the parent keeps it open)
    # and sets up its own on first use.
    global _ring, _lock
    _lock = threading.Lock()
    if _ring is not None:
        _ring.close()  # the child's fd and mappings only; no wave of the child is in flight
    _ring = None


os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["MAX_ENTRIES", "reset", "setup", "statx_many", "unavailable"]
