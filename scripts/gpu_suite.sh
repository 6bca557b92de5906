#!/usr/bin/env bash
# The GPU tier in one go, as run on an H200 through the device tool:
#   bash scripts/gpu_suite.sh OUTDIR [BENCH_SIZE]
# 1. environment facts (torch, triton, transformers, GPU, driver);
# 2. the GPU tests (tests/gpu) plus the checksum/descriptor unit tests;
# 3. the GPU benchmark rows (gpu_checksum, gpu_attach, gpu_daemon_attach)
#    at BENCH_SIZE (default 8G), raw numbers in OUTDIR/bench/bench.json.
# Needs what the GPU machine's python3 has (torch, triton,
# transformers, safetensors, pytest), plus msgspec from a wheel carried in
# .whl/ (see below); the repo runs from its checkout.
set -u -o pipefail
OUT=${1:?usage: gpu_suite.sh OUTDIR [BENCH_SIZE]}
SIZE=${2:-8G}
PY=${PYTHON:-python3}
mkdir -p "$OUT/bench"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PRELOAD_GATE_BENCH_DIR=${PRELOAD_GATE_BENCH_DIR:-/tmp}
status=0
# msgspec (the wire and manifest schemas) is not on the GPU image: install it
# beside the run from a wheel carried in .whl/ (device call: carry [".whl"]).
if ! $PY -c "import msgspec" 2>/dev/null; then
    ls .whl/msgspec-*.whl >/dev/null 2>&1 || { echo "gpu_suite: msgspec missing and no .whl/msgspec-*.whl carried" >&2; exit 2; }
    # pip picks the wheel built for this python from the folder (one per CPython tag may be carried).
    $PY -m pip install -q --no-deps --no-index --find-links .whl --target /tmp/pg-gpu-deps msgspec || exit 2
    export PYTHONPATH="$PYTHONPATH:/tmp/pg-gpu-deps"
fi

$PY - <<'PY' 2>&1 | tee "$OUT/env.txt"
import json, platform, subprocess
import torch, transformers
try:
    import triton; tv = triton.__version__
except Exception as exc:  # noqa: BLE001
    tv = f"unavailable: {exc}"
p = torch.cuda.get_device_properties(0)
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
print(json.dumps({"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                  "triton": tv, "transformers": transformers.__version__, "gpu": p.name,
                  "uuid": str(p.uuid), "sms": p.multi_processor_count, "nvidia_smi": smi}))
PY

timeout 330 $PY -m pytest -q -p no:cacheprovider -o addopts="" -rs --durations=15 \
    tests/gpu tests/unit/test_checksum.py tests/unit/test_checksum_shapes.py tests/unit/test_cuda_descriptor.py 2>&1 | tee "$OUT/pytest.log" || status=1

timeout 240 $PY -m preload_gate bench --only gpu_checksum,gpu_attach,gpu_daemon_attach --size "$SIZE" \
    --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" || status=1
exit $status
