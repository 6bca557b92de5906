"""One rule for the stage and transport an engine on this host attaches: the
daemon's defaults, its refusals, and the loader's key (issue 38, step 1).

Rows are (vLLM's platform device type, --stage, --transport) -> what the
daemon starts, or the refusal. Controls: the rule before this issue (the
transport defaulted to shm, the stage followed it) disagrees with the
loader's key on a CUDA host, and the tests say so; a refused choice is
accepted by that old rule.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from daemon_support import REPO, Daemon, repo_pythonpath, short_dir

from pgbase.errors import PreloadGateError
from preload.engine_platform import for_device, resolve
from preload.loader.memory import daemon_device_bytes
from preload.loader.options import LoaderOptions
from preload.promote import promote
from preload.vllm_key import export_stage_for, transport_for

pytestmark = [pytest.mark.unit]

RESOLVED = [
    # device type, --stage, --transport -> (stage, transport)
    ("cuda", None, None, ("processed", "cuda")),
    ("cpu", None, None, ("loaded", "shm")),
    ("cuda", "processed", None, ("processed", "cuda")),
    ("cuda", None, "cuda", ("processed", "cuda")),
    ("cpu", "loaded", None, ("loaded", "shm")),
    ("cpu", None, "shm", ("loaded", "shm")),
    # raw goes to the GPU where torch sees one (attach_model's default device), else shm
    ("cuda", "raw", None, ("raw", "cuda" if torch.cuda.is_available() else "shm")),
    ("cpu", "raw", "shm", ("raw", "shm")),
    ("cuda", "raw", "cuda", ("raw", "cuda")),  # a transformers consumer on the GPU (preload.hf_attach)
    (None, None, None, ("raw", "cuda" if torch.cuda.is_available() else "shm")),  # no vLLM: other consumers
    (None, None, "shm", ("raw", "shm")),
]

REFUSED = [
    # device type, --stage, --transport -> words the one line must hold
    ("cuda", "loaded", "shm", "processed"),  # the CPU defaults on a CUDA host (what `preload` started before)
    ("cuda", "loaded", None, "processed"),
    ("cuda", None, "shm", "processed"),
    ("cuda", "processed", "shm", "processed"),
    ("cpu", "processed", None, "loaded"),
    ("cpu", "processed", "cuda", "loaded"),
    ("cpu", None, "cuda", "loaded"),
    (None, "loaded", None, "vLLM cannot be imported"),
    (None, "processed", "cuda", "vLLM cannot be imported"),
]


def _old_rule(stage: str | None, transport: str | None) -> tuple[str, str]:
    """The daemon's defaults before issue 38: transport shm unless given, the stage from the transport."""
    transport = transport or "shm"
    return stage or export_stage_for("cpu" if transport == "shm" else "cuda"), transport


@pytest.mark.parametrize("device,stage,transport,want", RESOLVED)
def test_resolved(device: str | None, stage: str | None, transport: str | None, want: tuple[str, str]) -> None:
    assert resolve(stage, transport, lambda: device) == want


@pytest.mark.parametrize("device,stage,transport,words", REFUSED)
def test_refused_in_one_line(device: str | None, stage: str | None, transport: str | None, words: str) -> None:
    with pytest.raises(PreloadGateError) as err:
        resolve(stage, transport, lambda: device)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_daemon_defaults_are_what_the_loader_keys(device: str) -> None:
    assert resolve(None, None, lambda: device) == (export_stage_for(device), transport_for(device)) == \
        for_device(device)


def test_control_the_old_defaults_missed_on_cuda() -> None:
    # The bug the issue found on an H100: a daemon no CUDA engine can attach.
    assert _old_rule(None, None) != (export_stage_for("cuda"), transport_for("cuda"))
    # and the old rule accepted what is now refused
    assert _old_rule("loaded", "shm") == ("loaded", "shm")


def test_raw_asks_no_vllm() -> None:
    def boom() -> str | None:
        raise AssertionError("raw must not ask vLLM's platform")

    assert resolve("raw", "shm", boom) == ("raw", "shm")


def _preload(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "preload_gate", "preload", *args], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": repo_pythonpath()}, cwd=str(REPO),
                          timeout=300)


def test_dry_run_prints_this_hosts_rule_and_refuses_others_before_reading(tiny_ckpt) -> None:
    pytest.importorskip("vllm", reason="the platform's rule needs vLLM")
    from preload.engine_platform import host_device_type

    device = host_device_type()  # vLLM's own answer: cpu here, cuda on the GPU machine
    want, other = (("processed", "cuda"), "loaded") if device == "cuda" else (("loaded", "shm"), "processed")
    plan = _preload(str(tiny_ckpt), "--dry-run", "--json", "--socket-root", str(short_dir("pg-ep-")))
    assert plan.returncode == 0, plan.stderr
    body = json.loads(plan.stdout)
    assert (body["stage"], body["transport"]) == want
    refused = _preload(str(tiny_ckpt), "--stage", other, "--dry-run")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert want[0] in refused.stderr and "Traceback" not in refused.stderr


class _Cfg(SimpleNamespace):
    pass


def _vllm_config(checkpoint: str, device_type: str) -> _Cfg:
    return _Cfg(device_config=_Cfg(device_type=device_type), model_config=_Cfg(model=checkpoint),
                parallel_config=_Cfg(data_parallel_rank=0, data_parallel_index=None))


def test_the_engine_counts_the_daemons_device_bytes_once(tiny_ckpt, tmp_path, monkeypatch) -> None:
    """vLLM's get_external_weight_memory: the arena's bytes for a zero-copy
    engine on a GPU whose daemon serves its digest; 0 otherwise (controls)."""
    monkeypatch.setattr("preload.loader.memory.rank_info",
                        lambda: {"tp_size": 1, "tp_rank": 0, "pp_size": 1, "pp_rank": 0})
    root, cache = short_dir("pg-mem-"), tmp_path / "cache"
    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(cache))
    promote(tiny_ckpt, socket_root=root, cache_dir=cache, progress=False)
    d = Daemon(tiny_ckpt, root, cache, args=("--stage", "raw")).start()
    try:
        arena = d.ready["ranks"][0]["bytes"]
        ask = lambda device, **o: daemon_device_bytes(  # noqa: E731
            LoaderOptions(**{"socket_root": str(root), **o}), _vllm_config(str(tiny_ckpt), device))
        assert ask("cuda") == arena > 0
        assert ask("cpu") == 0  # shared file memory, not device memory
        assert ask("cuda", mode="copy") == 0  # the engine holds its own copy
        monkeypatch.setenv("PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS", "1")
        assert ask("cuda", unsafe_uncounted_memory=True) == 0
        assert ask("cuda", socket_root=str(short_dir("pg-mem0-"))) == 0  # no daemon there: a disk load
    finally:
        d.stop()


def test_a_broken_vllm_is_named_not_guessed_raw(tiny_ckpt, tmp_path) -> None:
    """vLLM installed but failing to import: the daemon's default is refused in
    one line naming the error (a raw daemon there would serve no engine);
    an explicit --stage raw still starts its dry run. Control: no vLLM at all
    (a package that is not there) gives the raw stage, as the rule says."""
    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text("raise RuntimeError('torch mismatch: built for 2.14')\n")

    def dry(*extra: str, path: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "preload_gate", "preload", str(tiny_ckpt), "--dry-run",
                               "--json", "--socket-root", str(short_dir("pg-ep-")), *extra],
                              capture_output=True, text=True, cwd=str(REPO), timeout=300,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([path, repo_pythonpath()])})

    broken = dry(path=str(fake))
    assert broken.returncode == 2 and len(broken.stderr.strip().splitlines()) == 1, broken.stderr
    assert "cannot be imported" in broken.stderr and "torch mismatch" in broken.stderr
    assert dry("--stage", "raw", path=str(fake)).returncode == 0
    assert resolve(None, None, lambda: None)[0] == "raw"  # control: no vLLM installed at all
