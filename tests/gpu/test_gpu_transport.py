"""Daemon and engine as separate processes over the cuda transport.

Memory claims are read from ``torch.cuda.mem_get_info`` (device-wide free
memory) in the engine process; each has a control that shows the same
measurement does see a copy when one is made.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpu_support import PROBE, probe, probe_env, running_daemon, spec_for

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def shared_daemon(synthetic_ckpt: Path):
    with running_daemon(synthetic_ckpt) as ready:
        yield ready


def test_engine_maps_the_arena_with_equal_values_and_no_second_copy(shared_daemon, synthetic_ckpt: Path) -> None:
    r = probe(spec_for(shared_daemon, synthetic_ckpt, "attach", verify=True, compare_disk=True))
    assert r["event"] == "result", r
    assert r["descriptor_kind"] == "cuda" and r["descriptor_mode"] == "vmm"
    assert r["ptr_equal"] is True  # zero copy, by pointer: every view is the mapping plus its offset
    assert r["tensors"] == 16 and r["bytes"] >= 2 << 30
    assert r["equal_to_disk"] is True
    assert r["verify"] == "ok" and r["checksums"] == 16
    # Zero copy: mapping 2 GiB moves free memory by (almost) nothing...
    assert r["free_drop_on_attach"] < 0.05 * r["bytes"], r


def test_copy_mode_clones_and_the_daemon_releases(synthetic_ckpt: Path) -> None:
    # Its own daemon: a release must not take weights from the other tests.
    with running_daemon(synthetic_ckpt) as ready:
        r = probe(spec_for(ready, synthetic_ckpt, "attach", mode="copy"))
    assert r["event"] == "result", r
    # ...while the control, cloning the same tensors, shows up as a full copy,
    assert r["free_drop_on_clone"] >= 0.95 * r["bytes"], r
    # and the daemon's release gives the arena back to the device.
    assert r["free_gain_on_release"] >= 0.95 * r["bytes"], r
    assert r["stats_after_release"] == {"released": True, "resident_bytes": 0}


def test_a_write_by_an_earlier_zero_copy_engine_is_caught_on_the_next_attach(tiny_checkpoint) -> None:
    ckpt = tiny_checkpoint(arch="llama")
    with running_daemon(ckpt) as ready:
        clean = probe(spec_for(ready, ckpt, "attach", verify=True))
        writer = probe(spec_for(ready, ckpt, "attach", corrupt="model.norm.weight"))
        after = probe(spec_for(ready, ckpt, "attach", verify=True, compare_disk=True))
    assert clean["verify"] == "ok", "control: before the write, the same check passes"
    assert writer["corrupted"] == "model.norm.weight"
    assert after["verify"] == "changed" and after["changed"] == ["model.norm.weight"], after
    assert after["equal_to_disk"] is False  # the write really reached the daemon's memory


def test_daemon_loss_is_seen_by_the_engine(tiny_checkpoint) -> None:
    ckpt = tiny_checkpoint(arch="llama")
    with running_daemon(ckpt) as ready:
        engine = subprocess.Popen(
            [sys.executable, str(PROBE), _spec_json(spec_for(ready, ckpt, "watch", timeout_s=60))],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=probe_env(),
        )
        assert engine.stdout is not None
        first = engine.stdout.readline()
        assert '"watching"' in first, first + (engine.stderr.read() if engine.stderr else "")
        time.sleep(1.0)
        assert engine.poll() is None, "control: while the daemon lives, the engine sees no loss"
        # A crash, not a polite stop: kill the rank process outright.
        import os

        os.kill(ready["ranks"][0]["pid"], signal.SIGKILL)
        out, err = engine.communicate(timeout=60)
    result = _last_json(out)
    assert result["event"] == "result" and result["lost"] is True, (result, err[-2000:])
    assert result["after_s"] < 10


def _spec_json(spec: dict) -> str:
    import json

    return json.dumps(spec)


def _last_json(text: str) -> dict:
    import json

    return json.loads([ln for ln in text.splitlines() if ln.startswith("{")][-1])


def test_a_sealed_cuda_arena_refuses_the_daemons_own_writes() -> None:
    """``seal()`` ends the daemon's writes as the shm seal does (views are
    gone); engines still can, which the interface says (``engines_can_write``)."""
    import torch

    from preload.transports.base import Layout
    from preload.transports.cuda import CudaTransport

    arena = CudaTransport(0).create(Layout.plan([("w", torch.float32, (4,), "param")]))
    try:
        arena.views()["w"].fill_(1.0)  # control: writable before the seal
        with pytest.raises(RuntimeError, match="unsealed"):
            arena.descriptor()
        arena.seal()
        with pytest.raises(RuntimeError, match="sealed"):
            arena.views()
        assert arena.engines_can_write and str(arena.gpu_uuid).startswith("GPU-")
        assert arena.descriptor()["gpu_uuid"] == arena.gpu_uuid
    finally:
        arena.close()

