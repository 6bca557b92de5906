"""A TP engine rank for the tests (run under ``torchrun``, gloo on CPU or
NCCL on GPU): attach this rank's slices from the daemon with
``preload.hf_attach.load_rank``, and, when asked, load the same TP engine
from disk with ``from_pretrained(tp_plan="auto")`` and compare every
parameter's local slice, the logits and the greedy tokens.

Prints one JSON line per rank (``{"rank": r, ...}``), the last line it prints.
SPEC (argv[1], JSON): checkpoint, socket_dir, digest, prompts, max_new_tokens,
fallback, events_file, compare (bool), device ("cpu" | "cuda").
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist


def decode(model: Any, prompts: list[list[int]], new: int, device: torch.device) -> tuple[list[list[int]], torch.Tensor]:
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        g = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        outs.append(g[0, len(p):].tolist())
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0]], device=device)).logits.float()
    return outs, logits


def say(spec: dict[str, Any], out: dict[str, Any]) -> None:
    """The rank's result: a file per rank when ``result_dir`` is given (two
    ranks printing at once can interleave), else one stdout line."""
    line = json.dumps(out)
    if spec.get("result_dir"):
        with open(os.path.join(spec["result_dir"], f"rank{out['rank']}.json"), "w", encoding="utf-8") as f:
            f.write(line)
    print(line, flush=True)


def local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def main() -> int:
    spec = json.loads(sys.argv[1])
    device = spec.get("device", "cpu")
    if device == "cuda":
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"rank": rank, "world": world}
    from preload.hf_attach import load_rank

    free0 = torch.cuda.mem_get_info()[0] if device == "cuda" else 0
    t0 = time.perf_counter()
    try:
        attached = load_rank(
            spec["checkpoint"], device=dev, tp_size=world, fallback=bool(spec.get("fallback")),
            events_file=spec.get("events_file"), socket_dir=spec["socket_dir"], identity="pinned",
            expected_digest=spec["digest"], verify=bool(spec.get("verify", False)), watch=False,
        )
    except Exception as exc:  # reported: the test asserts on it
        out.update(event="error", type=type(exc).__name__, error=str(exc))
        say(spec, out)
        dist.destroy_process_group()
        return 1
    out["attach_s"] = time.perf_counter() - t0
    out["source"] = attached.source
    if device == "cuda":
        torch.cuda.synchronize()
        out["free_drop_on_attach"] = free0 - torch.cuda.mem_get_info()[0]
    prompts, new = spec["prompts"], int(spec.get("max_new_tokens", 12))
    ours, our_logits = decode(attached.model, prompts, new, dev)
    out["tokens"] = ours
    if spec.get("compare"):
        from transformers import AutoModelForCausalLM

        t1 = time.perf_counter()
        ref = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], tp_plan="auto", dtype=torch.bfloat16).eval()
        if device == "cuda":
            torch.cuda.synchronize()
        out["disk_load_s"] = time.perf_counter() - t1
        mine = dict(attached.model.named_parameters())
        theirs = dict(ref.named_parameters())
        out["same_names"] = sorted(mine) == sorted(theirs)
        diff = []
        for n, p in theirs.items():
            q = mine.get(n)
            pl = tuple(str(x) for x in getattr(p, "placements", ()))
            ql = tuple(str(x) for x in getattr(q, "placements", ())) if q is not None else None
            a, b = local(p.data), (local(q.data) if q is not None else None)
            if b is None or pl != ql or a.shape != b.shape or not torch.equal(a.cpu().view(-1).view(torch.uint8),
                                                                            b.cpu().contiguous().view(-1).view(torch.uint8)):
                diff.append({"name": n, "ref": [list(a.shape), pl], "ours": None if b is None else [list(b.shape), ql]})
        out["slices_differ"] = diff
        out["slices_compared"] = len(theirs)
        out["sharded"] = sum(1 for p in theirs.values() if hasattr(p, "placements"))
        ref_tokens, ref_logits = decode(ref, prompts, new, dev)
        out["ref_tokens"] = ref_tokens
        out["tokens_equal"] = ref_tokens == ours
        out["logits_equal"] = bool(torch.equal(ref_logits, our_logits))
    out["event"] = "result"
    attached.close()
    say(spec, out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
