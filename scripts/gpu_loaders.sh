#!/usr/bin/env bash
# vLLM's fast loaders through the gate on a GPU machine (issue 41, step 1):
#   bash scripts/gpu_loaders.sh CKPT|tiny OUTDIR [TARGETS] [MUTATIONS]
# For each target (default fastsafetensors,instanttensor,runai_streamer,tensorizer) it runs
#   python3 -m preload_gate gate CKPT --base CKPT --mutations MUTATIONS --target T --report OUTDIR/T
# (MUTATIONS default identical_copy,zeroed_norm), the `auto` references computed once and shared
# (OUTDIR/references), each target's engine logs and candidates kept in OUTDIR/work/T, its terminal
# output in OUTDIR/T.log; then OUTDIR/summary.txt: one line per target (verdict, counts, why not run).
# CKPT=tiny builds the tiny fixture into OUTDIR/tiny first.
# Needs only python3 with vLLM importable and this repo on PYTHONPATH (run from its root: it adds
# $PWD). A loader whose package is absent, or that needs CUDA where there is none, is reported
# NOT_RUN with the reason (exit 2 for that target), never as passed.
# Exit: 1 if some target BLOCKed, else 0 if some target ran and passed, else 2.
# Env: PYTHON (python3), ENGINE_TIMEOUT (600 s per engine), GATE_TIMEOUT (1500 s per target).
set -u -o pipefail
CKPT=${1:?usage: gpu_loaders.sh CKPT|tiny OUTDIR [TARGETS] [MUTATIONS]}
OUT=${2:?usage: gpu_loaders.sh CKPT|tiny OUTDIR [TARGETS] [MUTATIONS]}
TARGETS=${3:-fastsafetensors,instanttensor,runai_streamer,tensorizer}
MUTATIONS=${4:-identical_copy,zeroed_norm}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT/work"

# What ran: versions, the GPU, and each loader package's presence (the reasons NOT_RUN will give).
$PY - <<'PY' 2>&1 | tee "$OUT/env.txt"
import importlib.metadata as md, importlib.util as u, json
def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
import torch
print(json.dumps({
    "vllm": version("vllm"), "torch": torch.__version__, "cuda": torch.version.cuda,
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    "loaders": {m: version(d) if u.find_spec(m) else None for m, d in (
        ("fastsafetensors", "fastsafetensors"), ("instanttensor", "instanttensor"),
        ("runai_model_streamer", "runai-model-streamer"), ("tensorizer", "tensorizer"))},
}))
PY

if [ "$CKPT" = tiny ]; then
    $PY -m preload_gate fixtures tiny "$OUT/tiny" >/dev/null || { echo "gpu_loaders: the tiny fixture failed" >&2; exit 2; }
    CKPT="$OUT/tiny"
fi

codes=()
: >"$OUT/summary.txt"
for t in ${TARGETS//,/ }; do
    rm -rf "${OUT:?}/$t" "${OUT:?}/work/$t"
    timeout "${GATE_TIMEOUT:-1500}" $PY -m preload_gate gate "$CKPT" --base "$CKPT" --mutations "$MUTATIONS" \
        --target "$t" --report "$OUT/$t" --workdir "$OUT/work/$t" --reference-cache "$OUT/references" \
        --engine-timeout "${ENGINE_TIMEOUT:-600}" 2>&1 | tee "$OUT/$t.log"
    rc=${PIPESTATUS[0]}
    codes+=("$rc")
    $PY - "$t" "$OUT/$t/report.json" "$rc" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
t, path, rc = sys.argv[1:]
try:
    d = json.load(open(path))
except OSError:
    print(f"{t}: exit {rc}, no report (see {t}.log)")
    raise SystemExit
c = d["counts"]
why = sorted({x.get("not_run_reason", "") for x in d["cases"] if x["status"] == "NOT_RUN"} - {""})
print(f"{t}: {d['verdict']} (exit {rc}): {c['PASS']} passed, {c['BLOCK']} blocked, {c['NOT_RUN']} not run"
      + (f"; not run because: {' | '.join(why)}" if why else ""))
PY
done
case " ${codes[*]} " in
    *" 1 "*) exit 1 ;;
    *" 0 "*) exit 0 ;;
    *) exit 2 ;;
esac
