"""TP=2 at the raw stage on CPU: a ``-tp 2`` daemon (shm transport) holds
per rank only that rank's slices; a TP=2 transformers engine (two
processes, gloo) attaches them with ``load_rank`` and equals
``from_pretrained(tp_plan="auto")`` slice for slice, logit for logit, and
TP=1 token for token. A missing or mismatched rank is a miss naming the
rank and the fields: fallback off fails every rank, fallback on loads that
rank from disk and says so in its event.

No vLLM; transformers and torch.distributed (gloo) only. The GPU machine
runs the same file under its own transformers (scripts/gpu_suite.sh).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_support import Daemon, short_dir

from preload.events import read_events

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="tp_raw")]
REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "tests" / "cpu" / "tp_engine.py"
PROMPTS = [[1, 5, 77, 300, 12, 9], [256, 3, 3, 3, 500]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fixtures.tiny import TinyShape, write_tiny

    # Two KV heads: TP=2 splits attention by whole heads.
    return write_tiny(tmp_path_factory.mktemp("tiny-kv2") / "ckpt", arch="llama", shape=TinyShape(kv_heads=2))


@pytest.fixture(scope="module")
def root() -> Any:
    r = short_dir("pg-tp-")
    yield r
    shutil.rmtree(r, ignore_errors=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_tp2(ckpt: Path, daemon: Daemon, events: Path, **spec: Any) -> dict[int, dict[str, Any]]:
    """Two engine ranks under torchrun; their result lines by rank."""
    results = events.with_suffix(".results")
    results.mkdir()
    body = {"checkpoint": str(ckpt), "socket_dir": str(daemon.socket_dir), "digest": daemon.ready["digest"],
            "prompts": PROMPTS, "max_new_tokens": 12, "events_file": str(events), "result_dir": str(results),
            **spec}
    # CPU engines: hide any GPU, or transformers puts tp_plan="auto" on cuda:LOCAL_RANK.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_port()),
         str(ENGINE), json.dumps(body)],
        capture_output=True, text=True, env=env, cwd=str(REPO), timeout=600,
    )
    by_rank = {}
    for f in results.glob("rank*.json"):
        r = json.loads(f.read_text(encoding="utf-8"))
        by_rank[r["rank"]] = r
    assert sorted(by_rank) == [0, 1], f"rc {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return by_rank


def _daemon(ckpt: Path, root: Path, tmp: Path, *args: str) -> Daemon:
    return Daemon(ckpt, root, tmp, ("--stage", "raw", "--transport", "shm", "--identity", "full", *args)).start(300)


def _tp1_tokens(ckpt: Path) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16).eval()
    out = []
    for p in PROMPTS:
        g = model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        out.append(g[0, len(p):].tolist())
    return out


def test_tp2_ranks_hold_their_slices_and_decode_like_from_pretrained_tp2(ckpt, root, tmp_path) -> None:
    d = _daemon(ckpt, root, tmp_path, "-tp", "2")
    try:
        ranks = d.ready["ranks"]
        assert [(r["global_rank"], r["tp_rank"]) for r in ranks] == [(0, 0), (1, 1)]
        full = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
        # Each rank holds its slices only: less than the checkpoint, more than half (replicated norms/embeddings).
        assert all(full / 2 < r["bytes"] < full for r in ranks), (full, [r["bytes"] for r in ranks])
        res = run_tp2(ckpt, d, tmp_path / "ev.jsonl", compare=True)
    finally:
        d.stop()
    for r in (0, 1):
        x = res[r]
        assert x["event"] == "result", x
        assert x["source"] == "daemon"
        assert x["same_names"] and x["sharded"] >= 15
        assert x["slices_differ"] == [], x["slices_differ"]  # every local slice == from_pretrained(tp_plan="auto")'s
        assert x["logits_equal"] and x["tokens_equal"], x
    assert res[0]["tokens"] == res[1]["tokens"] == _tp1_tokens(ckpt)
    evs = sorted(read_events(tmp_path / "ev.jsonl"), key=lambda e: e["rank"])
    assert [(e["outcome"], e["rank"], e["source"]) for e in evs] == [("hit", 0, "daemon"), ("hit", 1, "daemon")]


@pytest.mark.parametrize("case", ["missing", "mismatched"])
def test_a_bad_rank_fails_the_whole_start_or_falls_back_by_rank(case, ckpt, root, tmp_path) -> None:
    # Rank 0 only (one node of two); "mismatched": rank 1's socket is the rank 1 of a
    # -tp 1 -dp 2 daemon (whole tensors; the model's 2 heads allow no tp above 2).
    daemons = [_daemon(ckpt, root, tmp_path, "-tp", "2", "--nnodes", "2", "--node-rank", "0")]
    try:
        if case == "mismatched":
            daemons.append(_daemon(ckpt, root, tmp_path, "-tp", "1", "-dp", "2", "--nnodes", "2", "--node-rank", "1"))
        want_fields = ["tp_rank"] if case == "missing" else ["tp_size", "tp_rank"]
        off = run_tp2(ckpt, daemons[0], tmp_path / "off.jsonl", fallback=False)
        assert off[0]["event"] == off[1]["event"] == "error", off
        assert "rank 1" in off[1]["error"] and "fallback is off" in off[1]["error"]
        assert "ranks [1] missed" in off[0]["error"]
        evs = {e["rank"]: e for e in read_events(tmp_path / "off.jsonl")}
        assert evs[1]["outcome"] == "miss" and evs[1]["fields"] == want_fields, evs[1]
        assert evs[1]["reason"].startswith("rank 1:") and evs[1]["source"] == "none"
        assert evs[0]["outcome"] == "error" and evs[0]["source"] == "none"

        on = run_tp2(ckpt, daemons[0], tmp_path / "on.jsonl", fallback=True, compare=True)
        assert on[0]["source"] == "daemon" and on[1]["source"] == "disk", on
        for r in (0, 1):
            assert on[r]["slices_differ"] == [] and on[r]["tokens_equal"] and on[r]["logits_equal"], on[r]
        evs = {e["rank"]: e for e in read_events(tmp_path / "on.jsonl")}
        assert (evs[0]["outcome"], evs[0]["source"]) == ("hit", "daemon")
        assert (evs[1]["outcome"], evs[1]["source"], evs[1]["fields"]) == ("miss", "disk", want_fields)
        assert "loaded this rank from disk" in evs[1]["reason"]
    finally:
        for d in daemons:
            d.stop()
