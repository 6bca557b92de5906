"""GPU benchmarks: attaching a rank's weights from its VMM arena's fd, and checking them.

Rows (each needs a CUDA device; without one a row reports "not run"):

- ``gpu_attach``: a producer process holds a synthetic checkpoint's tensors
  (``--size``, default 8 GiB here, in ``tensors=320`` tensors) twice: in one
  VMM arena (one fd) and as one VMM allocation per tensor (one fd each);
  the fds come over a Unix socket as a daemon sends them. This process
  attaches both (read-only, as an engine that only reads does),
  alternating, ``reps`` times; each attach is timed from the descriptor
  and fd to usable views. The same run times ``verify_resident`` over the
  attached arena.
- ``gpu_checksum``: resident checksum throughput over an arena of
  ``--size`` bytes: the whole ``checksum_tensors`` call (the row's figure,
  plan cached for the layout object), the same with a new layout object
  per call, and the kernel alone, against a naive torch sum of the same
  bytes; the torch reference path of the same checksum must agree. The
  kernel's shape is the code's default (``scripts/checksum_sweep.py``
  tunes it).
- ``gpu_daemon_attach`` (:mod:`harness.bench.gpu_daemon`): end to end
  through a real daemon.

Figures are medians of ``reps`` runs in one process; CUDA work is
synchronised before each clock read.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from harness.bench import BenchOptions, BenchResult, Figure, bench_row
from harness.bench import params as P

_DEFAULT_TENSORS = 320


# The GPU rows' parameters (gpu_attach, gpu_checksum, gpu_daemon_attach).
GPU_PARAMS = (P.Param("tensors", P.integer(1, 100_000), _DEFAULT_TENSORS),
              P.Param("reps", P.integer(1, 1000), 7))


def gpu_params(options: BenchOptions) -> tuple[int, int]:
    """``(tensors, reps)`` from the row's ``--param`` values."""
    return options.value("tensors"), options.value("reps")


def synthetic_specs(total_bytes: int, tensors: int) -> list[tuple[str, Any, tuple[int, ...], str]]:
    """``tensors`` bf16 tensors of unequal sizes adding up to about ``total_bytes``."""
    import torch

    weights = [1.0 + 0.5 * ((i * 7919) % 13) / 13 for i in range(tensors)]
    scale = total_bytes / 2 / sum(weights)
    specs: list[tuple[str, Any, tuple[int, ...], str]] = []
    for i, w in enumerate(weights):
        numel = max(1, int(w * scale) // 64 * 64)
        specs.append((f"model.layers.{i // 8}.w{i % 8}.weight", torch.bfloat16, (numel,), "param"))
    return specs


def _fill_random(views: dict[str, Any], seed: int = 0) -> None:
    import torch

    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    for t in views.values():
        flat = t.view(-1).view(torch.int16)
        flat.random_(-(1 << 15), (1 << 15) - 1, generator=gen)


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


# -- producer process (gpu_attach) ----------------------------------------------

_FD_BATCH = 200  # SCM_RIGHTS carries at most 253 fds per message


def produce(total_bytes: int, tensors: int, sock_fd: int) -> None:
    """Hold one arena and one allocation per tensor; print their descriptors,
    send their fds over ``sock_fd`` (the arena's first); wait."""
    import array
    import socket

    import torch

    from preload.checksum import checksum_tensors
    from preload.transports.base import Layout, dtype_from_name
    from preload.transports.cuda import CudaTransport

    layout = Layout.plan(synthetic_specs(total_bytes, tensors))
    arena = CudaTransport(0).create(layout)
    _fill_random(arena.views(), seed=1)
    parts = []
    for e in layout.entries:  # the anchor: one VMM allocation (and one fd) per tensor
        one = Layout.plan([(e.name, dtype_from_name(e.dtype), e.shape, e.kind)])
        part = CudaTransport(0).create(one)
        part.views()[e.name].copy_(arena.views()[e.name])
        part.seal()
        parts.append((one, part))
    sums = checksum_tensors(arena.views(), layout)
    arena.seal()
    doc = {
        "entries": layout.to_json(), "total_bytes": layout.total_bytes, "checksums": sums,
        "arena": arena.descriptor(),
        "per_tensor": [{"descriptor": p.descriptor(), "entries": one.to_json(), "total_bytes": one.total_bytes}
                       for one, p in parts],
    }
    fds = arena.fds() + [fd for _, p in parts for fd in p.fds()]
    sock = socket.socket(fileno=sock_fd)
    for i in range(0, len(fds), _FD_BATCH):
        batch = fds[i : i + _FD_BATCH]
        sock.sendmsg([b"f"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", batch))])
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()
    sys.stdin.readline()  # the consumer says when it is done
    del torch


def _receive_fds(sock: Any, count: int) -> list[int]:
    import array
    import socket

    got: list[int] = []
    while len(got) < count:
        fds = array.array("i")
        _msg, anc, _f, _a = sock.recvmsg(1, socket.CMSG_LEN(_FD_BATCH * fds.itemsize))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        if not fds:
            raise RuntimeError(f"the producer sent {len(got)} of {count} fds")
        got.extend(fds)
    return got


def _time_attach(parts: list[tuple[dict[str, Any], int, Any]]) -> tuple[float, list[Any]]:
    """Attach every (descriptor, fd, layout) from dups of the fds, timed as one."""
    import torch

    from preload.transports.cuda import CudaTransport

    dups = [os.dup(fd) for _, fd, _ in parts]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    atts = [CudaTransport(0).attach(desc, [fd], lay, writable=False)
            for (desc, _, lay), fd in zip(parts, dups, strict=True)]
    torch.cuda.synchronize()
    return time.perf_counter() - t0, atts


@bench_row("gpu_attach", "attach an 8 GB rank from its fd: one VMM arena vs one allocation per tensor",
           needs="cuda", heavy="8 GB of GPU memory, twice", params=GPU_PARAMS)
def gpu_attach(options: BenchOptions) -> list[BenchResult]:
    title = "attach across processes: one VMM arena (one fd) vs one allocation (one fd) per tensor"
    import socket

    import torch

    from preload.checksum import checksum_tensors, verify_resident
    from preload.transports.base import Layout, view

    tensors, reps = gpu_params(options)
    torch.cuda.init()
    torch.empty(1, device="cuda")
    ours_sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness.bench.gpu", "produce", str(options.size_bytes), str(tensors),
         str(theirs.fileno())],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=(theirs.fileno(),),
    )
    theirs.close()
    held: list[int] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"producer exited with {proc.wait()} before describing its arenas")
        doc = json.loads(line)
        layout = Layout.from_json(doc["entries"], doc["total_bytes"])
        held = _receive_fds(ours_sock, 1 + len(doc["per_tensor"]))
        arena_part = [(doc["arena"], held[0], layout)]
        tensor_parts = [(p["descriptor"], fd, Layout.from_json(p["entries"], p["total_bytes"]))
                        for p, fd in zip(doc["per_tensor"], held[1:], strict=True)]
        # Compile the checksum kernel outside the timed region (a one-off per process).
        warm = Layout.plan(synthetic_specs(1 << 20, 4))
        warm_base = torch.zeros(warm.total_bytes, dtype=torch.uint8, device="cuda")
        t0 = time.perf_counter()
        checksum_tensors({e.name: view(warm_base, e) for e in warm.entries}, warm)
        compile_s = time.perf_counter() - t0
        arena_s, parts_s, verify_s, both_s = [], [], [], []
        free_before = torch.cuda.mem_get_info()[0]
        mapped_delta = 0
        access = ""
        for r in range(reps + 1):
            order = ("arena", "per_tensor") if r % 2 == 0 else ("per_tensor", "arena")
            for mode in order:
                dt, atts = _time_attach(arena_part if mode == "arena" else tensor_parts)
                if mode == "arena":
                    mapped_delta = max(mapped_delta, free_before - torch.cuda.mem_get_info()[0])
                    access = atts[0].access
                    t1 = time.perf_counter()
                    verify_resident(atts[0].tensors, layout, doc["checksums"])
                    vt = time.perf_counter() - t1
                    if r:
                        arena_s.append(dt)
                        verify_s.append(vt)
                        both_s.append(dt + vt)
                elif r:
                    parts_s.append(dt)
                for att in atts:
                    att.close()
                del atts
        proc.stdin.write("done\n")
        proc.stdin.flush()
    finally:
        for fd in held:
            os.close(fd)
        ours_sock.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    gib = layout.total_bytes / (1 << 30)
    common = {
        "bytes": layout.total_bytes, "tensors": len(layout.entries), "reps": reps,
        "arena_attach_ms": [s * 1e3 for s in arena_s], "per_tensor_attach_ms": [s * 1e3 for s in parts_s],
        "verify_ms": [s * 1e3 for s in verify_s], "attach_verify_ms": [s * 1e3 for s in both_s],
        "checksum_compile_s": compile_s, "free_memory_drop_on_arena_attach_bytes": mapped_delta,
        "engine_access": access, "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
    }
    return [
        BenchResult(
            row="gpu_attach", title=f"{title} ({gib:.1f} GiB, {len(layout.entries)} tensors)",
            anchor=Figure("one allocation per tensor", median_ms(parts_s), "ms"),
            ours=Figure("one arena", median_ms(arena_s), "ms"),
            ratio=statistics.median(parts_s) / statistics.median(arena_s), ratio_meaning="faster",
            target="arena < 10 ms", details=common,
            notes=f"median over reps, alternating order; across processes; engine mapping {access}",
        ),
        BenchResult(
            row="gpu_attach", title=f"verify_resident overhead on that attach ({gib:.1f} GiB)",
            anchor=Figure("attach", median_ms(arena_s), "ms"),
            ours=Figure("attach + verify", median_ms(both_s), "ms"),
            ratio=statistics.median(verify_s) * 1e3, ratio_meaning="ms added by verify (median)",
            target="verify < 5 ms, attach+verify < 15 ms", details=common,
            notes="Triton checksum over the whole arena, compiled before timing",
        ),
    ]


# -- checksum throughput -----------------------------------------------------------


def cuda_time(fn: Callable[[], object], reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn``, CUDA work synchronised
    before each clock read; what ``fn`` returns is freed after its clock stops."""
    import torch

    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        kept = fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
        del kept
    return out


def _copy_times(src: Any, reps: int) -> list[float]:
    import torch

    dst = torch.empty_like(src)
    return cuda_time(lambda: dst.copy_(src), reps)


@bench_row("gpu_checksum", "resident checksum throughput: one Triton launch vs naive torch", needs="cuda",
           params=GPU_PARAMS)
def gpu_checksum(options: BenchOptions) -> list[BenchResult]:
    title = "resident-weight checksum throughput"
    import torch

    from preload import checksum as ck
    from preload.checksum import planner
    from preload.transports.base import Layout
    from preload.transports.cuda import CudaTransport

    tensors, reps = gpu_params(options)
    layout = Layout.plan(synthetic_specs(options.size_bytes, tensors))
    arena = CudaTransport(0).create(layout)
    views = arena.views()
    _fill_random(views, seed=2)
    arena.seal()
    base = arena.base
    assert base is not None
    nbytes = sum(e.nbytes for e in layout.entries)
    # The kernel's shape is tuned by scripts/checksum_sweep.py (every shape
    # gives the same lanes); this row times the shape checksum_tensors uses.
    shape = ck.KernelShape.from_env()
    ck.checksum_tensors(views, layout, backend="triton")  # compiles, builds this layout's plan
    fast = cuda_time(lambda: ck.checksum_tensors(views, layout, backend="triton"), reps)
    # An engine's verify gets its layout from JSON: a new object, so no cached plan.
    fresh = iter([Layout(tuple(layout.entries), layout.total_bytes) for _ in range(reps)])
    cold = cuda_time(lambda: ck.checksum_tensors(views, next(fresh), backend="triton"), reps)
    kernel = cuda_time(lambda: planner.lanes_triton(base, layout), reps)
    # kernel + copy back + hex, without checking the views: what the whole call adds on top is the check.
    kernel_hex = cuda_time(lambda: planner.hex_rows(planner.lanes_triton(base, layout)), reps)
    # Naive torch: one unweighted reduction over the same bytes (it cannot see swaps);
    # the ceiling torch's own kernels give a checksum pass.
    words = base.view(torch.int64)
    naive = cuda_time(lambda: words.sum(), reps + 1)[1:]
    slow = cuda_time(lambda: ck.checksum_tensors(views, layout, backend="torch"), 1)
    same = ck.checksum_tensors(views, layout, backend="triton") == ck.checksum_tensors(views, layout, backend="torch")
    copy = _copy_times(base, reps)
    tbps = nbytes / statistics.median(fast) / 1e12
    cold_tbps = nbytes / statistics.median(cold) / 1e12
    kernel_tbps = nbytes / statistics.median(kernel) / 1e12
    naive_tbps = layout.total_bytes / statistics.median(naive) / 1e12
    ref_tbps = nbytes / statistics.median(slow) / 1e12
    copy_tbps = 2 * layout.total_bytes / statistics.median(copy) / 1e12
    arena.close()
    return [BenchResult(
        row="gpu_checksum", title=f"{title} ({nbytes / (1 << 30):.1f} GiB, {len(layout.entries)} tensors)",
        anchor=Figure("naive torch sum (unweighted)", naive_tbps, "TB/s"),
        ours=Figure("checksum_tensors (Triton, one launch)", tbps, "TB/s"),
        ratio=tbps / naive_tbps, ratio_meaning="of the naive sum's throughput", target=">= 0.95x of the naive sum",
        details={
            "bytes": nbytes, "tensors": len(layout.entries), "triton_s": fast, "naive_sum_s": naive,
            "torch_reference_s": slow, "torch_reference_tbps": ref_tbps,
            "kernel_only_s": kernel, "kernel_only_tbps": kernel_tbps, "kernel_and_hex_s": kernel_hex,
            "new_layout_object_s": cold, "new_layout_object_tbps": cold_tbps,
            "kernel_tile": shape.tile, "kernel_iters": shape.iters, "kernel_warps": shape.warps,
            "copy_read_plus_write_tbps": copy_tbps, "backends_agree": same,
            "device": torch.cuda.get_device_name(0),
        },
        notes=(f"whole call, same layout object (plan cached); kernel alone {kernel_tbps:.2f} TB/s; "
               f"whole call with a new layout object (plan built) {cold_tbps:.2f} TB/s; shape tile={shape.tile} "
               f"iters={shape.iters} warps={shape.warps}; backends agree: {same}; torch reference "
               f"(same math) {ref_tbps:.3f} TB/s; d2d copy {copy_tbps:.2f} TB/s (read+write)"),
    )]


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "produce":
        os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
        produce(int(argv[1]), int(argv[2]), int(argv[3]))
        return 0
    print("usage: python -m harness.bench.gpu produce BYTES TENSORS SOCKET_FD", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
