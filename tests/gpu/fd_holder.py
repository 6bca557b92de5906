"""A stand-in fd store for the GPU tests: a plain process that only holds fds.

``python tests/gpu/fd_holder.py SOCKET`` listens on a Unix socket; each
connection sends one JSON message (and maybe fds over SCM_RIGHTS) and gets
one JSON reply (and maybe fds) back:

- ``{"cmd": "deposit", "record": {...}}`` + one fd: keep them (replacing any);
- ``{"cmd": "fetch"}``: the record and a dup of the fd;
- ``{"cmd": "drop"}``: close the fd; ``{"cmd": "status"}``; ``{"cmd": "exit"}``.

It imports only the standard library, never maps the memory behind the fd
and never loads the CUDA driver: ``status`` reports whether ``libcuda`` is
mapped into this process (``/proc/self/maps``), which is how the tests show
that an fd held by a process with no CUDA context keeps a VMM allocation
alive. ``request`` is the client side (stdlib too, used by the probes).
"""

from __future__ import annotations

import array
import json
import os
import socket
import sys
from typing import Any

_MAX = 1 << 20


def _send(sock: socket.socket, body: dict[str, Any], fds: list[int]) -> None:
    data = json.dumps(body).encode()
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([len(data).to_bytes(4, "big") + data], anc)


def _recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    fds = array.array("i")
    msg, anc, _flags, _addr = sock.recvmsg(_MAX, socket.CMSG_LEN(16 * fds.itemsize))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    n = int.from_bytes(msg[:4], "big")
    buf = msg[4:]
    while len(buf) < n:
        more = sock.recv(n - len(buf))
        if not more:
            break
        buf += more
    return json.loads(buf), list(fds)


def request(path: str, body: dict[str, Any], fds: list[int] | None = None) -> tuple[dict[str, Any], list[int]]:
    """One exchange with the holder at ``path``: its reply and the fds it sent."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(path)
        _send(s, body, list(fds or []))
        return _recv(s)


def libcuda_mapped() -> bool:
    with open("/proc/self/maps") as f:
        return any("libcuda" in line for line in f)


def serve(path: str) -> int:
    held: dict[str, Any] = {"record": None, "fd": None}
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o600)
    srv.listen(8)
    print(json.dumps({"event": "listening", "pid": os.getpid(), "libcuda_mapped": libcuda_mapped()}), flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            body, fds = _recv(conn)
            cmd = body.get("cmd")
            out: list[int] = []
            reply: dict[str, Any] = {"ok": True}
            if cmd == "deposit" and len(fds) == 1:
                if held["fd"] is not None:
                    os.close(held["fd"])
                held.update(record=body.get("record"), fd=fds[0])
            elif cmd == "fetch" and held["fd"] is not None:
                reply["record"] = held["record"]
                out = [os.dup(held["fd"])]
            elif cmd == "drop" and held["fd"] is not None:
                os.close(held["fd"])
                held.update(record=None, fd=None)
            elif cmd in ("status", "exit"):
                pass
            else:
                reply = {"ok": False, "error": f"cannot {cmd} with {len(fds)} fds (holding: {held['fd'] is not None})"}
                for fd in fds:
                    os.close(fd)
            reply.update(holding=held["fd"] is not None, libcuda_mapped=libcuda_mapped(),
                         modules=sorted(m for m in sys.modules if "cuda" in m or m == "torch"))
            _send(conn, reply, out)
            for fd in out:
                os.close(fd)
            if cmd == "exit":
                return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
