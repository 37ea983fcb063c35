#!/usr/bin/env bash
# A data-parallel GPU decode instance losing a rank under load (docs/parallel.md,
# "when a rank dies"): router + prefill on GPU 0 + `decode --dp 2 --ep 2
# --gpus 0,D` (D = 1 on two GPUs, else 0) serving the demo model, loaded by
# `moeserve bench serve`; then
#   leader: kill -9 the decode leader (rank 0) while steps run. Its follower
#     must end its expert exchange's waits and exit within FOLLOWER_EXIT_S
#     (default 5; the kernels' own timeout is ~10 s), logging that the leader
#     went away;
#   follower: on a fresh instance, kill -9 rank 1. The leader must log that
#     the instance's collectives are abandoned within 2 s, its requests must
#     end (bench serve returns, failed requests counted) rather than hang,
#     and the leader must still answer /health (503 expected: its exchange is gone).
# Binaries from `cmake --build build-gpu --target moeserve` (tools/gpu/check.sh).
# Logs in $OUT (default /tmp/out): dp_kill_summary.txt and one log per
# process. Exit status 0 when both cases passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/gpu/lib.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
BIN=${BIN:-build-gpu/bin}
MODEL=${MODEL:-models/moeserve-demo}
FOLLOWER_EXIT_S=${FOLLOWER_EXIT_S:-5}
ROUTER_PORT=18650 PREFILL_PORT=18651 DECODE_PORT=18652
mkdir -p "$OUT"
summary="$OUT/dp_kill_summary.txt"
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }
num_gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
DECODE_GPU=$([[ $num_gpus -ge 2 ]] && echo 1 || echo 0)
status=0
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }
stop() {
  for pid in "$@"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "$@"; do timeout 30 tail --pid="$pid" -f /dev/null 2>/dev/null; kill -9 "$pid" 2>/dev/null; done
}

# Starts router, prefill and the two-rank decode instance; sets router,
# prefill, decode (the leader's pid) and follower. Returns 1 if they do not
# all register with the router.
start_instances() {
  local tag=$1
  local common=(--model "$MODEL" --device cuda --kv-cache-gb 4 --host 127.0.0.1 --router "http://127.0.0.1:$ROUTER_PORT")
  "$BIN/moeserve" router --model "$MODEL" --port $ROUTER_PORT > "$OUT/dp_kill_${tag}_router.log" 2>&1 &
  router=$!
  "$BIN/moeserve" prefill "${common[@]}" --gpu 0 --port $PREFILL_PORT > "$OUT/dp_kill_${tag}_prefill.log" 2>&1 &
  prefill=$!
  "$BIN/moeserve" decode "${common[@]}" --dp 2 --ep 2 --gpus "0,$DECODE_GPU" --port $DECODE_PORT \
    > "$OUT/dp_kill_${tag}_decode.log" 2>&1 &
  decode=$!
  local registered
  registered=$(wait_router_instances "http://127.0.0.1:$ROUTER_PORT" 3 600 "$decode" "$prefill")
  follower=$(pgrep -P "$decode" -f moeserve | head -1)
  if [[ $registered -lt 3 || -z $follower ]]; then
    say "  FAILED: $registered of 3 instances registered, follower pid '${follower}'"
    tail -5 "$OUT/dp_kill_${tag}_decode.log" | tee -a "$summary"
    return 1
  fi
  say "  instances up: router $router, prefill $prefill, decode leader $decode, follower $follower"
}

# Load through the router in the background: 96 requests of 32 -> 400 tokens, 32 at once.
start_load() {
  local tag=$1
  timeout 120 "$BIN/moeserve" bench serve --url "http://127.0.0.1:$ROUTER_PORT" --random-input-len 32 \
    --random-output-len 400 --num-prompts 96 --max-concurrency 32 --random-vocab-lo 100 --random-vocab-hi 1000 \
    > "$OUT/dp_kill_${tag}_bench.log" 2>&1 &
  bench=$!
  sleep 4  # decode steps in flight
}

say "=== leader killed: decode --dp 2 --ep 2 --gpus 0,$DECODE_GPU, $MODEL"
if start_instances leader; then
  start_load leader
  t0=$(now)
  kill -9 "$decode"
  waited=fail
  for _ in $(seq 1 $((FOLLOWER_EXIT_S * 20 + 200))); do
    if ! kill -0 "$follower" 2> /dev/null; then waited=$(since "$t0"); break; fi
    sleep 0.05
  done
  gone=$(grep -c "the leader rank went away" "$OUT/dp_kill_leader_decode.log")
  if [[ $waited == fail ]]; then
    say "  FAILED: the follower still runs $((FOLLOWER_EXIT_S + 10)) s after its leader was killed"
    kill -9 "$follower" 2> /dev/null
    status=1
  elif awk -v w="$waited" -v limit="$FOLLOWER_EXIT_S" 'BEGIN { exit !(w <= limit) }' && [[ $gone -ge 1 ]]; then
    say "  ok: the follower exited ${waited} s after its leader was killed (limit ${FOLLOWER_EXIT_S} s)"
  else
    say "  FAILED: the follower exited after ${waited} s (limit ${FOLLOWER_EXIT_S} s); 'leader went away' logged $gone times"
    status=1
  fi
  grep -E "leader rank went away|abandoned|timed out|error" "$OUT/dp_kill_leader_decode.log" | head -5 | sed 's/^/  log: /' | tee -a "$summary"
  wait "$bench" 2> /dev/null
  say "  bench serve exit $?: $(grep -E "Successful|Failed" "$OUT/dp_kill_leader_bench.log" | tr '\n' ' ')"
  stop "$prefill" "$router"
else
  status=1
  stop "$decode" "$prefill" "$router"
fi

say "=== follower killed: the same instances again"
if start_instances follower; then
  start_load follower
  t0=$(now)
  kill -9 "$follower"
  abandoned=fail
  for _ in $(seq 1 100); do
    if grep -q "collectives are abandoned" "$OUT/dp_kill_follower_decode.log"; then abandoned=$(since "$t0"); break; fi
    sleep 0.05
  done
  wait "$bench" 2> /dev/null
  bench_status=$?
  bench_s=$(since "$t0")
  health=$(curl -s -o /dev/null -w "%{http_code}" "http://127.0.0.1:$DECODE_PORT/health")
  say "  leader logged the abandon after ${abandoned} s; bench serve returned ${bench_s} s after the kill (exit $bench_status):" \
    "$(grep -E "Successful|Failed" "$OUT/dp_kill_follower_bench.log" | tr '\n' ' ')"
  say "  leader alive: $(kill -0 "$decode" 2> /dev/null && echo yes || echo no), /health $health"
  grep -E "abandoned|timed out|error" "$OUT/dp_kill_follower_decode.log" | head -5 | sed 's/^/  log: /' | tee -a "$summary"
  if [[ $abandoned == fail || $bench_status -eq 124 || $health == 000 ]] || ! kill -0 "$decode" 2> /dev/null; then
    say "  FAILED"
    status=1
  else
    say "  ok"
  fi
  stop "$decode" "$prefill" "$router"
else
  status=1
  stop "$decode" "$prefill" "$router"
fi
exit $status
