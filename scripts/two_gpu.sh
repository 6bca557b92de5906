#!/usr/bin/env bash
# Issue 16 on a two-GPU machine (nvidia-h200-x2), in one device call:
#   bash scripts/two_gpu.sh OUTDIR [GB_PER_GPU]
# 1. the parallel GPU tests (DP=2 by UUID incl. reversed CUDA_VISIBLE_DEVICES,
#    TP=2 NCCL decode vs from_pretrained(tp_plan="auto"), missing rank with
#    fallback on/off) and the CPU TP=2 tests under this machine's transformers;
# 2. the 8 GB/GPU synthetic Llama: TP=1 vs TP=2 first differing position,
#    free memory per GPU, attach seconds per rank vs disk load (OUTDIR/two_gpu.json).
# NVLink multicast stays off (KINDS.md).
set -u -o pipefail
OUT=${1:?usage: two_gpu.sh OUTDIR [GB_PER_GPU]}
GB=${2:-8}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
timeout 420 $PY -m pytest -q -p no:cacheprovider -p no:randomly -o addopts="" -rs \
    tests/gpu/test_gpu_parallel.py tests/unit/test_tp_raw.py tests/unit/test_tp_slice.py 2>&1 | tee "$OUT/pytest_parallel.log" || status=1
timeout 900 $PY scripts/two_gpu.py "$OUT" "$GB" 2>&1 | tail -c 20000 > "$OUT/two_gpu.log" || status=1
exit $status
