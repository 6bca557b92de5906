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
import hashlib
import json
import os
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
    att = state.attach(writable=bool(spec.get("writable", True)))
    torch.cuda.synchronize()
    result: dict[str, Any] = {
        "attach_s": time.perf_counter() - t0, "bytes": state.layout.total_bytes,
        "tensors": len(state.layout.entries), "descriptor_kind": state.descriptor.get("kind"),
        "descriptor_mode": state.descriptor.get("mode"), "checksums": len(state.checksums),
        "access": getattr(att, "access", None), "read_only_refused": getattr(att, "read_only_refused", None),
        "ptr_equal": _views_at_mapping(att, state.layout),
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
        try:
            target.view(-1).view(torch.int16)[0] ^= 0x10  # an in-place write into the daemon's memory
            torch.cuda.synchronize()
            result["corrupted"] = spec["corrupt"]
        except Exception as exc:  # noqa: BLE001 - a read-only mapping faults; the context is lost with it
            result["corrupt_error"] = f"{type(exc).__name__}: {exc}"[:300]
            _say({"event": "result", **result})
            os._exit(0)
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

    ours, our_logits = _decode(attached.model, prompts, new)
    tied = None
    emb = attached.model.get_input_embeddings().weight
    head = attached.model.get_output_embeddings().weight
    tied = emb.data_ptr() == head.data_ptr()
    ref_model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=emb.dtype).to("cuda").eval()
    ref, ref_logits = _decode(ref_model, prompts, new)
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


def _views_at_mapping(att: Any, layout: Any) -> bool | None:
    """Zero copy, proven: every view starts at the mapped pointer plus its offset."""
    ptr = getattr(att, "ptr", None)
    if ptr is None:
        return None
    return all(att.tensors[e.name].data_ptr() == ptr + e.offset for e in layout.entries if e.nbytes)


def _decode(model: Any, prompts: list[list[int]], new: int) -> tuple[list[list[int]], torch.Tensor]:
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        g = model.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new)
        outs.append(g[0, len(p):].tolist())
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0]], device="cuda")).logits.float()
    return outs, logits


def _logits_digest(logits: torch.Tensor) -> str:
    return hashlib.sha256(logits.cpu().numpy().tobytes()).hexdigest()


def _from_holder(spec: dict[str, Any]) -> tuple[dict[str, Any], int, Any]:
    """The record and a dup of the fd the stand-in fd store holds, and its layout."""
    from fd_holder import request

    from preload.transports.base import Layout

    reply, fds = request(spec["holder"], {"cmd": "fetch"})
    if not reply.get("ok") or len(fds) != 1:
        raise RuntimeError(f"the fd holder gave no arena: {reply}")
    rec = reply["record"]
    return rec, fds[0], Layout.from_json(rec["entries"], rec["total_bytes"])


def _deposit(spec: dict[str, Any], descriptor: dict[str, Any], fd: int, layout: Any,
             checksums: dict[str, str]) -> dict[str, Any]:
    from fd_holder import request

    record = {"descriptor": descriptor, "entries": layout.to_json(), "total_bytes": layout.total_bytes,
              "checksums": checksums}
    reply, _ = request(spec["holder"], {"cmd": "deposit", "record": record}, [fd])
    os.close(fd)
    return reply


def allocate_deposit(spec: dict[str, Any]) -> dict[str, Any]:
    """A "daemon" that allocates a VMM arena, fills it, deposits its fd in the
    holder and dies without any cleanup (os._exit, after printing)."""
    from preload.checksum import resident_checksums
    from preload.transports.base import Layout
    from preload.transports.cuda import CudaTransport

    n, mib = int(spec.get("tensors", 8)), int(spec["mib"])
    layout = Layout.plan([(f"w{i}", torch.bfloat16, ((mib << 20) // n // 2,), "param") for i in range(n)])
    arena = CudaTransport(0).create(layout)
    views = arena.views()
    gen = torch.Generator(device="cuda").manual_seed(5)
    for t in views.values():
        t.view(torch.int16).random_(-(1 << 15), (1 << 15) - 1, generator=gen)
    sums = resident_checksums(arena, views)
    del views
    arena.seal()
    descriptor, fds = arena.deposit()
    reply = _deposit(spec, descriptor, fds[0], layout, sums)
    _say({"event": "result", "deposited": reply.get("ok"), "alloc_bytes": descriptor["alloc_bytes"],
          "granularity": descriptor["granularity"], "pid": os.getpid(), "daemon_access": arena.access})
    os._exit(0)


def deposit_from_daemon(spec: dict[str, Any]) -> dict[str, Any]:
    """Stand-in for a daemon's deposit: the fd a daemon sends with its state
    reply goes to the holder, with the daemon's layout and checksums."""
    from preload.client import DaemonClient
    from preload.daemon.raw import raw_key

    client = DaemonClient.connect(spec["socket_dir"], 0, client="gpu-probe-deposit")
    state = client.get_state(raw_key(spec["checkpoint"], spec["digest"], "cuda"))
    fds, state.fds = state.fds, []
    reply = _deposit(spec, state.descriptor, fds[0], state.layout, dict(state.checksums))
    client.close()
    return {"deposited": reply.get("ok"), "nfds": len(fds), "checksums": len(state.checksums)}


def adopt(spec: dict[str, Any]) -> dict[str, Any]:
    """A successor's side: adopt the held arena and prove it (ArenaProofError reported)."""
    from preload.transports.base import ArenaProofError
    from preload.transports.cuda import CudaTransport

    torch.cuda.init()
    torch.empty(1, device="cuda")
    if spec.get("warm"):  # compile the checksum kernel outside the timed region, as a daemon's first load has
        from preload.checksum import warm

        warm("cuda")
    t0 = time.perf_counter()
    rec, fd, layout = _from_holder(spec)
    transport = CudaTransport(0)
    arena = transport.adopt(rec["descriptor"], [fd], layout)
    t1 = time.perf_counter()
    result: dict[str, Any] = {"adopted": arena.adopted, "access": arena.access, "bytes": layout.total_bytes}
    try:
        proof = transport.prove(arena, rec["checksums"])
        result["proof"] = {"method": proof.method, "tensors": proof.tensors, "bytes": proof.bytes,
                           "seconds": proof.seconds}
    except ArenaProofError as exc:
        result["proof_error"] = str(exc)
    result.update(fetch_adopt_s=t1 - t0, adopt_prove_s=time.perf_counter() - t0)
    if spec.get("compare_disk") and arena.base is not None:
        from preload.transports.base import view

        disk = _disk_tensors(spec["checkpoint"])
        result["equal_to_disk"] = all(
            torch.equal(disk[e.name].reshape(-1).view(torch.uint8), view(arena.base, e).reshape(-1).view(torch.uint8))
            for e in layout.entries)
    arena.close()
    return result


def write_byte(spec: dict[str, Any]) -> dict[str, Any]:
    """Between two daemons: map the held arena read-write and change one element."""
    from preload.transports.cuda import CudaTransport

    rec, fd, layout = _from_holder(spec)
    att = CudaTransport(0).attach(rec["descriptor"], [fd], layout, writable=True)
    att.tensors[spec["tensor"]].reshape(-1).view(torch.uint8)[int(spec.get("byte", 0))] ^= 0x01
    torch.cuda.synchronize()
    att.close()
    return {"written": spec["tensor"], "access": att.access}


def hf_fd(spec: dict[str, Any]) -> dict[str, Any]:
    """A new engine over the held arena (no daemon alive): attach read-only,
    build the meta model on it, decode, and compare with from_pretrained."""
    from transformers import AutoModelForCausalLM

    from preload.checksum import verify_resident
    from preload.hf_attach import build_meta_model, place_tensors
    from preload.transports.cuda import CudaTransport

    torch.cuda.set_device(0)
    rec, fd, layout = _from_holder(spec)
    t0 = time.perf_counter()
    att = CudaTransport(0).attach(rec["descriptor"], [fd], layout, writable=False)
    attach_s = time.perf_counter() - t0
    verify_resident(att.tensors, layout, rec["checksums"])
    model = build_meta_model(spec["checkpoint"])
    place_tensors(model, att.tensors)
    model.to("cuda:0")
    ours, our_logits = _decode(model, spec["prompts"], int(spec.get("max_new_tokens", 16)))
    dtype = next(iter(att.tensors.values())).dtype
    ref_model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=dtype).to("cuda").eval()
    ref, ref_logits = _decode(ref_model, spec["prompts"], int(spec.get("max_new_tokens", 16)))
    return {"ours": ours, "reference": ref, "tokens_equal": ours == ref,
            "logits_equal": bool(torch.equal(our_logits, ref_logits)), "access": att.access,
            "ptr_equal": _views_at_mapping(att, layout), "attach_s": attach_s, "bytes": layout.total_bytes}


def hf_serve(spec: dict[str, Any]) -> dict[str, Any]:
    """A long-lived engine: attach zero-copy (read-only), then answer "decode"
    lines on stdin with the greedy tokens and a digest of the logits, until "exit"."""
    from preload.hf_attach import attach_model

    attached = attach_model(
        spec["checkpoint"], device="cuda:0", socket_dir=spec["socket_dir"], identity="pinned",
        expected_digest=spec["digest"], verify=True, watch=True, on_loss=lambda: None,
    )
    access = getattr(attached.attachment, "access", None)
    _say({"event": "attached", "access": access, "bytes": attached.bytes})
    for line in sys.stdin:
        if line.strip() == "decode":
            ours, logits = _decode(attached.model, spec["prompts"], int(spec.get("max_new_tokens", 16)))
            _say({"event": "decoded", "tokens": ours, "logits_sha256": _logits_digest(logits),
                  "daemon_lost": attached.daemon_lost})
        elif line.strip() == "exit":
            break
    attached.close()
    return {"served": True, "access": access}


def main() -> int:
    spec = json.loads(sys.argv[1])
    action = {"attach": attach, "hf": hf, "watch": watch, "tp_slices": tp_slices, "adopt": adopt,
              "allocate_deposit": allocate_deposit, "deposit_from_daemon": deposit_from_daemon,
              "write_byte": write_byte, "hf_fd": hf_fd, "hf_serve": hf_serve}[spec["action"]]
    try:
        _say({"event": "result", **action(spec)})
    except Exception as exc:  # reported, not hidden: the test asserts on it
        _say({"event": "error", "type": type(exc).__name__, "error": str(exc)})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
