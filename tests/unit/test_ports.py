"""pgbase.ports.free_port: a port chosen now and bound minutes later by another
process must not be one the kernel hands out to every bind(0) meanwhile (CI
lost a replica to EADDRINUSE that way, 10 minutes after its port was chosen)."""

from __future__ import annotations

import socket

import pytest

from pgbase import ports

pytestmark = pytest.mark.unit


def test_the_range_is_read_from_the_kernel_file(tmp_path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(str(f)) == (40000, 50000)
    assert ports.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)


def test_chosen_ports_lie_outside_the_ephemeral_range() -> None:
    low, high = ports.ephemeral_range()
    chosen = {ports.free_port() for _ in range(50)}
    assert not any(low <= p <= high for p in chosen), sorted(chosen)
    assert len(chosen) > 40  # random, so two callers rarely collide


def test_control_a_kernel_assigned_port_is_inside_it() -> None:
    """What free_port did before: bind(0) draws from the range every other
    process draws from too."""
    low, high = ports.ephemeral_range()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert low <= s.getsockname()[1] <= high


def _offer_first(monkeypatch, taken: int) -> list[int]:
    """Candidates become [10000, taken]: ``taken`` is offered first (each time
    the list of offers is empty), then random others; returns that list."""
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (taken + 1, 65535))
    offered: list[int] = []
    real = ports.secrets.randbelow

    def draw(n: int) -> int:
        k = taken - 10000 if not offered else real(n)
        offered.append(10000 + k)
        return k

    monkeypatch.setattr(ports.secrets, "randbelow", draw)
    return offered


def test_a_taken_port_is_never_returned(monkeypatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        offered = _offer_first(monkeypatch, taken)
        port = ports.free_port()
    assert offered[0] == taken and len(offered) >= 2
    assert port != taken and port == offered[-1]


def test_no_room_outside_falls_back_to_the_kernel(monkeypatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (10000, 65535))
    monkeypatch.setattr(ports.secrets, "randbelow", lambda n: pytest.fail("no candidate range, nothing to draw"))
    assert 0 < ports.free_port() < 65536


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")


@needs_ipv6
def test_an_ipv6_host_gets_a_port_checked_on_ipv6(monkeypatch) -> None:
    """free_port("::1") used to bind an IPv4 socket to "::1" (which always
    fails), so it fell through to an IPv4 bind(0) and raised."""
    low, high = ports.ephemeral_range()
    port = ports.free_port("::1")
    assert not low <= port <= high
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", port))


@needs_ipv6
def test_a_port_taken_on_ipv6_is_never_returned_for_ipv6(monkeypatch) -> None:
    """The check binds on the host's own family: a port held on ::1 only is
    taken for "::1" (control: for 127.0.0.1 the same port is free, and offered)."""
    with socket.socket(socket.AF_INET6) as held:
        held.bind(("::1", 0))
        taken = held.getsockname()[1]
        offered = _offer_first(monkeypatch, taken)
        port = ports.free_port("::1")
        assert offered[0] == taken and port != taken
        offered.clear()
        assert ports.free_port("127.0.0.1") == taken, "control: on IPv4 the port is free"


def test_a_host_that_does_not_resolve_is_one_clear_error() -> None:
    from pgbase.errors import PreflightError

    with pytest.raises(PreflightError, match="does not resolve"):
        ports.free_port("no-such-host.invalid")
