"""Every dtype safetensors and torch share is served byte for byte (issue 29).

The dtypes are the installed libraries' (:mod:`pgbase.dtypes`, built from
safetensors' and torch's own tables), not a list of ours: a dtype a new
release adds is served here without a change to this file. For each one a
checkpoint written by ``safetensors.torch.save_file`` with odd shapes (empty,
a zero dimension, scalar, one element, odd lengths) goes

- through the raw fill and the shm arena's attach in this process, one row
  per dtype (a row names the dtype that fails);
- through a real raw-stage daemon (promote, ``preload-gate preload --stage
  raw``, attach over its socket), all dtypes in one checkpoint;

and every tensor must equal ``safe_open(framework="pt").get_tensor``: the
same torch dtype, the same shape, the same bytes. A dtype safetensors knows
and torch has no type for (``F6_E2M3`` in safetensors 0.8) is refused at
``promote`` in one line naming the tensor, the dtype and both versions, exit
2, nothing written; its control, the same bytes as ``U8``, promotes.

Before issue 29 the arena's hand-written table of 12 dtypes refused
``float8_e8m0fnu`` (the block scales of MX checkpoints) with "unsupported
dtype", and the 10,000-file header test passed: it never went through an
arena.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import torch
from daemon_support import REPO, Daemon, short_dir
from safetensors import safe_open
from safetensors.torch import save_file

from fixtures.dtype_ckpt import assert_served_equal, library_tensors, sample, write_checkpoint
from fixtures.shardfile import RawTensor, write_shard
from pgbase import dtypes
from preload.checksum import tensor_checksum
from preload.client import DaemonClient
from preload.daemon.raw import fill_raw, raw_key
from preload.promote import promote
from preload.transports.shm import ShmTransport

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="dtypes_served")]

SHARED = dict(dtypes.shared())
# safetensors codes torch has no type for, in the installed versions.
UNSHARED = [c for c in dtypes.safetensors_codes() if c not in SHARED]


def test_the_table_is_what_both_libraries_share():
    """Every torch dtype safetensors writes is in the table, read back as
    itself by safe_open; every float8 variant and e8m0 (MX scales) among them."""
    floats8 = {
        v
        for v in vars(torch).values()
        if isinstance(v, torch.dtype) and str(v).startswith("torch.float8")
    }
    assert floats8 and floats8 <= {d.torch for d in SHARED.values()}
    assert SHARED["F8_E8M0"].torch == torch.float8_e8m0fnu
    assert set(SHARED) <= set(dtypes.safetensors_codes())
    for code, d in SHARED.items():
        assert d.bits * d.per_element == 8 * d.itemsize == 8 * d.torch.itemsize, code
        assert dtypes.by_name(d.name) is d and dtypes.by_torch(d.torch) is d
    # The other direction: a torch dtype save_file stores and safe_open reads
    # back as itself is one the table has (the table misses none).
    scratch = Path(short_dir("pg-dt-"))
    try:
        for dt in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
            try:
                save_file({"t": torch.empty((0,), dtype=dt)}, str(scratch / "t.safetensors"))
            except Exception:
                continue  # safetensors does not store this torch dtype
            with safe_open(str(scratch / "t.safetensors"), framework="pt") as f:
                assert f.get_tensor("t").dtype == dt
            assert dtypes.by_torch(dt).torch == dt, dt
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def test_an_unknown_wire_name_is_refused_naming_the_known_ones():
    with pytest.raises(
        ValueError, match=r"'float7'.*safetensors .*torch .*one of .*float8_e8m0fnu"
    ):
        dtypes.by_name("float7")


@pytest.mark.parametrize("code", sorted(SHARED))
def test_raw_fill_and_shm_attach_equal_safe_open(tmp_path, code):
    ckpt = write_checkpoint(tmp_path / "ckpt", [code])
    want = library_tensors(ckpt)
    transport = ShmTransport()
    filled = fill_raw(ckpt, transport, None)
    try:
        fds = [os.dup(fd) for fd in filled.arena.fds()]  # attach takes ownership
        att = transport.attach(filled.arena.descriptor(), fds, filled.layout, writable=False)
        try:
            assert_served_equal(att.tensors, want)
        finally:
            att.close()
    finally:
        filled.arena.close()


@pytest.mark.parametrize("code", sorted(SHARED))
def test_the_checksum_reads_every_shared_dtype_as_its_bytes(code):
    """The resident checksum sees a tensor of any shared dtype as its bytes
    (the same sum as its ``uint8`` view), and one flipped bit changes it."""
    d = SHARED[code]
    t = sample(d, (7,), seed=3)
    u8 = t.view(torch.uint8)
    assert tensor_checksum(t) == tensor_checksum(u8.clone())
    flipped = u8.clone()
    flipped[u8.numel() // 2] ^= 1
    assert tensor_checksum(flipped.view(d.torch)) != tensor_checksum(t)


@pytest.fixture(scope="module")
def every_dtype_daemon(tmp_path_factory):
    root, cache = short_dir(), tmp_path_factory.mktemp("cache")
    ckpt = write_checkpoint(tmp_path_factory.mktemp("all") / "ckpt", sorted(SHARED))
    promote(ckpt, socket_root=root, cache_dir=cache)
    d = Daemon(ckpt, root, cache, ("--stage", "raw")).start()
    yield d
    d.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_a_raw_daemon_serves_every_shared_dtype_as_safe_open_loads_it(every_dtype_daemon):
    d = every_dtype_daemon
    want = library_tensors(d.checkpoint)
    assert {n.split(".")[0] for n in want} == {c.lower() for c in SHARED}
    client = DaemonClient.connect(d.socket_dir, 0)
    try:
        state = client.get_state(raw_key(d.checkpoint, d.ready["digest"], "shm"))
        att = state.attach(writable=False)
        try:
            assert_served_equal(att.tensors, want)
        finally:
            att.close()
    finally:
        client.close()


def _promote_cli(ckpt: Path, base: Path) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PRELOAD_GATE_CACHE=str(base / "cache"),
        PRELOAD_GATE_SOCKET_ROOT=str(base / "sock"),
        PYTHONPATH=str(REPO),
    )
    return subprocess.run(
        [sys.executable, "-m", "preload_gate", "promote", str(ckpt), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=base,
    )


def _f6_checkpoint(root: Path, code: str, as_code: str | None = None) -> Path:
    """One tensor of eight ``code`` values (or their bytes as ``as_code``,
    the control), written byte for byte: torch cannot make one."""
    root.mkdir(parents=True)
    nbytes = dtypes.data_nbytes(code, (8,))
    data = bytes(range(1, nbytes + 1))
    t = RawTensor(code, (8,), data) if as_code is None else RawTensor(as_code, (nbytes,), data)
    write_shard(
        root / "model.safetensors", {"scales": RawTensor("F32", (2,), bytes(8)), "mx.weight": t}
    )
    return root


@pytest.mark.skipif(not UNSHARED, reason="the installed safetensors knows no dtype torch lacks")
@pytest.mark.parametrize("code", UNSHARED)
def test_promote_refuses_a_dtype_torch_has_no_type_for(tmp_path, code):
    ckpt = _f6_checkpoint(tmp_path / "ckpt", code)
    # The premise: the library accepts the file, and cannot load the tensor into torch.
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("mx.weight").get_dtype() == code
        with pytest.raises(Exception):  # noqa: B017 (any refusal of the library's)
            f.get_tensor("mx.weight")
    (tmp_path / "cache").mkdir()
    p = _promote_cli(ckpt, tmp_path)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    line = lines[0]
    for needle in (
        "'mx.weight'",
        code,
        f"safetensors {safetensors.__version__}",
        f"torch {torch.__version__}",
    ):
        assert needle in line, (needle, line)
    assert list((tmp_path / "cache").rglob("*")) == [], "promote wrote into the cache"
    # Control: the same bytes as U8 promote.
    ok = _promote_cli(_f6_checkpoint(tmp_path / "control", code, as_code="U8"), tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout)["digest"]
