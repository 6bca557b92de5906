"""An "engine" process for the GPU tests: attach from a daemon, measure, report JSON.

Run as ``python tests/gpu/engine_probe.py SPEC_JSON``; prints JSON lines on
stdout, the last one the result. It is a separate process from the daemon
on purpose: CUDA IPC handles cannot be opened by the process that made
them, and "across unrelated processes" is what the tests must show.

SPEC keys: action ("attach" | "hf" | "watch"), checkpoint, digest,
socket_dir, and per action: mode (zero_copy | copy), verify (bool),
compare_disk (bool), corrupt (tensor name or null), prompts, max_new_tokens.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from typing import Any

import torch


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _free() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def _disk_tensors(checkpoint: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from pgbase.shards import shard_paths

    out: dict[str, torch.Tensor] = {}
    for p in shard_paths(checkpoint):
        out.update(load_file(str(p), device="cuda"))
    return out


def attach(spec: dict[str, Any]) -> dict[str, Any]:
    from preload.checksum import ResidentWeightsChangedError, verify_resident
    from preload.client import DaemonClient
    from preload.daemon.raw import raw_key

    torch.cuda.init()
    torch.empty(1, device="cuda")
    free0 = _free()
    client = DaemonClient.connect(spec["socket_dir"], 0, client="gpu-probe")
    state = client.get_state(raw_key(spec["checkpoint"], spec["digest"], "cuda"))
    t0 = time.perf_counter()
    att = state.attach()
    torch.cuda.synchronize()
    result: dict[str, Any] = {
        "attach_s": time.perf_counter() - t0, "bytes": state.layout.total_bytes,
        "tensors": len(state.layout.entries), "descriptor_kind": state.descriptor.get("kind"),
        "descriptor_mode": state.descriptor.get("mode"), "checksums": len(state.checksums),
    }
    free1 = _free()
    result["free_drop_on_attach"] = free0 - free1
    if spec.get("verify"):
        try:
            verify_resident(att.tensors, state.layout, state.checksums)
            result["verify"] = "ok"
        except ResidentWeightsChangedError as exc:
            result["verify"] = "changed"
            result["changed"] = exc.changed
            result["verify_message"] = str(exc)
    if spec.get("compare_disk"):
        disk = _disk_tensors(spec["checkpoint"])
        result["equal_to_disk"] = sorted(disk) == sorted(att.tensors) and all(
            torch.equal(disk[n].view(-1).view(torch.uint8), att.tensors[n].reshape(-1).view(torch.uint8))
            for n in disk
        )
        del disk
        gc.collect()
        torch.cuda.empty_cache()
    if spec.get("corrupt"):
        target = att.tensors[spec["corrupt"]]
        target.view(-1).view(torch.int16)[0] ^= 0x10  # an in-place write into the daemon's memory
        torch.cuda.synchronize()
        result["corrupted"] = spec["corrupt"]
    if spec.get("mode") == "copy":
        free_before_clone = _free()
        clones = {n: t.clone() for n, t in att.tensors.items()}
        result["free_drop_on_clone"] = free_before_clone - _free()
        att.close()
        del att
        gc.collect()
        free_before_release = _free()
        client.release()
        time.sleep(0.5)
        result["free_gain_on_release"] = _free() - free_before_release
        result["clones"] = len(clones)
        result["stats_after_release"] = {
            k: v for k, v in client_stats(spec).items() if k in ("released", "resident_bytes")
        }
    else:
        att.close()
        del att
    client.close()
    return result


def client_stats(spec: dict[str, Any]) -> dict[str, Any]:
    from preload.client import DaemonClient

    c = DaemonClient.connect(spec["socket_dir"], 0, client="gpu-probe-stats")
    try:
        return c.stats()
    finally:
        c.close()


def hf(spec: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from preload.hf_attach import attach_model

    prompts = spec["prompts"]
    new = int(spec.get("max_new_tokens", 16))
    attached = attach_model(
        spec["checkpoint"], device="cuda:0", mode=spec.get("mode", "zero_copy"),
        socket_dir=spec["socket_dir"], identity="pinned", expected_digest=spec["digest"], verify=True,
    )

    def decode(model: Any) -> tuple[list[list[int]], torch.Tensor]:
        outs = []
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            g = model.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new)
            outs.append(g[0, len(p):].tolist())
        with torch.no_grad():
            logits = model(torch.tensor([prompts[0]], device="cuda")).logits.float()
        return outs, logits

    ours, our_logits = decode(attached.model)
    tied = None
    emb = attached.model.get_input_embeddings().weight
    head = attached.model.get_output_embeddings().weight
    tied = emb.data_ptr() == head.data_ptr()
    ref_model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=emb.dtype).to("cuda").eval()
    ref, ref_logits = decode(ref_model)
    from preload.transports.cuda import device_uuid

    result = {
        "global_rank": attached.global_rank, "own_uuid": device_uuid(0),
        "visible": [device_uuid(i) for i in range(torch.cuda.device_count())],
        "ours": ours, "reference": ref, "tokens_equal": ours == ref,
        "logits_equal": bool(torch.equal(our_logits, ref_logits)),
        "tied": tied, "verified": attached.verified is not None, "seconds": attached.seconds,
        "tensors": attached.tensors, "bytes": attached.bytes, "mode": attached.mode,
    }
    attached.close()
    return result


def tp_slices(spec: dict[str, Any]) -> dict[str, Any]:
    """Attach one TP rank's arena (found by this GPU's UUID) over CUDA IPC and
    compare every tensor with that rank's chunk of the checkpoint on disk;
    the other rank's chunk is the control (it must differ)."""
    from safetensors.torch import load_file

    from pgbase.shards import shard_paths
    from preload.checksum import verify_resident
    from preload.client import DaemonClient
    from preload.daemon.raw import raw_key
    from preload.daemon.tp_slice import chunk, plan_slices
    from preload.hf_attach import find_rank
    from preload.transports.cuda import device_uuid

    torch.cuda.init()
    dev = torch.device("cuda", 0)
    tp, r = int(spec["tp_size"]), int(spec["tp_rank"])
    g = find_rank(spec["socket_dir"], dev, tp, r)
    client = DaemonClient.connect(spec["socket_dir"], g, client="gpu-probe")
    state = client.get_state(raw_key(spec["checkpoint"], spec["digest"], "cuda", tp, r))
    t0 = time.perf_counter()
    att = state.attach()
    torch.cuda.synchronize()
    attach_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    verify_resident(att.tensors, state.layout, state.checksums)
    verify_s = time.perf_counter() - t1
    if spec.get("disk_load"):
        # The same rank's slices loaded from disk to this GPU (the fallback path), for the bench.
        from preload.hf_attach import disk_rank_tensors

        free0 = _free()
        t2 = time.perf_counter()
        loaded = disk_rank_tensors(spec["checkpoint"], dev, tp, r)
        torch.cuda.synchronize()
        disk_s = time.perf_counter() - t2
        disk_bytes = sum(t.numel() * t.element_size() for t in loaded.values())
        del loaded
        torch.cuda.empty_cache()
        result = {"global_rank": g, "attach_s": attach_s, "verify_s": verify_s, "disk_load_s": disk_s,
                  "disk_bytes": disk_bytes, "bytes": state.layout.total_bytes, "free_before_disk_load": free0}
        att.close()
        client.close()
        return result
    disk: dict[str, torch.Tensor] = {}
    for p in shard_paths(spec["checkpoint"]):
        disk.update(load_file(str(p)))
    slices = plan_slices(spec["checkpoint"], [(n, tuple(t.shape)) for n, t in disk.items()], tp, r)
    equal, other_equal, sharded = True, True, 0
    for n, full in disk.items():
        d = slices[n].dim
        mine = full if d is None else chunk(full, d, tp, r)
        equal &= torch.equal(att.tensors[n].cpu(), mine.contiguous())
        if d is not None:
            sharded += 1
            other = chunk(full, d, tp, (r + 1) % tp)
            other_equal &= other.shape == mine.shape and torch.equal(att.tensors[n].cpu(), other.contiguous())
    result = {
        "global_rank": g, "hello_uuid": client.hello.get("gpu_uuid"), "own_uuid": device_uuid(0),
        "equal_to_rank_slices": equal, "equal_to_other_rank_slices": other_equal, "sharded": sharded,
        "bytes": state.layout.total_bytes, "full_bytes": sum(t.numel() * t.element_size() for t in disk.values()),
        "attach_s": attach_s, "verify_s": verify_s,
    }
    att.close()
    client.close()
    return result


def watch(spec: dict[str, Any]) -> dict[str, Any]:
    from preload.hf_attach import attach_model

    attached = attach_model(
        spec["checkpoint"], device="cuda:0", socket_dir=spec["socket_dir"], identity="pinned",
        expected_digest=spec["digest"], verify=True, watch=True,
    )
    _say({"event": "watching"})
    t0 = time.monotonic()
    assert attached.watch is not None
    lost = attached.watch.lost.wait(float(spec.get("timeout_s", 30)))
    return {"lost": lost, "after_s": time.monotonic() - t0}


def main() -> int:
    spec = json.loads(sys.argv[1])
    action = {"attach": attach, "hf": hf, "watch": watch, "tp_slices": tp_slices}[spec["action"]]
    try:
        _say({"event": "result", **action(spec)})
    except Exception as exc:  # reported, not hidden: the test asserts on it
        _say({"event": "error", "type": type(exc).__name__, "error": str(exc)})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
