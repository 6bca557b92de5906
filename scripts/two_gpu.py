"""Issue 16 figures on a two-GPU machine (run by scripts/two_gpu.sh).

Generates a synthetic Llama-shaped checkpoint of at least GB_PER_GPU GB per
GPU at TP=2 (random bf16 weights, transformers' own init), then:
TP=1 greedy tokens from from_pretrained on GPU 0; a ``-tp 2`` cuda daemon
(free memory of each GPU before/after it is ready); a TP=2 engine (NCCL,
tests/cpu/tp_engine.py) attaching its rank's arena, against the same TP=2
engine loading from disk (from_pretrained(tp_plan="auto")): logits/tokens
equality, attach seconds per rank vs disk-load seconds per rank, and the
first position where TP=1 and TP=2 greedy tokens differ. Writes OUT/two_gpu.json.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
PROMPTS = [[1, 5, 77, 300, 12, 9], [256, 3, 3, 3, 500], [42, 42, 7]]


def synthetic(out: Path, gb_per_gpu: float) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    layers = max(1, math.ceil((2 * gb_per_gpu * 1e9 / 2 - 2 * 32000 * 4096) / per_layer))
    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                      tie_word_embeddings=False, dtype="bfloat16")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device("cuda:0"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="4GB")
    del model
    torch.cuda.empty_cache()
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    return {"layers": layers, "bytes": size, "write_s": time.perf_counter() - t0}


def greedy(model, new: int) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        g = model.generate(torch.tensor([p], device=model.device), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False)
        out.append(g[0, len(p):].tolist())
    return out


def free() -> list[int]:
    vals = []
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)
        vals.append(int(torch.cuda.mem_get_info(i)[0]))
    return vals


def first_diff(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    return [next((i for i, (x, y) in enumerate(zip(p, q, strict=False)) if x != y), None) for p, q in zip(a, b, strict=True)]


def one_gpu(gb: float, sink: Path) -> dict:
    """Both TP ranks of a ``-tp 2`` checkpoint as two launchers (--nnodes 2)
    on this one GPU: what each holds (from free memory), and per rank the
    attach time over CUDA IPC against loading the same slices from disk."""
    work = Path(tempfile.mkdtemp(prefix="pg1-", dir=os.environ.get("PRELOAD_GATE_BENCH_DIR", "/tmp")))
    ckpt = work / "ckpt"
    out: dict = {}
    procs = []
    try:
        out["checkpoint"] = synthetic(ckpt, gb)
        root = work / "sock"
        root.mkdir(mode=0o700)
        env = {**os.environ, **SAFE, "PYTHONPATH": str(REPO)}
        readies = []
        for node in (0, 1):
            before = free()[0]
            t0 = time.perf_counter()
            d = subprocess.Popen([sys.executable, "-m", "preload_gate", "preload", str(ckpt), "--stage", "raw",
                                  "--transport", "cuda", "-tp", "2", "--nnodes", "2", "--node-rank", str(node),
                                  "--identity", "full", "--socket-root", str(root)],
                                 stdout=subprocess.PIPE, text=True, env=env, cwd=str(REPO))
            procs.append(d)
            assert d.stdout is not None
            ready = json.loads(d.stdout.readline())
            readies.append(ready)
            drop = before - free()[0]
            sink.write_text(json.dumps(out, indent=1))
            out[f"rank{node}"] = {"daemon_ready_s": time.perf_counter() - t0, "arena_bytes": ready["ranks"][0]["bytes"],
                                  "free_drop": drop, "free_drop_fraction_of_checkpoint": drop / out["checkpoint"]["bytes"]}
        for node, ready in enumerate(readies):
            spec = {"action": "tp_slices", "checkpoint": str(ckpt), "digest": ready["digest"],
                    "socket_dir": ready["socket_dir"], "tp_size": 2, "tp_rank": node, "disk_load": True}
            p = subprocess.run([sys.executable, str(REPO / "tests" / "gpu" / "engine_probe.py"), json.dumps(spec)],
                               capture_output=True, text=True, env=env, cwd=str(REPO), timeout=600)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            res = json.loads(lines[-1]) if lines else {"error": p.stderr[-2000:]}
            out[f"rank{node}"].update(res)
            if "attach_s" in res and res.get("disk_load_s"):
                out[f"rank{node}"]["disk_over_attach"] = res["disk_load_s"] / res["attach_s"]
            sink.write_text(json.dumps(out, indent=1))
    finally:
        for d in procs:
            d.terminate()
            d.wait(120)
        shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> int:
    out_dir = Path(sys.argv[1])
    args = [a for a in sys.argv[2:] if not a.startswith("--")]
    gb = float(args[0]) if args else 8.0
    new = 32
    result: dict = {"gpus": torch.cuda.device_count(), "gb_per_gpu_asked": gb}
    if torch.cuda.device_count() < 2:
        result["skipped"] = "needs two GPUs: TP=2 decode, DP=2; ran the one-GPU part (both TP ranks' arenas on GPU 0)"
        if "--one-gpu" in sys.argv:
            result["one_gpu"] = one_gpu(gb, out_dir / "one_gpu_partial.json")
        (out_dir / "two_gpu.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result))
        return 0
    work = Path(tempfile.mkdtemp(prefix="pg2-", dir=os.environ.get("PRELOAD_GATE_BENCH_DIR", "/tmp")))
    ckpt = work / "ckpt"
    try:
        result["checkpoint"] = synthetic(ckpt, gb)
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        m = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16, device_map="cuda:0").eval()
        result["tp1_load_s"] = time.perf_counter() - t0
        tp1 = greedy(m, new)
        del m
        torch.cuda.empty_cache()
        root = work / "sock"
        root.mkdir(mode=0o700)
        env = {**os.environ, **SAFE, "PYTHONPATH": str(REPO)}
        before = free()
        d = subprocess.Popen([sys.executable, "-m", "preload_gate", "preload", str(ckpt), "--stage", "raw",
                              "--transport", "cuda", "-tp", "2", "--identity", "full", "--socket-root", str(root)],
                             stdout=subprocess.PIPE, text=True, env=env, cwd=str(REPO))
        try:
            assert d.stdout is not None
            ready = json.loads(d.stdout.readline())
            after = free()
            result["daemon_ranks"] = [{k: r[k] for k in ("global_rank", "tp_rank", "bytes", "load_seconds")}
                                      for r in ready["ranks"]]
            result["free_drop_per_gpu"] = [b - a for b, a in zip(before, after, strict=True)]
            result["held_fraction_per_gpu"] = [x / result["checkpoint"]["bytes"] for x in result["free_drop_per_gpu"]]
            res_dir = work / "tp2"
            res_dir.mkdir()
            body = {"checkpoint": str(ckpt), "socket_dir": ready["socket_dir"], "digest": ready["digest"],
                    "device": "cuda", "prompts": PROMPTS, "max_new_tokens": new, "result_dir": str(res_dir),
                    "compare": True, "verify": True}
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                "--master_port", str(port), str(REPO / "tests" / "cpu" / "tp_engine.py"),
                                json.dumps(body)], env=env, cwd=str(REPO), capture_output=True, text=True, timeout=900)
            ranks = {int(f.stem[4:]): json.loads(f.read_text()) for f in res_dir.glob("rank*.json")}
            if len(ranks) < 2:
                result["engine_stderr"] = p.stderr[-3000:]
            result["tp2"] = {r: {k: x.get(k) for k in ("event", "error", "source", "attach_s", "disk_load_s",
                                                        "free_drop_on_attach", "logits_equal", "tokens_equal",
                                                        "slices_differ", "sharded")}
                             for r, x in ranks.items()}
            if 0 in ranks and "tokens" in ranks[0]:
                result["tp1_vs_tp2_first_diff"] = first_diff(tp1, ranks[0]["tokens"])
        finally:
            d.terminate()
            d.wait(120)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (out_dir / "two_gpu.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
