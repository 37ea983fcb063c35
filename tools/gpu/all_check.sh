#!/usr/bin/env bash
# One device call for everything GPU: the GPU tests (check.sh), the
# communication layer when two GPUs are present (comm_check.sh), the
# benchmarks and their PyTorch peers (bench.sh), and the end-to-end serving
# check (serve_check.sh), from binaries built elsewhere (see check.sh). Each
# part has its own time limit; the logs of all parts are packed into
# $OUT/logs.tgz (the device tool returns at most 8 files) next to
# $OUT/summary.txt. Run it under the device call's limit with room to spare:
# the parts' limits add up to more than one call's 10 minutes.
#
#   PARTS="check comm bench serve disagg ranks" (default: all) picks parts;
#   BENCH_ONLY=moe_prefill passes --only to gpu_bench; PEERS=0 skips the PyTorch peers.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
LOGS=$(mktemp -d)
PARTS=${PARTS:-check comm bench serve disagg ranks}
mkdir -p "$OUT"
status=0
run_part() {  # name, seconds, script
  local name=$1 seconds=$2 script=$3 start=$SECONDS
  echo "=== $name (limit ${seconds}s)"
  OUT="$LOGS/$name" timeout "$seconds" bash "$script" > "$LOGS/$name.txt" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - start)) s" | tee -a "$LOGS/summary.txt"
  [[ $rc -eq 0 ]] || status=1
  tar czf "$OUT/logs.tgz" -C "$LOGS" .  # after every part, in case the call's limit stops a later one
}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
for part in $PARTS; do
  case $part in
    check) run_part check 300 tools/gpu/check.sh ;;
    comm) if [[ $gpus -ge 2 ]]; then run_part comm 240 tools/gpu/comm_check.sh; else echo "comm: skipped, $gpus GPU(s)"; fi ;;
    bench) BENCH_ONLY=${BENCH_ONLY:-} PEERS=${PEERS:-1} run_part bench 420 tools/gpu/bench.sh ;;
    serve) run_part serve 120 tools/gpu/serve_check.sh ;;
    disagg) run_part disagg 240 tools/gpu/disagg_check.sh ;;  # one GPU: both instances on it
    ranks) if [[ $gpus -ge 2 ]]; then run_part ranks 420 tools/gpu/ranks_bench.sh; else echo "ranks: skipped, $gpus GPU(s)"; fi ;;
  esac
done
{
  echo "--- check"; grep -hE "PASSED|FAILED|SKIPPED" "$LOGS"/check/*_test.log 2>/dev/null | head -40
  echo "--- comm"; grep -E "PASSED|FAILED|SKIPPED|^\|" "$LOGS/comm.txt" 2>/dev/null | head -60
  echo "--- bench"; grep -vE "^\{" "$LOGS/bench/gpu_bench.log" 2>/dev/null; cat "$LOGS/bench/peer_bench.jsonl" 2>/dev/null
  echo "--- disagg"; cat "$LOGS/disagg/summary.txt" 2>/dev/null
  echo "--- ranks"; grep -E "^\||dummy|skipped|did not start" "$LOGS/ranks.txt" 2>/dev/null
} >> "$LOGS/summary.txt"
cp "$LOGS/summary.txt" "$OUT/summary.txt"
tar czf "$OUT/logs.tgz" -C "$LOGS" .
cat "$OUT/summary.txt"
exit $status
