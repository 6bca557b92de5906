"""Every path that opens shard files stays inside RLIMIT_NOFILE or is refused before the first.

Each test runs its path in a subprocess whose soft (and hard) open-file
limit is set to what it holds at that moment plus a number taken from
:mod:`preload.budget`, on a synthetic checkpoint of 300 shards (the daemon
used to keep one file open per shard: 1,500 shards under ``ulimit -n`` 1024
failed with "No such file or directory"). The kernel is the measuring
instrument: a path that needs one descriptor more than counted fails.

- raw stage: loads within its reservation; the load's own count
  (``load_open_files("raw")``) is exact: one fewer fails, naming the
  limit; one fewer than the reservation is refused before a shard is opened
  (an audit hook counts the opens), or the soft limit is raised where the
  hard one allows, saying so.
- promote (``hash_shards``): sizes its pool to the room, asked for 64 workers.
- the engine side: the restart stat check opens no shard; an attach at the
  limit names the limit (the kernel drops the memfd: MSG_CTRUNC; or the
  mapping's duplicate fails), with ``attach_open_files()`` it attaches.
- a daemon whose connections outgrow the limit keeps serving.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time

import pytest
from daemon_support import REPO, Daemon, repo_pythonpath, short_dir
from fd_limit_support import PRELUDE, run_child

from harness.bench.synthetic import write_synthetic
from preload.budget import attach_open_files
from preload.daemon.ready import READY, stop_daemon, wait_ready
from preload.identity.digest import content_digest
from preload.promote import promote

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="open_file_budget")]

SHARDS = 300

RAW = PRELUDE + r"""
from preload import budget
from preload.daemon import raw
from preload.daemon.server import MAX_CONNECTIONS
from preload.transports import get_transport
ckpt, mode, extra = sys.argv[1], sys.argv[2], int(sys.argv[3])
transport = get_transport("shm")
raw.fill_raw  # (everything imported before the limit drops)
if mode == "measure":  # the load's own count: the reservation is skipped, the limit is the count
    raw.reserve_open_files = lambda need, what, want=None: 0
    limit_to(budget.load_open_files("raw") + extra)
elif mode == "raise":  # soft below the reservation, hard above it
    need, want = budget.rank_open_files(MAX_CONNECTIONS, "raw")
    limit_to(need - 1, hard_extra=want)
else:
    limit_to(budget.rank_open_files(MAX_CONNECTIONS, "raw")[0] + extra)
try:
    filled = raw.fill_raw(ckpt, transport, None)
    report(ok=True, digest=filled.digest, soft=resource.getrlimit(resource.RLIMIT_NOFILE)[0])
except Exception as exc:
    report(ok=False, error=str(exc), type=type(exc).__name__)
"""

HASH = PRELUDE + r"""
from pgbase.shards import shard_paths
from preload.identity.digest import checkpoint_digest, hash_shards
ckpt = sys.argv[1]
paths = shard_paths(ckpt, prefer_vllm=False)
limit_to(int(sys.argv[2]))
try:
    report(ok=True, digest=checkpoint_digest(hash_shards(paths, workers=64, progress=False)))
except Exception as exc:
    report(ok=False, error=str(exc))
"""

STAT = PRELUDE + r"""
from preload.identity.manifest import check_fresh, load_manifest
ckpt = sys.argv[1]
manifest = load_manifest(ckpt)
limit_to(1)  # io_uring's ring, if the kernel gives one; the thread pool needs none
try:
    check_fresh(ckpt, manifest)
    report(ok=True)
except Exception as exc:
    report(ok=False, error=str(exc))
"""

ATTACH = PRELUDE + r"""
from preload.client import DaemonClient
from preload.daemon.raw import raw_key
import preload.transports.shm  # (imported before the limit drops, as an engine has it by then)
ckpt, sdir, digest, give = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
c = DaemonClient.connect(sdir, 0)
key = raw_key(ckpt, digest, "shm")
limit_to(give)
try:
    state = c.get_state(key)
    att = state.attach()
    report(ok=True, tensors=len(att.tensors))
except Exception as exc:
    report(ok=False, error=str(exc), type=type(exc).__name__)
"""


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("many") / "ckpt"
    write_synthetic(ckpt, shards=SHARDS, shard_bytes=1 << 10, tensors_per_shard=2)
    return ckpt, content_digest(ckpt)


def test_raw_stage_loads_every_shard_within_its_reservation(many):
    ckpt, digest = many
    got, _ = run_child(RAW, ckpt, "daemon", 0)
    assert got["ok"], got
    assert got["digest"] == digest
    assert got["shard_opens"] == 2 * SHARDS  # each shard opened for its header, then for its data


@pytest.mark.parametrize("extra,ok", [(0, True), (-1, False)], ids=["the count", "one fewer"])
def test_the_load_holds_exactly_what_is_counted(many, extra, ok):
    """The load's own descriptors, measured by the kernel: with room for
    ``load_open_files("raw")`` it loads; with one fewer it fails, and the
    failure names the open-file limit (not "No such file or directory")."""
    ckpt, digest = many
    got, _ = run_child(RAW, ckpt, "measure", extra)
    assert got["ok"] is ok, got
    if not ok:
        assert "open-file limit" in got["error"] and "ulimit -n" in got["error"], got
        assert "No such file" not in got["error"], got


def test_refused_before_the_first_shard_when_the_limit_is_too_low(many):
    ckpt, _ = many
    got, _ = run_child(RAW, ckpt, "daemon", -1)
    assert not got["ok"] and got["type"] == "PreflightError", got
    for word in ("RLIMIT_NOFILE", "ulimit -n", "LimitNOFILE=", "raw stage", f"{SHARDS} shards"):
        assert word in got["error"], (word, got)
    assert got["shard_opens"] == 0, got


def test_soft_limit_raised_up_to_the_hard_one_saying_so(many):
    ckpt, digest = many
    got, stderr = run_child(RAW, ckpt, "raise", 0)
    assert got["ok"] and got["digest"] == digest, got
    assert "raised this process's open-file soft limit" in stderr, stderr


def test_promote_hashing_sizes_its_pool_to_the_limit(many):
    """64 workers asked for, room for 4 files: hashed all the same (the pool
    used to open one shard per worker and fail with EMFILE)."""
    ckpt, digest = many
    got, _ = run_child(HASH, ckpt, 4)
    assert got == {"ok": True, "digest": digest, "shard_opens": SHARDS}, got
    # Control: no room at all is refused by name, before a shard is opened.
    got, _ = run_child(HASH, ckpt, 0)
    assert not got["ok"] and "open-file limit" in got["error"] and got["shard_opens"] == 0, got


def test_engine_restart_check_opens_no_shard(many, tmp_path):
    ckpt, _ = many
    promote(ckpt, socket_root=short_dir(), cache_dir=tmp_path)
    got, _ = run_child(STAT, ckpt, cache=tmp_path)
    assert got == {"ok": True, "shard_opens": 0}, got


def test_attach_at_the_limit_names_it(tmp_path):
    ckpt = tmp_path / "small"
    write_synthetic(ckpt, shards=4, shard_bytes=4 << 10)
    root, cache = short_dir(), tmp_path / "cache"
    promote(ckpt, socket_root=root, cache_dir=cache)
    d = Daemon(ckpt, root, cache).start()
    try:
        sdir, digest = d.ready["socket_dir"], d.ready["digest"]
        got, _ = run_child(ATTACH, ckpt, sdir, digest, 0, cache=cache)
        assert not got["ok"], got
        assert "open-file limit" in got["error"] and "descriptors sent with a frame were dropped" in got["error"], got
        # Room for the memfd, none for the mapping's duplicate: named too.
        got, _ = run_child(ATTACH, ckpt, sdir, digest, 1, cache=cache)
        assert not got["ok"] and "open-file limit" in got["error"] and "cannot map" in got["error"], got
        # Control: room for what attach_open_files counts, and it attaches.
        got, _ = run_child(ATTACH, ckpt, sdir, digest, attach_open_files(), cache=cache)
        assert got["ok"] and got["tensors"] == 16, got
    finally:
        d.stop()


def _hello(path: str) -> dict:
    from preload import protocol

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        protocol.send_frame(s, protocol.hello_request("test", os.getpid()), (), 10)
        frame = protocol.recv_frame(s, 10)
        assert frame is not None
        return frame.body


def test_daemon_keeps_serving_when_connections_outgrow_the_limit(tmp_path):
    """A rank under a low limit caps its connections to the room and says so;
    more connections than that are closed, never the accept loop (which used
    to end on the first EMFILE: every later engine hung in the backlog)."""
    ckpt = tmp_path / "small"
    write_synthetic(ckpt, shards=4, shard_bytes=4 << 10)
    root, cache = short_dir(), tmp_path / "cache"
    promote(ckpt, socket_root=root, cache_dir=cache)

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))

    err = open(tmp_path / "daemon.err", "wb")
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "PRELOAD_GATE_CACHE": str(cache)}
    # The limit is set on the launcher; the rank it starts inherits it.
    proc = subprocess.Popen([sys.executable, "-m", "preload_gate", "preload", str(ckpt), "--socket-root", str(root),
                             "--stage", "raw"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                            env=env, cwd=REPO, preexec_fn=low)
    try:
        ready = wait_ready(proc, READY, 120)
        sock = ready["ranks"][0]["socket"]
        idle = []
        for _ in range(60):  # far past what 32 descriptors hold
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(sock)
            idle.append(s)
        time.sleep(0.5)
        for s in idle:
            s.close()
        time.sleep(0.5)
        assert _hello(sock)["status"] == "ok"
    finally:
        stop_daemon(proc, 30)
        err.close()
    log = (tmp_path / "daemon.err").read_text()
    assert "the open-file limit leaves room for" in log and "LimitNOFILE=" in log, log[-2000:]
