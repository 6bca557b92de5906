"""Sweep the resident-checksum kernel's shape on one CUDA GPU, in one process.

    python3 scripts/checksum_sweep.py --size 8G --out sweep.json [--env best.env]

For every (tile, iters, warps) the kernel's lanes over a ``--size`` arena of
320 bf16 tensors must equal the torch reference path's, bit for bit (a
shape that disagrees is recorded as failed, never timed). Each shape is
timed kernel-only (launch plan cached, as in a verify loop); the fastest is
then timed as a whole ``checksum_tensors`` call, next to a naive torch sum
and a device-to-device copy of the same bytes. ``--env`` writes
``export PRELOAD_GATE_CHECKSUM_KERNEL=TILE,ITERS,WARPS`` for the fastest
shape, so the bench and tests that follow in the same machine session run
with it. Medians of ``--reps`` runs; CUDA work synchronised around each clock read.

There is no num_stages axis: a program's block loop is unrolled
(``tl.static_range``), so Triton has no loop to software-pipeline.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TILES = (1024, 2048, 4096)
ITERS = (4, 8, 16)
WARPS = (4, 8)


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn: Callable[[], object], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="8G")
    ap.add_argument("--tensors", type=int, default=320)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", required=True)
    ap.add_argument("--env")
    ap.add_argument("--device", default="cuda", help="cpu runs the sweep's logic under TRITON_INTERPRET=1")
    args = ap.parse_args()

    import torch

    from harness.bench.gpu import synthetic_specs
    from preload import checksum as ck
    from preload.checksum import planner
    from preload.transports.base import Layout, view

    layout = Layout.plan(synthetic_specs(_size(args.size), args.tensors))
    gen = torch.Generator(device=args.device)
    gen.manual_seed(3)
    base = torch.empty(layout.total_bytes // 2, dtype=torch.int16, device=args.device)
    base.random_(-(1 << 15), (1 << 15) - 1, generator=gen)
    base = base.view(torch.uint8)
    views = {e.name: view(base, e) for e in layout.entries}
    nbytes = sum(e.nbytes for e in layout.entries)
    t0 = time.perf_counter()
    ref = ck.checksum_tensors(views, layout, backend="torch")
    ref_s = time.perf_counter() - t0
    results: dict[str, dict[str, object]] = {}
    for tile, iters, warps in itertools.product(TILES, ITERS, WARPS):
        key = f"tile={tile},iters={iters},warps={warps}"
        try:
            t0 = time.perf_counter()
            lanes = planner.lanes_triton(base, layout, iters=iters, warps=warps, tile=tile)
            _sync()
            compile_s = time.perf_counter() - t0
            assert lanes is not None
            same = dict(zip((e.name for e in layout.entries), planner.hex_rows(lanes), strict=True)) == ref
            if not same:
                results[key] = {"same_as_reference": False}
                print(key, "DIFFERS from the torch reference", flush=True)
                continue
            t = _time(lambda i=iters, w=warps, b=tile: planner.lanes_triton(base, layout, iters=i, warps=w, tile=b),
                      args.reps)
            tbps = nbytes / statistics.median(t) / 1e12
            results[key] = {"same_as_reference": True, "kernel_tbps": tbps, "s": t, "compile_s": compile_s}
            print(f"{key}: {tbps:.3f} TB/s", flush=True)
        except Exception as exc:  # noqa: BLE001 - a shape that cannot compile is a result, not a crash
            results[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(key, "failed:", results[key]["error"], flush=True)
    timed = {k: v for k, v in results.items() if "kernel_tbps" in v}
    best = max(timed, key=lambda k: timed[k]["kernel_tbps"])  # type: ignore[arg-type, return-value]
    tile, iters, warps = (int(p.split("=")[1]) for p in best.split(","))
    os.environ[ck.SHAPE_ENV] = f"{tile},{iters},{warps}"
    ck.checksum_tensors(views, layout, backend="triton")  # plan for this layout object, built once
    whole = _time(lambda: ck.checksum_tensors(views, layout, backend="triton"), args.reps)
    cold_layouts = [Layout(tuple(layout.entries), layout.total_bytes) for _ in range(args.reps)]
    it = iter(cold_layouts)
    cold = _time(lambda: ck.checksum_tensors(views, next(it), backend="triton"), args.reps)
    agree = ck.checksum_tensors(views, layout, backend="triton") == ref
    words = base.view(torch.int64)
    naive = _time(lambda: words.sum(), args.reps + 1)[1:]
    dst = torch.empty_like(base)
    copy = _time(lambda: dst.copy_(base), args.reps)
    doc = {
        "bytes": nbytes, "tensors": len(layout.entries), "reps": args.reps, "device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
        "torch": torch.__version__, "torch_reference_s": ref_s, "shapes": results, "best": best,
        "best_kernel_only_tbps": timed[best]["kernel_tbps"],
        "best_whole_call_tbps": nbytes / statistics.median(whole) / 1e12, "whole_call_s": whole,
        "best_whole_call_new_layout_object_tbps": nbytes / statistics.median(cold) / 1e12,
        "whole_call_agrees_with_reference": agree,
        "naive_sum_tbps": layout.total_bytes / statistics.median(naive) / 1e12,
        "copy_read_plus_write_tbps": 2 * layout.total_bytes / statistics.median(copy) / 1e12,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1))
    if args.env:
        Path(args.env).write_text(f"export {ck.SHAPE_ENV}={tile},{iters},{warps}\n")
    print(json.dumps({k: v for k, v in doc.items() if k not in ("shapes", "whole_call_s")}, indent=1))
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
