"""Loopback TCP ports chosen now and bound later, by another process.

A port found by binding port 0 comes from the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, ip(7)), and every other
``bind(0)`` and outgoing connection on the machine draws from that same
range: vLLM's ``get_open_port``, ZMQ, torch's TCPStore. Between choosing a
port and the server binding it (minutes, when an engine loads first), one of
those can take it, and the server dies with ``EADDRINUSE`` (seen in CI: the
promotion pipeline's printed ``serve`` command, 10 minutes after its port
was chosen). :func:`free_port` therefore chooses outside that range, where
nothing is handed out automatically, and checks the port is free by binding it
on the host and address family the server will bind (``::1`` is IPv6: a port
free on 127.0.0.1 may be taken there, and an IPv4 socket cannot bind it).
"""

from __future__ import annotations

import secrets
import socket

from pgbase.errors import PreflightError

# Below this, ports are commonly assigned to services (IANA "registered" low end).
_FLOOR = 10000
_ATTEMPTS = 200


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's ephemeral port range ``(low, high)``, inclusive (IPv6 draws
    from the same one, despite the name); Linux's default ``(32768, 60999)``
    when it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            low, high = (int(x) for x in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _family(host: str) -> socket.AddressFamily:
    """The address family ``host`` binds on (its first address, as a server's bind takes it)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise PreflightError(f"cannot choose a port on {host!r}: it does not resolve ({exc.strerror})") from None
    return infos[0][0]


def _bindable(family: socket.AddressFamily, host: str, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now and outside the ephemeral range.

    ``host`` is where the port will be bound (``"127.0.0.1"``, ``"::1"``, a
    name): the check binds there, on that host's address family.

    Chosen at random among ``[10000, low)`` and ``(high, 65535]`` of
    :func:`ephemeral_range`, so two callers rarely pick the same one; the
    first of up to 200 candidates that binds is returned. Falls back to a
    kernel-assigned port (``bind(0)``) when none does (a range reaching
    from 10000 to 65535 leaves no room).

    >>> 0 < free_port() < 65536
    True
    """
    family = _family(host)
    low, high = ephemeral_range()
    outside = [r for r in (range(_FLOOR, low), range(high + 1, 65536)) if len(r)]
    total = sum(len(r) for r in outside)
    for _ in range(_ATTEMPTS if total else 0):
        k = secrets.randbelow(total)
        for r in outside:
            if k < len(r):
                port = r[k]
                break
            k -= len(r)
        if _bindable(family, host, port):
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


__all__ = ["ephemeral_range", "free_port"]
