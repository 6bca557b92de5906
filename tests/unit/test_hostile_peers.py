"""Hostile peers and tampered socket paths.

- A client running as another uid is rejected by the daemon's SO_PEERCRED
  check. The client keeps CAP_DAC_OVERRIDE (``setpriv --ambient-caps``), so
  the 0700 directory and 0600 socket do not stop it: the peer-uid check is
  the only thing left that can. The control is the very same client, same
  capability, as our own uid: accepted.
- A symlinked socket directory or socket, a group- or world-accessible
  directory, and a socket or directory owned by another user are each
  refused by the daemon (it will not start) and by the engine-side client
  (``preload.client.DaemonClient.connect``), with a control that the same
  path, repaired, works.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from reliability_support import (
    NOBODY,
    PEER_CLIENT,
    PYTHON,
    RawDaemon,
    fresh_checkpoint,
    promote_checkpoint,
    promoted_daemon,
    run_as,
    setpriv_reason,
    short_tempdir,
    skip_privileged,
)

from pgbase.errors import InsecureSocketError, WeightCacheUnavailableError
from preload.client import DaemonClient
from preload.identity.key import PROTOCOL_VERSION
from preload.sockets import socket_dir

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="reliability_hostile")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fresh_checkpoint(tmp_path_factory.mktemp("hostile") / "ckpt", seed=3)


@pytest.fixture(scope="module")
def daemon(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RawDaemon]:
    with promoted_daemon(ckpt, tmp_path_factory.mktemp("hostile-cache"), expect_digest=False) as d:
        yield d


def _peer(uid: int, sock: Path) -> dict:
    proc = run_as(uid, [PYTHON, "-c", PEER_CLIENT, str(sock), str(PROTOCOL_VERSION)])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _served(daemon: RawDaemon) -> bool:
    c = DaemonClient.connect(daemon.socket_dir, 0, client="control")
    try:
        return c.stats()["status"] == "ok"
    finally:
        c.close()


# ------------------------------------------------------------ other uids


def test_other_uid_rejected_by_peer_credentials(daemon: RawDaemon) -> None:
    reason = setpriv_reason()
    if reason:
        skip_privileged(f"cannot run a client as another uid here: {reason}")
    hostile = _peer(NOBODY, daemon.socket)
    assert hostile["uid"] == NOBODY
    # It reached the socket (the capability got it past the file modes)...
    assert hostile.get("connected") and "error" not in hostile, f"never reached the daemon: {hostile}"
    # ...and the daemon hung up on it without a word.
    assert hostile.get("closed") is True and "reply" not in hostile, hostile
    assert f"uid {NOBODY}" in daemon.stderr(), "the daemon should log whom it rejected"

    # Control: the same client, same capability, as the daemon's own uid.
    friend = _peer(os.getuid(), daemon.socket)
    assert friend.get("reply", {}).get("status") == "ok", friend
    assert friend["reply"]["digest"] == daemon.digest


def test_other_uid_without_capability_is_stopped_by_modes(daemon: RawDaemon) -> None:
    """Defence in depth: without CAP_DAC_OVERRIDE the 0700 directory alone
    keeps another uid out (EACCES at connect)."""
    reason = setpriv_reason()
    if reason:
        skip_privileged(f"cannot run a client as another uid here: {reason}")
    proc = run_as(NOBODY, [PYTHON, "-c", PEER_CLIENT, str(daemon.socket), str(PROTOCOL_VERSION)],
                  keep_dac_override=False)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "PermissionError" in out.get("error", ""), out


# ----------------------------------------------- engine-side client refusals


def _client_refuses(directory: Path, match: str) -> None:
    with pytest.raises(InsecureSocketError, match=match):
        DaemonClient.connect(directory, 0, timeout_s=2)


def test_client_refuses_symlinked_directory(daemon: RawDaemon) -> None:
    link_root = short_tempdir()
    try:
        link = link_root / "linked"
        link.symlink_to(daemon.socket_dir)
        _client_refuses(link, "symlinked socket directory")
        assert _served(daemon)  # control: the real directory works
    finally:
        shutil.rmtree(link_root)


def test_client_refuses_symlinked_socket(daemon: RawDaemon) -> None:
    other = short_tempdir()
    try:
        os.chmod(other, 0o700)
        (other / "rank0.sock").symlink_to(daemon.socket)
        _client_refuses(other, "symlinked socket")
    finally:
        shutil.rmtree(other)


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o750, 0o777])
def test_client_refuses_shared_directory(daemon: RawDaemon, mode: int) -> None:
    os.chmod(daemon.socket_dir, mode)
    try:
        _client_refuses(daemon.socket_dir, "group/world accessible")
    finally:
        os.chmod(daemon.socket_dir, 0o700)
    assert _served(daemon)


def test_client_refuses_socket_owned_by_another_user(daemon: RawDaemon) -> None:
    if os.geteuid() != 0:
        skip_privileged("chown to another uid needs root")
    os.chown(daemon.socket, NOBODY, NOBODY, follow_symlinks=False)
    try:
        _client_refuses(daemon.socket_dir, f"owned by uid {NOBODY}")
    finally:
        os.chown(daemon.socket, os.getuid(), os.getgid(), follow_symlinks=False)
    assert _served(daemon)


def test_client_refuses_directory_owned_by_another_user(daemon: RawDaemon) -> None:
    if os.geteuid() != 0:
        skip_privileged("chown to another uid needs root")
    os.chown(daemon.socket_dir, NOBODY, NOBODY)
    try:
        _client_refuses(daemon.socket_dir, f"owned by uid {NOBODY}")
    finally:
        os.chown(daemon.socket_dir, os.getuid(), os.getgid())
    assert _served(daemon)


def test_client_refusal_is_a_fallback_type(daemon: RawDaemon) -> None:
    """The loader decides fallback by type (preload.loader.verified_cache
    turns a WeightCacheUnavailableError at connect into a miss): what the
    client raises at a real untrusted socket is caught by that clause."""
    link_root = short_tempdir()
    try:
        link = link_root / "linked"
        link.symlink_to(daemon.socket_dir)
        try:
            DaemonClient.connect(link, 0, timeout_s=2)
        except WeightCacheUnavailableError as exc:  # the loader's clause
            caught: Exception | None = exc
        else:
            caught = None
        assert isinstance(caught, InsecureSocketError), repr(caught)
    finally:
        shutil.rmtree(link_root)


# ------------------------------------------------------- daemon refusals


def _daemon_in(ckpt: Path, tmp: Path, prepare) -> tuple[int, str, Path]:
    """Start a daemon after ``prepare(socket_root, digest_dir)`` tampered
    with its paths; returns (exit code, error, socket dir)."""
    sockets = short_tempdir()
    cache = tmp / "cache"
    digest = promote_checkpoint(ckpt, sockets, cache)
    sdir = socket_dir(digest, sockets)
    prepare(sockets, sdir)
    d = RawDaemon(ckpt, sockets, cache, expected_digest=digest)
    rc, err = d.start_failing()
    return rc, err, sdir


def _no_socket_served(sdir: Path) -> None:
    target = sdir.resolve() if sdir.exists() else sdir
    if target.is_dir():
        socks = [p for p in target.iterdir() if p.is_socket() and not p.is_symlink()]
        assert socks == [], f"a refused daemon left sockets: {socks}"


def test_daemon_refuses_symlinked_directory(ckpt: Path, tmp_path: Path) -> None:
    elsewhere = short_tempdir()

    def prepare(root: Path, sdir: Path) -> None:
        sdir.rmdir()
        sdir.symlink_to(elsewhere)

    try:
        rc, err, sdir = _daemon_in(ckpt, tmp_path, prepare)
        assert rc != 0 and "symlinked socket directory" in err, err
        assert list(elsewhere.iterdir()) == [], "the daemon wrote through the symlink"
    finally:
        shutil.rmtree(elsewhere)


@pytest.mark.parametrize("mode", [0o770, 0o705, 0o777])
def test_daemon_refuses_shared_directory(ckpt: Path, tmp_path: Path, mode: int) -> None:
    rc, err, sdir = _daemon_in(ckpt, tmp_path, lambda root, sdir: os.chmod(sdir, mode))
    assert rc != 0 and "group/world accessible" in err, err
    _no_socket_served(sdir)


def test_daemon_refuses_shared_socket_root(ckpt: Path, tmp_path: Path) -> None:
    rc, err, sdir = _daemon_in(ckpt, tmp_path, lambda root, sdir: os.chmod(root, 0o777))
    assert rc != 0 and "group/world accessible" in err, err
    _no_socket_served(sdir)


def test_daemon_refuses_directory_owned_by_another_user(ckpt: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        skip_privileged("chown to another uid needs root")
    rc, err, sdir = _daemon_in(ckpt, tmp_path, lambda root, sdir: os.chown(sdir, NOBODY, NOBODY))
    assert rc != 0 and f"owned by uid {NOBODY}" in err, err
    _no_socket_served(sdir)


def test_daemon_refuses_symlinked_socket(ckpt: Path, tmp_path: Path) -> None:
    """A symlink planted where the socket goes is tampering, not a stale
    socket: the daemon names it and does not start (nor follow it)."""
    decoy_dir = short_tempdir()
    decoy = decoy_dir / "victim"
    decoy.write_text("not yours")

    def prepare(root: Path, sdir: Path) -> None:
        (sdir / "rank0.sock").symlink_to(decoy)

    try:
        rc, err, sdir = _daemon_in(ckpt, tmp_path, prepare)
        assert rc != 0 and "symlink" in err, err
        assert decoy.read_text() == "not yours"
        assert (sdir / "rank0.sock").is_symlink(), "the daemon removed the evidence"
    finally:
        shutil.rmtree(decoy_dir)


def test_daemon_refuses_socket_owned_by_another_user(ckpt: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        skip_privileged("chown to another uid needs root")

    def prepare(root: Path, sdir: Path) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(sdir / "rank0.sock"))
        s.close()
        os.chown(sdir / "rank0.sock", NOBODY, NOBODY)

    rc, err, sdir = _daemon_in(ckpt, tmp_path, prepare)
    assert rc != 0 and f"owned by uid {NOBODY}" in err, err
    assert (sdir / "rank0.sock").lstat().st_uid == NOBODY, "the daemon replaced another user's socket"


def test_daemon_control_clean_directory_serves(ckpt: Path, tmp_path: Path) -> None:
    """Control for the refusals above: the same setup, untampered, serves."""
    with promoted_daemon(ckpt, tmp_path / "cache") as d:
        assert _served(d)


# ------------------------------------------------ nothing that runs code

# Calls that turn bytes into code or objects: a peer past the uid check
# (same user, a compromised engine) must still only be able to send data.
UNSAFE_CALLS = {
    ("pickle", "loads"), ("pickle", "load"), ("pickle", "Unpickler"), ("marshal", "loads"),
    ("torch", "load"), ("shelve", "open"), ("dill", "loads"), ("cloudpickle", "loads"),
}
UNSAFE_MODULES = {"pickle", "marshal", "shelve", "dill", "cloudpickle", "multiprocessing.connection"}


def _unsafe_uses(source: str, filename: str) -> list[str]:
    import ast

    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found += [f"{filename}:{node.lineno} imports {n}" for n in names if n in UNSAFE_MODULES]
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in UNSAFE_CALLS:
                found.append(f"{filename}:{node.lineno} calls {f.value.id}.{f.attr}")
            elif isinstance(f, ast.Name) and f.id in ("eval", "exec"):
                found.append(f"{filename}:{node.lineno} calls {f.id}")
    return found


def test_scan_catches_unpickling() -> None:
    """Control for the scan below."""
    src = "import pickle\nimport torch\ndef f(b):\n    torch.load(b)\n    eval(b)\n    return pickle.loads(b)\n"
    assert len(_unsafe_uses(src, "x.py")) == 4
    assert _unsafe_uses("import json\ndef f(m):\n    return m.eval()\n", "y.py") == []


def test_preload_never_unpickles() -> None:
    """The daemon, client, protocol and transports (everything a peer's bytes
    reach) neither import an unpickler nor evaluate anything."""
    from reliability_support import REPO

    hits = []
    for path in sorted((REPO / "preload").rglob("*.py")):
        hits += _unsafe_uses(path.read_text(), path.relative_to(REPO).as_posix())
    assert hits == [], "\n".join(hits)
