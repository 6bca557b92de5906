"""The server half of :class:`harness.bench.fuse_fs.FuseFS`: a read-only
mirror of a real directory speaking the raw /dev/fuse protocol (linux/fuse.h,
protocol 7.31), every reply held back ``latency_s``.

Run as a script in its own process (``python fuse_server.py FD ROOT
LATENCY_S MOUNT_POINT``, FD a /dev/fuse connection the parent mounted on
MOUNT_POINT), so that its CPU and its GIL are not the client's, as a storage
server's are not. It imports nothing from this project. Its stdin is the
parent's control pipe: end of file there while the mount still serves means
the parent died without unmounting (SIGKILL), so the server unmounts,
removes the mount point and exits by itself (:meth:`Server.orphaned`).
Control, one line each on stdin, answered with
one JSON line on stdout: ``latency S`` (replies to later requests wait S),
``release`` (send every held reply now), ``counts`` (requests by opcode
name, and ``held_peak``: most replies waiting at once, i.e. requests the
kernel had in flight together), ``reset`` (zero the counts).

One thread reads requests and computes each reply at once (so the mirrored
file is read when asked); a second writes the replies when due, so
concurrent requests wait their latency together, as on a server that
serves them concurrently: 1,000 lookups issued at once cost one latency.
"""

from __future__ import annotations

import ctypes
import errno
import heapq
import json
import os
import struct
import sys
import threading
import time

OPS = {1: "LOOKUP", 2: "FORGET", 3: "GETATTR", 5: "READLINK", 14: "OPEN", 15: "READ", 17: "STATFS",
       18: "RELEASE", 25: "FLUSH", 26: "INIT", 27: "OPENDIR", 28: "READDIR", 29: "RELEASEDIR", 36: "INTERRUPT",
       38: "DESTROY", 42: "BATCH_FORGET"}
_NO_REPLY = {2, 36, 42}  # FORGET, INTERRUPT (the request it names is answered anyway), BATCH_FORGET
_IN = struct.Struct("=IIQQIIIHH")  # fuse_in_header
_OUT = struct.Struct("=IiQ")  # fuse_out_header
# fuse_attr: ino, size, blocks, atime, mtime, ctime, their nsecs, mode, nlink, uid, gid, rdev, blksize, flags
_ATTR = struct.Struct("=QQQQQQIIIIIIIIII")
_ENTRY = struct.Struct("=QQQQII")  # nodeid, generation, entry_valid, attr_valid, their nsecs; then fuse_attr
_ATTR_OUT = struct.Struct("=QII")  # attr_valid, attr_valid_nsec, dummy; then fuse_attr
_INIT_OUT = struct.Struct("=IIIIHHIIHHI28x")  # ... max_write, time_gran, max_pages, map_alignment, flags2
_FUSE_ASYNC_READ, _FUSE_PARALLEL_DIROPS, _FUSE_MAX_PAGES = 1 << 0, 1 << 18, 1 << 22
MAX_WRITE = 128 << 10
# Names are kept by the kernel (entry_valid: an hour), as an NFS client keeps
# its dentries between checks; attributes never are (attr_valid = 0), so every
# stat asks the server: one GETATTR, one round trip. (With both 0 a stat is a
# LOOKUP and then a GETATTR, two round trips one after the other, which no
# NFS client pays: a LOOKUP's reply carries the attributes.)
_ENTRY_VALID_S = 3600
FSTYPE = "fuse.pgbench"  # what /proc/self/mountinfo (and filesystem_type) shows
_MNT_DETACH = 2
# After the control pipe's end of file, how long a normal teardown has to end
# the connection (the parent unmounts, then closes the pipe) before the
# server takes the parent for dead and unmounts itself.
_TEARDOWN_GRACE_S = 5.0


def mounted(mount_point: str | os.PathLike[str], fstype: str | None = None) -> bool:
    """Whether ``mount_point`` is a mount point in /proc/self/mountinfo (field
    5), of ``fstype`` when given (the field after the `` - `` separator)."""
    want = os.path.realpath(mount_point)
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and fields[4] == want:
                rest = fields[fields.index("-") + 1:] if "-" in fields else []
                if fstype is None or rest[:1] == [fstype]:
                    return True
    return False


def umount(mount_point: str | os.PathLike[str]) -> None:
    """Detach the mount (``umount2(MNT_DETACH)``): ends the connection once nothing in it is open."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.umount2(os.fsencode(mount_point), _MNT_DETACH)


class Server:
    def __init__(self, fd: int, root: str, latency_s: float, mount_point: str = "") -> None:
        self.fd, self.root, self.latency_s = fd, os.path.realpath(root), latency_s
        self.mount_point = mount_point
        self.ended = threading.Event()  # the connection ended: serve() returned
        # orphaned() began / finished: our own unmount ends serve() (DESTROY)
        # while it still has the mount point to remove; main waits for it.
        self.leaving, self.left = threading.Event(), threading.Event()
        self.paths: dict[int, str] = {1: self.root}  # nodeid -> real path
        self.ids: dict[str, int] = {self.root: 1}
        self.lookups: dict[int, int] = {}
        self.next_id = 2
        self.handles: dict[int, object] = {}  # fh -> fd (files) or a listing (dirs)
        self.next_fh = 1
        self.counts: dict[str, int] = {}
        self.held: list[tuple[float, int, bytes]] = []
        self.held_peak = 0
        self.seq = 0
        self.due = threading.Condition()

    # -- replies -------------------------------------------------------------

    def reply(self, unique: int, payload: bytes = b"", error: int = 0) -> bytes:
        return _OUT.pack(_OUT.size + len(payload), -error, unique) + payload

    def send(self, data: bytes) -> None:
        try:
            os.write(self.fd, data)
        except OSError as exc:  # ENOENT: the request was interrupted or aborted meanwhile
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                raise

    def hold(self, data: bytes) -> None:
        with self.due:
            if self.latency_s <= 0 and not self.held:
                self.send(data)
                return
            self.seq += 1
            item = (time.monotonic() + self.latency_s, self.seq, data)
            heapq.heappush(self.held, item)
            self.held_peak = max(self.held_peak, len(self.held))
            if self.held[0] is item:  # due first: the writer's wait must shorten (else it would wake for nothing)
                self.due.notify()

    def writer(self) -> None:
        while True:
            with self.due:
                while not self.held or self.held[0][0] > time.monotonic():
                    self.due.wait(None if not self.held else self.held[0][0] - time.monotonic())
                now = time.monotonic()
                ready = []
                while self.held and self.held[0][0] <= now:
                    ready.append(heapq.heappop(self.held)[2])
            for data in ready:
                self.send(data)

    def release(self) -> None:
        with self.due:
            self.held = [(0.0, s, d) for _, s, d in self.held]
            heapq.heapify(self.held)
            self.due.notify()

    # -- requests ------------------------------------------------------------

    def attr(self, st: os.stat_result) -> bytes:
        return _ATTR.pack(st.st_ino, st.st_size, st.st_blocks, int(st.st_atime), int(st.st_mtime),
                          int(st.st_ctime), st.st_atime_ns % 10**9, st.st_mtime_ns % 10**9,
                          st.st_ctime_ns % 10**9, st.st_mode, st.st_nlink, st.st_uid, st.st_gid, st.st_rdev,
                          st.st_blksize, 0)

    def handle(self, op: int, nodeid: int, body: bytes) -> bytes | int | None:
        """The reply's payload, an errno, or None (no reply)."""
        if op in (2, 42):  # FORGET, BATCH_FORGET
            pairs = [(nodeid, struct.unpack_from("=Q", body)[0])] if op == 2 else [
                struct.unpack_from("=QQ", body, 8 + 16 * k) for k in range(struct.unpack_from("=I", body)[0])]
            for node, n in pairs:
                left = self.lookups.get(node, 0) - n
                if left > 0:
                    self.lookups[node] = left
                elif node != 1:
                    self.lookups.pop(node, None)
                    self.ids.pop(self.paths.pop(node, ""), None)
            return None
        if op == 36:
            return None
        if op == 26:  # INIT
            _major, _minor, readahead = struct.unpack_from("=III", body)
            return _INIT_OUT.pack(7, 31, min(readahead, MAX_WRITE),
                                  _FUSE_ASYNC_READ | _FUSE_PARALLEL_DIROPS | _FUSE_MAX_PAGES,
                                  64, 48, MAX_WRITE, 1, MAX_WRITE // 4096, 0, 0)
        if op == 38:  # DESTROY
            return b""
        path = self.paths.get(nodeid)
        if path is None:
            return errno.ESTALE
        try:
            return self.answer(op, path, body)
        except OSError as exc:
            return exc.errno or errno.EIO

    def answer(self, op: int, path: str, body: bytes) -> bytes | int:
        if op == 1:  # LOOKUP
            child = os.path.join(path, body.split(b"\0", 1)[0].decode("utf-8", "surrogateescape"))
            st = os.lstat(child)
            node = self.ids.get(child)
            if node is None:
                node, self.next_id = self.next_id, self.next_id + 1
                self.ids[child], self.paths[node] = node, child
            self.lookups[node] = self.lookups.get(node, 0) + 1
            return _ENTRY.pack(node, 0, _ENTRY_VALID_S, 0, 0, 0) + self.attr(st)
        if op == 3:  # GETATTR
            return _ATTR_OUT.pack(0, 0, 0) + self.attr(os.lstat(path))
        if op == 5:  # READLINK
            return os.fsencode(os.readlink(path))
        if op in (14, 27):  # OPEN, OPENDIR
            if struct.unpack_from("=I", body)[0] & os.O_ACCMODE != os.O_RDONLY:
                return errno.EROFS
            if op == 14:
                handle: object = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            else:
                with os.scandir(path) as it:
                    handle = [(e.inode(), os.fsencode(e.name), e.stat(follow_symlinks=False).st_mode >> 12)
                              for e in it]
            fh, self.next_fh = self.next_fh, self.next_fh + 1
            self.handles[fh] = handle
            return struct.pack("=QII", fh, 0, 0)
        if op in (15, 28):  # READ, READDIR: fh, offset, size
            fh, offset, size = struct.unpack_from("=QQI", body)
            handle = self.handles.get(fh)
            if op == 15:
                return os.pread(handle, size, offset) if isinstance(handle, int) else errno.EBADF
            if not isinstance(handle, list):
                return errno.EBADF
            out = b""
            for k in range(offset, len(handle)):
                ino, name, kind = handle[k]
                ent = struct.pack("=QQII", ino, k + 1, len(name), kind) + name
                ent += b"\0" * (-len(ent) % 8)
                if len(out) + len(ent) > size:
                    break
                out += ent
            return out
        if op in (18, 29):  # RELEASE, RELEASEDIR
            handle = self.handles.pop(struct.unpack_from("=Q", body)[0], None)
            if isinstance(handle, int):
                os.close(handle)
            return b""
        if op == 17:  # STATFS: fuse_kstatfs
            v = os.statvfs(path)
            return struct.pack("=QQQQQIIII24x", v.f_blocks, v.f_bfree, v.f_bavail, v.f_files, v.f_ffree,
                               v.f_bsize, v.f_namemax, v.f_frsize, 0)
        return errno.ENOSYS  # writes, xattrs, locks, FLUSH, ACCESS...: the kernel stops asking for most

    def serve(self) -> None:
        """Answer requests until the connection goes (unmount: ENODEV) or DESTROY."""
        threading.Thread(target=self.writer, daemon=True).start()
        buf = bytearray(MAX_WRITE + 4096 * 4)
        view = memoryview(buf)
        while True:
            try:
                n = os.readv(self.fd, [view])
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):  # ENOENT: interrupted meanwhile
                    continue
                if exc.errno != errno.ENODEV:  # ENODEV: unmounted, the normal end
                    print(f"fuse_server: reading /dev/fuse: {exc}", file=sys.stderr, flush=True)
                return
            length, op, unique, nodeid = _IN.unpack_from(buf)[:4]
            body = bytes(view[_IN.size:min(n, length)])
            name = OPS.get(op, f"op{op}")
            with self.due:
                self.counts[name] = self.counts.get(name, 0) + 1
            result = self.handle(op, nodeid, body)
            if result is None:
                continue
            data = self.reply(unique, error=result) if isinstance(result, int) else self.reply(unique, result)
            if op == 38:  # DESTROY: answered now, as the process ends with it
                self.send(data)
                return
            self.hold(data)

    def control(self) -> None:
        for line in sys.stdin:
            cmd, _, arg = line.strip().partition(" ")
            with self.due:
                if cmd == "latency":
                    self.latency_s = float(arg)
                elif cmd == "reset":
                    self.counts, self.held_peak = {}, len(self.held)
                elif cmd == "counts":
                    pass
                elif cmd != "release":
                    print(json.dumps({"error": f"unknown command {cmd!r}"}), flush=True)
                    continue
                cpu = os.times()
                answer = {"counts": dict(self.counts), "held_peak": self.held_peak, "held": len(self.held),
                          "latency_s": self.latency_s, "cpu_s": cpu.user + cpu.system}
            if cmd == "release":
                self.release()
            print(json.dumps(answer), flush=True)
        self.orphaned()

    def orphaned(self) -> None:
        """The control pipe's end of file: the parent closed it after
        unmounting (its teardown), or it died. A parent killed by SIGKILL
        never unmounts, and nothing else would: the mount and this process
        stayed behind forever. So unless the connection ends within the
        grace, unmount our own mount point (only while it is still this
        filesystem's), remove it and exit; exiting closes the connection's
        last descriptor, which fails whatever still waits on it (ENOTCONN)."""
        if self.ended.wait(_TEARDOWN_GRACE_S):
            return
        mp = self.mount_point
        self.leaving.set()
        print(f"fuse_server: the parent is gone; unmounting {mp or '(no mount point given)'}",
              file=sys.stderr, flush=True)
        if mp and mounted(mp, FSTYPE):
            umount(mp)
            try:
                os.rmdir(mp)
            except OSError:
                pass
        self.left.set()
        os._exit(0)


def main(argv: list[str]) -> int:
    fd, root, latency = int(argv[0]), argv[1], float(argv[2])
    server = Server(fd, root, latency, argv[3] if len(argv) > 3 else "")
    threading.Thread(target=server.control, daemon=True).start()
    print(json.dumps({"ready": True}), flush=True)
    try:
        server.serve()
    finally:
        server.ended.set()
    if server.leaving.is_set():
        server.left.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
