"""Every dtype safetensors and torch share, served through the CUDA arena
byte for byte (issue 29, the GPU half of tests/unit/test_dtypes_served.py).

One checkpoint (``fixtures.dtype_ckpt``: every dtype of
:func:`pgbase.dtypes.shared`, the installed libraries' own table, in odd
shapes: empty, a zero dimension, scalar, one element, odd lengths) goes

- through the raw fill into a CUDA arena and the CUDA transport's attach in
  this process, one row per dtype (a row names the dtype that fails);
- through a real daemon (``preload --stage raw --transport cuda``) and an
  attach over its socket, all dtypes at once;

and each tensor must be on the GPU with ``safe_open``'s torch dtype, shape
and bytes. Bytes are compared through ``uint8`` views (some dtypes,
``float4_e2m1fn_x2``, have no copy kernels). Skipped where CUDA is not
available (conftest).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gpu_support import running_daemon

from fixtures.dtype_ckpt import assert_served_equal, library_tensors, write_checkpoint
from pgbase import dtypes

pytestmark = pytest.mark.gpu

SHARED = sorted(dtypes.shared())


def _on_gpu(tensors: dict) -> None:
    assert all(t.is_cuda for t in tensors.values()), {n: t.device for n, t in tensors.items()}


@pytest.mark.parametrize("code", SHARED)
def test_raw_fill_and_cuda_attach_equal_safe_open(tmp_path: Path, code: str) -> None:
    from preload.daemon.raw import fill_raw
    from preload.transports.cuda import CudaTransport

    ckpt = write_checkpoint(tmp_path / "ckpt", [code])
    want = library_tensors(ckpt)
    transport = CudaTransport(0)
    filled = fill_raw(ckpt, transport, None)
    try:
        fds = [os.dup(fd) for fd in filled.arena.fds()]  # attach takes ownership
        att = transport.attach(filled.arena.descriptor(), fds, filled.layout, writable=False)
        try:
            _on_gpu(att.tensors)
            assert_served_equal(att.tensors, want)
        finally:
            att.close()
    finally:
        filled.arena.close()


def test_a_cuda_daemon_serves_every_shared_dtype_as_safe_open_loads_it(tmp_path: Path) -> None:
    from preload.client import DaemonClient
    from preload.daemon.raw import raw_key

    ckpt = write_checkpoint(tmp_path / "ckpt", SHARED)
    want = library_tensors(ckpt)
    assert {n.split(".")[0] for n in want} == {c.lower() for c in SHARED}
    with running_daemon(ckpt) as ready:
        client = DaemonClient.connect(ready["socket_dir"], 0, client="gpu-dtypes")
        try:
            state = client.get_state(raw_key(str(ckpt), ready["digest"], "cuda"))
            att = state.attach(writable=False)
            try:
                _on_gpu(att.tensors)
                assert_served_equal(att.tensors, want)
            finally:
                att.close()
        finally:
            client.close()
