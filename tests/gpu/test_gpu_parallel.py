"""Per-GPU daemons: data-parallel replicas found by GPU UUID, and
tensor-parallel slices over CUDA IPC.

One GPU proves: the DP code path (-dp 1: the engine picks its daemon by
UUID) and one TP rank's sliced arena over CUDA IPC (-tp 2 --nnodes 2 runs
each TP rank in its own launcher; both live on this GPU). Two GPUs prove
the rest (skipped, with the reason, on fewer): DP=2 with the visible device
order reversed, TP=2 NCCL decode equal to from_pretrained(tp_plan="auto").
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from gpu_support import REPO, probe, probe_env, running_daemon, spec_for

pytestmark = pytest.mark.gpu
PROMPTS = [[1, 5, 77, 300, 12, 9], [256, 3, 3, 3, 500]]
SAFE_NCCL = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


two_gpus = pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs (nvidia-h200-x2); this machine has fewer")


@pytest.fixture(scope="module")
def kv2_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fixtures.tiny import TinyShape, write_tiny

    return write_tiny(tmp_path_factory.mktemp("tiny-kv2") / "ckpt", arch="llama", shape=TinyShape(kv_heads=2))


def test_dp1_engine_finds_its_daemon_by_uuid(kv2_ckpt: Path) -> None:
    with running_daemon(kv2_ckpt, args=("-dp", "1")) as ready:
        r = probe(spec_for(ready, kv2_ckpt, "hf", prompts=PROMPTS, max_new_tokens=12))
    assert r["event"] == "result", r
    assert r["global_rank"] == 0 and r["tokens_equal"] and r["logits_equal"], r


def test_one_tp_rank_holds_only_its_slices_over_cuda_ipc(kv2_ckpt: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="pg-tp-"))
    try:
        with running_daemon(kv2_ckpt, args=("-tp", "2", "--nnodes", "2", "--node-rank", "1"), root=root) as ready:
            assert [(r["global_rank"], r["tp_rank"]) for r in ready["ranks"]] == [(1, 1)]
            r1 = probe(spec_for(ready, kv2_ckpt, "tp_slices", tp_size=2, tp_rank=1))
            # Rank 0 of the same digest from a second launcher, on the same GPU.
            with running_daemon(kv2_ckpt, args=("-tp", "2", "--nnodes", "2", "--node-rank", "0"), root=root) as r0ready:
                r0 = probe(spec_for(r0ready, kv2_ckpt, "tp_slices", tp_size=2, tp_rank=0))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for r, g in ((r0, 0), (r1, 1)):
        assert r["event"] == "result", r
        assert r["global_rank"] == g and r["hello_uuid"] == r["own_uuid"]
        assert r["equal_to_rank_slices"] is True and r["sharded"] >= 15
        assert r["equal_to_other_rank_slices"] is False  # control: the other rank's slices are not these
        assert r["full_bytes"] / 2 < r["bytes"] < r["full_bytes"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_tp2_cuda(ckpt: Path, ready: dict, out: Path, **spec) -> dict[int, dict]:
    out.mkdir(parents=True, exist_ok=True)
    body = {"checkpoint": str(ckpt), "socket_dir": ready["socket_dir"], "digest": ready["digest"], "device": "cuda",
            "prompts": PROMPTS, "max_new_tokens": 12, "result_dir": str(out), "events_file": str(out / "ev.jsonl"),
            "verify": True, **spec}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                    str(_port()), str(REPO / "tests" / "cpu" / "tp_engine.py"), json.dumps(body)],
                   env={**probe_env(), **SAFE_NCCL}, cwd=str(REPO), timeout=900, capture_output=True, text=True)
    return {int(f.stem[4:]): json.loads(f.read_text()) for f in out.glob("rank*.json")}


@two_gpus
@pytest.mark.parametrize("visible", ["0", "1", "1,0"])
def test_dp2_each_engine_attaches_its_own_gpus_daemon(kv2_ckpt: Path, visible: str) -> None:
    with running_daemon(kv2_ckpt, args=("-dp", "2")) as ready:
        uuids = {r["global_rank"]: r.get("gpu_uuid") for r in ready["ranks"]}
        r = probe(spec_for(ready, kv2_ckpt, "hf", prompts=PROMPTS, max_new_tokens=12),
                  env={"CUDA_VISIBLE_DEVICES": visible})
    assert r["event"] == "result", r
    physical = int(visible.split(",")[0])
    assert r["global_rank"] == physical, (r["global_rank"], r["own_uuid"], uuids)
    assert r["tokens_equal"] and r["logits_equal"], r


@two_gpus
def test_tp2_nccl_decodes_like_from_pretrained_tp2(kv2_ckpt: Path, tmp_path: Path) -> None:
    with running_daemon(kv2_ckpt, args=("-tp", "2")) as ready:
        res = run_tp2_cuda(kv2_ckpt, ready, tmp_path / "tp2", compare=True)
    assert sorted(res) == [0, 1], res
    for x in res.values():
        assert x["event"] == "result" and x["source"] == "daemon", x
        assert x["slices_differ"] == [] and x["tokens_equal"] and x["logits_equal"], x
    assert res[0]["tokens"] == res[1]["tokens"]


@two_gpus
def test_tp2_missing_rank_fails_or_falls_back_by_rank(kv2_ckpt: Path, tmp_path: Path) -> None:
    with running_daemon(kv2_ckpt, args=("-tp", "2", "--nnodes", "2", "--node-rank", "0")) as ready:
        off = run_tp2_cuda(kv2_ckpt, ready, tmp_path / "off", fallback=False)
        on = run_tp2_cuda(kv2_ckpt, ready, tmp_path / "on", fallback=True, compare=True)
    assert off[0]["event"] == off[1]["event"] == "error", off
    assert "rank 1" in off[1]["error"] and "ranks [1] missed" in off[0]["error"]
    assert (on[0]["source"], on[1]["source"]) == ("daemon", "disk"), on
    assert all(x["tokens_equal"] and x["logits_equal"] for x in on.values()), on
