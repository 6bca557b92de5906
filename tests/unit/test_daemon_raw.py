"""The raw-stage daemon end to end, without vLLM: serve, attach across
processes, prove bytes, refuse what does not prove, lock, take over, watch."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from daemon_support import REPO, Daemon, copy_checkpoint, short_dir
from prometheus_client.exposition import choose_encoder
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

from canaries.claims import parse_metrics
from canaries.errors import GoldenError
from pgbase.errors import CacheKeyMismatchError, InsecureSocketError
from pgbase.shards import shard_paths
from preload import protocol
from preload.client import DaemonClient, Watch
from preload.daemon.health import HealthServer
from preload.daemon.raw import raw_key
from preload.promote import promote

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="daemon_raw")]

ATTACH_SCRIPT = r"""
import hashlib, json, sys
from preload.client import DaemonClient
from preload.daemon.raw import raw_key
ckpt, sdir, digest = sys.argv[1:4]
c = DaemonClient.connect(sdir, 0)
state = c.get_state(raw_key(ckpt, digest, "shm"))
att = state.attach()
out = {n: [str(t.dtype), list(t.shape), hashlib.sha256(t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()).hexdigest()]
       for n, t in att.tensors.items()}
print(json.dumps({"tensors": out, "digest": state.digest, "daemon_id": state.daemon_id}))
"""


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    import hashlib

    return {n: [str(t.dtype), list(t.shape), hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]
            for n, t in tensors.items()}


@pytest.fixture
def spawn():
    """``spawn(Daemon(...))`` registers a daemon to be stopped whatever the test does."""
    started: list[Daemon] = []

    def register(d: Daemon) -> Daemon:
        started.append(d)
        return d

    yield register
    for d in started:
        d.stop()


@pytest.fixture(scope="module")
def served(tiny_ckpt, tmp_path_factory):
    root, cache = short_dir(), tmp_path_factory.mktemp("cache")
    ckpt = copy_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("served") / "ckpt")
    promote(ckpt, socket_root=root, cache_dir=cache)
    d = Daemon(ckpt, root, cache, ("--stage", "raw", "--health-port", "0")).start()
    yield d
    d.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_ready_line_names_digest_dir_and_ranks(served):
    r = served.ready
    assert r["event"] == "ready" and r["pid"] == served.proc.pid
    assert r["socket_dir"].endswith(r["digest"][:16])
    assert [x["global_rank"] for x in r["ranks"]] == [0]
    assert oct(os.stat(served.socket_dir).st_mode & 0o777) == "0o700"
    assert oct(os.stat(r["ranks"][0]["socket"]).st_mode & 0o777) == "0o600"


def test_attach_in_another_process_equals_safetensors(served):
    """Values the engine maps equal safetensors' own load, tensor by tensor."""
    out = subprocess.run(
        [sys.executable, "-c", ATTACH_SCRIPT, str(served.checkpoint), str(served.socket_dir), served.ready["digest"]],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=True,
    )
    got = json.loads(out.stdout)
    want = {}
    for p in shard_paths(served.checkpoint):
        want.update(_digests(load_file(p)))
    assert got["tensors"] == want
    assert got["digest"] == served.ready["digest"]


def test_engine_write_to_mapping_leaves_daemon_copy(served):
    ckpt, sdir, digest = served.checkpoint, served.socket_dir, served.ready["digest"]
    c = DaemonClient.connect(sdir, 0)
    try:
        first = c.get_state(raw_key(ckpt, digest, "shm")).attach()
        name = next(iter(first.tensors))
        original = first.tensors[name].clone()
        first.tensors[name].fill_(3)
        second = c.get_state(raw_key(ckpt, digest, "shm")).attach()
        assert torch.equal(second.tensors[name], original)
        assert not torch.equal(first.tensors[name], original)  # control: the write happened
    finally:
        c.close()


def test_key_mismatch_names_fields(served):
    import dataclasses

    key = dataclasses.replace(raw_key(served.checkpoint, served.ready["digest"], "shm"), dtype="float16", tp_size=2)
    c = DaemonClient.connect(served.socket_dir, 0)
    try:
        with pytest.raises(CacheKeyMismatchError) as err:
            c.get_state(key)
        assert err.value.fields == ["dtype", "tp_size"]
        stats = c.stats()
        assert stats["misses"].get("key_mismatch:dtype,tp_size", 0) >= 1
    finally:
        c.close()


def _raw_exchange(path: Path, data: bytes) -> dict | None:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(str(path))
    try:
        s.sendall(data)
        frame = protocol.recv_frame(s, 10, idle_s=10)
        return None if frame is None else frame.body
    except (OSError, protocol.ProtocolError):
        return None
    finally:
        s.close()


@pytest.mark.parametrize("data", [
    struct.pack(">I", 5) + b"{oops",
    struct.pack(">I", protocol.MAX_FRAME_BYTES + 7),
    protocol.encode({"cmd": "rm -rf"}),
    protocol.encode({"cmd": "get_state", "key": {"content_digest": 5}}),
    protocol.encode({"cmd": "hello", "protocol": 99, "client": "x"}),
])
def test_bad_frames_get_an_error_and_the_daemon_lives(served, data):
    path = Path(served.ready["ranks"][0]["socket"])
    reply = _raw_exchange(path, data)
    assert reply is None or reply["status"] == "error"
    c = DaemonClient.connect(served.socket_dir, 0)  # still serving
    assert c.hello["daemon_id"] == served.ready["ranks"][0]["daemon_id"]
    c.close()


def test_slow_client_does_not_block_others(served):
    path = Path(served.ready["ranks"][0]["socket"])
    slow = socket.socket(socket.AF_UNIX)
    slow.connect(str(path))
    slow.sendall(b"\x00\x00")  # half a header, then silence
    try:
        c = DaemonClient.connect(served.socket_dir, 0)
        c.stats()
        c.close()
        # Served while the slow one is still held open, not yet cut off by its
        # deadline: a daemon serving one client at a time would have had to
        # cut it first (which sends it an error and closes it).
        with pytest.raises(BlockingIOError):
            slow.recv(4096, socket.MSG_DONTWAIT)
    finally:
        slow.close()


def test_metrics_scrape_parses_with_prometheus_client(served):
    """The live /metrics is exposition prometheus_client reads back: the six
    families dashboards use, their types and labels, this daemon's digest."""
    url = served.ready["health"] + "/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        # What prometheus_client's own server answers a request with no Accept header.
        assert resp.headers["Content-Type"] == choose_encoder("")[1]
        text = resp.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # The parser names a counter family without ``_total``; its samples keep it.
    assert {n: f.type for n, f in families.items()} == {
        "preload_gate_rank_up": "gauge", "preload_gate_rank_busy": "gauge",
        "preload_gate_hits": "counter", "preload_gate_misses": "counter",
        "preload_gate_attach_failures": "counter", "preload_gate_attached_engines": "gauge", "preload_gate_resident_bytes": "gauge",
        "preload_gate_load_seconds": "gauge",
        # Where the arena came from and went (issue 26: the fd store).
        "preload_gate_adopted": "counter", "preload_gate_proof_failed": "counter",
        "preload_gate_loaded_from_disk": "counter", "preload_gate_evicted": "counter",
    }
    rank0, digest = served.ready["ranks"][0], served.ready["digest"]
    base = {"rank": "0", "digest": digest}
    arena = {n: [s.value for s in families[f"preload_gate_{n}"].samples if s.name.endswith("_total")]
             for n in ("adopted", "proof_failed", "loaded_from_disk", "evicted")}
    assert arena == {"adopted": [0], "proof_failed": [0], "loaded_from_disk": [1], "evicted": [0]}, arena
    [up] = families["preload_gate_rank_up"].samples
    assert (up.name, up.labels, up.value) == ("preload_gate_rank_up", {"socket": rank0["socket"], **base}, 1)
    assert [(s.name, s.labels) for s in families["preload_gate_hits"].samples] == [("preload_gate_hits_total", base)]
    [resident] = families["preload_gate_resident_bytes"].samples
    assert (resident.labels, resident.value) == (base, rank0["bytes"])
    assert parse_metrics(text, url).digest == digest

    # A rank that does not answer is rank_up 0 labelled by its socket alone, and no claim.
    missing = str(served.socket_dir / "rank9.sock")
    h = HealthServer("127.0.0.1", 0, [rank0["socket"], missing])
    h.start()
    try:
        two = urllib.request.urlopen(f"http://127.0.0.1:{h.port}/metrics", timeout=10).read().decode()
    finally:
        h.stop()
    ups = {s.labels["socket"]: (s.labels, s.value)
           for f in text_string_to_metric_families(two) if f.name == "preload_gate_rank_up" for s in f.samples}
    assert ups == {rank0["socket"]: ({"socket": rank0["socket"], **base}, 1), missing: ({"socket": missing}, 0)}
    assert parse_metrics(two, url).digest == digest

    # Control: one broken line anywhere (here not even a rank_up line) fails the parse, and
    # the canary refuses the claim instead of reading past it as the regex parser did.
    lines = text.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("preload_gate_hits_total{"))
    lines[i] = lines[i].rsplit(" ", 1)[0] + " many"
    broken = "\n".join(lines) + "\n"
    with pytest.raises(ValueError):
        list(text_string_to_metric_families(broken))
    with pytest.raises(GoldenError, match="not Prometheus text exposition"):
        parse_metrics(broken, url)


def test_health_and_metrics(served):
    url = served.ready["health"]
    assert urllib.request.urlopen(url + "/health", timeout=10).status == 200
    metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    assert f'digest="{served.ready["digest"]}"' in metrics
    assert "preload_gate_hits_total" in metrics and "preload_gate_resident_bytes" in metrics
    # Control: a rank that does not answer turns /health into 503.
    h = HealthServer("127.0.0.1", 0, [served.ready["ranks"][0]["socket"], str(served.socket_dir / "rank9.sock")])
    h.start()
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{h.port}/health", timeout=10)
        assert err.value.code == 503
    finally:
        h.stop()


def test_status_lists_the_daemon(served):
    out = subprocess.run(
        [sys.executable, "-m", "preload_gate.cli", "status", "--socket-root", str(served.root), "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=True,
    )
    ranks = json.loads(out.stdout)["ranks"]
    assert [(r["digest"], r["rank"], r["serving"]) for r in ranks] == [(served.ready["digest"], 0, True)]
    assert ranks[0]["resident_bytes"] == served.ready["ranks"][0]["bytes"]


def test_second_daemon_for_the_same_rank_fails_fast(served, spawn):
    start = time.monotonic()
    second = spawn(Daemon(served.checkpoint, served.root, served.cache)).start(expect_ready=False, timeout=60)
    assert second.proc.returncode != 0
    assert "already serves rank 0" in second.output
    # It exits on its own, well before start() would stop it (60 s): the
    # bound covers interpreter + torch start on a loaded 2-core machine; a
    # daemon that waited on the rank lock instead would run to the 60 s.
    assert time.monotonic() - start < 30
    c = DaemonClient.connect(served.socket_dir, 0)  # the first is untouched
    assert c.hello["daemon_id"] == served.ready["ranks"][0]["daemon_id"]
    c.close()


def test_refuses_bytes_that_do_not_hash_to_the_promoted_digest(tiny_ckpt, tmp_path, spawn):
    root, cache = short_dir(), tmp_path / "cache"
    ckpt = copy_checkpoint(tiny_ckpt, tmp_path / "ckpt")
    promoted = promote(ckpt, socket_root=root, cache_dir=cache)
    shard = shard_paths(ckpt)[0]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # one byte of the last tensor: the header is untouched
    shard.write_bytes(bytes(data))
    try:
        # The write changed the shard's stat: the manifest is stale, refused before a byte is read.
        stale = spawn(Daemon(ckpt, root, cache)).start(expect_ready=False)
        assert stale.proc.returncode == 2 and f"is stale: shard {shard.name} changed" in stale.output
        # Pinned to the promoted digest (no stat check), the bytes themselves are refused.
        d = spawn(Daemon(ckpt, root, cache, ("--stage", "raw", "--expect-digest", promoted.digest)))
        d.start(expect_ready=False)
        assert d.proc.returncode == 2
        assert "refusing to serve" in d.output and f"differs from the manifest: {shard.name}" in d.output
        assert not promoted.socket_dir.exists()  # no socket, no lock: nothing left (the empty dir too)
        # Control: promoting the new bytes makes the same daemon serve.
        promote(ckpt, socket_root=root, cache_dir=cache)
        ok = spawn(Daemon(ckpt, root, cache)).start()
        assert ok.ready["digest"] != promoted.digest
        ok.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_expect_digest_mismatch_refuses(tiny_ckpt, tmp_path, spawn):
    root = short_dir()
    try:
        d = spawn(Daemon(tiny_ckpt, root, tmp_path / "c", ("--stage", "raw", "--expect-digest", "ab" * 32)))
        d.start(expect_ready=False)
        assert d.proc.returncode == 2 and "not the expected abababab" in d.output
        assert not any((root / ("ab" * 8)).glob("*.sock"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_stale_socket_is_taken_over_and_clean_stop_removes_it(tiny_ckpt, tmp_path, spawn):
    root, cache = short_dir(), tmp_path / "cache"
    try:
        first = spawn(Daemon(tiny_ckpt, root, cache, ("--stage", "raw", "--identity", "full"))).start()
        sock = Path(first.ready["ranks"][0]["socket"])
        first.kill_hard()
        assert sock.exists()  # the crash left its socket behind
        with pytest.raises(ConnectionRefusedError):
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(str(sock))
            finally:
                s.close()
        second = spawn(Daemon(tiny_ckpt, root, cache, ("--stage", "raw", "--identity", "full"))).start()
        c = DaemonClient.connect(second.socket_dir, 0)
        assert c.hello["daemon_id"] == second.ready["ranks"][0]["daemon_id"] != first.ready["ranks"][0]["daemon_id"]
        c.close()
        assert second.stop() == 0
        assert not second.socket_dir.exists()  # socket, lock and the emptied directory removed
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_watch_close_is_daemon_loss(tiny_ckpt, tmp_path, spawn):
    root = short_dir()
    try:
        d = spawn(Daemon(tiny_ckpt, root, tmp_path / "c", ("--stage", "raw", "--identity", "full"))).start()
        lost = threading.Event()
        w = Watch.open(d.socket_dir, 0, lost.set)
        c = DaemonClient.connect(d.socket_dir, 0)
        assert c.stats()["attached"] == 1
        c.close()
        assert not lost.wait(1.0)  # control: a live daemon is not reported lost
        d.stop()
        assert lost.wait(10.0)
        w.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_client_refuses_symlinked_socket_and_open_dir(served, tmp_path):
    d = short_dir()
    try:
        os.chmod(d, 0o700)
        os.symlink(served.ready["ranks"][0]["socket"], d / "rank0.sock")
        with pytest.raises(InsecureSocketError, match="symlink"):
            DaemonClient.connect(d, 0)
        os.chmod(d, 0o755)
        with pytest.raises(InsecureSocketError, match="group/world"):
            DaemonClient.connect(d, 0)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_peer_uid_check(monkeypatch):
    from preload import sockets

    a, b = socket.socketpair(socket.AF_UNIX)
    try:
        sockets.verify_peer(a)  # control: our own uid passes
        real = os.getuid()
        monkeypatch.setattr(sockets.os, "getuid", lambda: real + 1)
        with pytest.raises(InsecureSocketError, match=f"uid {real}"):
            sockets.verify_peer(a)
    finally:
        a.close()
        b.close()
