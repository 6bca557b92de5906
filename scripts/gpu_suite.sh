#!/usr/bin/env bash
# The GPU tier in one go, as run on an H200 through the device tool:
#   bash scripts/gpu_suite.sh OUTDIR [BENCH_SIZE] [STEPS]
# STEPS (comma-separated, default env,tests,bench):
#   env    environment facts (torch, triton, transformers, cuda-bindings, GPU, driver) -> OUTDIR/env.txt
#   sweep  the checksum kernel's shape sweep (scripts/checksum_sweep.py) -> OUTDIR/sweep.json;
#          its best shape is exported for the steps after it
#   tests  the GPU tests (tests/gpu) plus the checksum/descriptor unit tests -> OUTDIR/pytest.log
#   bench  the GPU benchmark rows ($BENCH_ROWS, default gpu_checksum,gpu_attach,gpu_daemon_attach,gpu_readopt)
#          at BENCH_SIZE (default 8G) -> OUTDIR/bench/bench.json
# Per-step time limits: TESTS_TIMEOUT (480), BENCH_TIMEOUT (240), SWEEP_TIMEOUT (150) seconds
# (the tests took 341 s on one H200 machine and more than 350 s on another: the 8 GiB test writes and reads 8.8 GB).
# Steps run in the order above whatever order STEPS names them in.
# Needs what the GPU machine's python3 has (torch, triton, transformers,
# safetensors, pytest, cuda-bindings), plus msgspec from a wheel carried in
# .whl/ (see below); the repo runs from its checkout.
set -u -o pipefail
OUT=${1:?usage: gpu_suite.sh OUTDIR [BENCH_SIZE] [STEPS]}
SIZE=${2:-8G}
STEPS=",${3:-env,tests,bench},"
PY=${PYTHON:-python3}
ROWS=${BENCH_ROWS:-gpu_checksum,gpu_attach,gpu_daemon_attach,gpu_readopt}
mkdir -p "$OUT/bench"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PRELOAD_GATE_BENCH_DIR=${PRELOAD_GATE_BENCH_DIR:-/tmp}
status=0
has() { [[ "$STEPS" == *",$1,"* ]]; }
# msgspec (the wire and manifest schemas) is not on the GPU image: install it
# beside the run from a wheel carried in .whl/ (device call: carry [".whl"]).
if ! $PY -c "import msgspec" 2>/dev/null; then
    ls .whl/msgspec-*.whl >/dev/null 2>&1 || { echo "gpu_suite: msgspec missing and no .whl/msgspec-*.whl carried" >&2; exit 2; }
    # pip picks the wheel built for this python from the folder (one per CPython tag may be carried).
    $PY -m pip install -q --no-deps --no-index --find-links .whl --target /tmp/pg-gpu-deps msgspec || exit 2
    export PYTHONPATH="$PYTHONPATH:/tmp/pg-gpu-deps"
fi

if has env; then
$PY - <<'PY' 2>&1 | tee "$OUT/env.txt"
import json, platform, subprocess
import torch, transformers
def version(mod):
    try:
        return __import__(mod, fromlist=["__version__"]).__version__
    except Exception as exc:  # noqa: BLE001
        return f"unavailable: {exc}"
p = torch.cuda.get_device_properties(0)
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
print(json.dumps({"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                  "triton": version("triton"), "cuda_bindings": version("cuda.bindings"),
                  "transformers": transformers.__version__, "gpu": p.name,
                  "uuid": str(p.uuid), "sms": p.multi_processor_count, "nvidia_smi": smi}))
PY
fi

if has sweep; then
    timeout "${SWEEP_TIMEOUT:-150}" $PY scripts/checksum_sweep.py --size "$SIZE" --out "$OUT/sweep.json" \
        --env "$OUT/best.env" 2>&1 | tee "$OUT/sweep.log" || status=1
    # shellcheck disable=SC1091
    [ -f "$OUT/best.env" ] && . "$OUT/best.env"
fi

if has tests; then
    export PRELOAD_GATE_GPU_FIGURES="$OUT/figures.json"  # the 8 GiB re-adoption test's timings
    timeout "${TESTS_TIMEOUT:-480}" $PY -m pytest -q -p no:cacheprovider -o addopts="" -rs --durations=20 \
        tests/gpu tests/unit/test_checksum.py tests/unit/test_checksum_shapes.py tests/unit/test_cuda_descriptor.py \
        2>&1 | tee "$OUT/pytest.log" || status=1
fi

if has bench; then
    timeout "${BENCH_TIMEOUT:-240}" $PY -m preload_gate bench --only "$ROWS" --size "$SIZE" \
        --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" || status=1
    rm -f "$OUT/bench/bench.html" "$OUT/bench/bench.md"  # bench.json holds it all; the device returns 8 files
fi
exit $status
