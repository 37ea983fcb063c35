#!/usr/bin/env bash
# TTFT and time per output token, colocated `serve` vs `serve --disagg` (1 prefill
# + 1 decode instance), demo model on the CPU, `moeserve bench serve` (random
# token-id prompts, ignore_eos) at concurrency 1 and 8. Both setups get the same
# engine flags; on a small machine the disaggregated processes share the cores.
# Writes bench/results/<date>_disagg_cpu.md and one JSON per run.
# Usage: bench/disagg_bench.sh [BUILD_DIR] [INPUT_LEN] [OUTPUT_LEN]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
input_len=${2:-128}
output_len=${3:-64}
bin="$build/bin/moeserve"
date=$(date -u +%Y-%m-%d)
out="bench/results/${date}_disagg_cpu"
mkdir -p bench/results
work=$(mktemp -d)
pid=
trap 'if [[ -n $pid ]]; then kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; fi; rm -rf "$work"' EXIT
flags=(--max-num-seqs 64 --kv-cache-gb 0.2)
{
  echo "# Disaggregated vs colocated serving: demo model on the CPU ($date)"
  echo
  echo "- commit: $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (+ uncommitted changes)')"
  echo "- machine: $(nproc) vCPU, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), shared with other work"
  echo "- colocated: \`$bin serve ${flags[*]}\`; disaggregated: \`$bin serve --disagg ${flags[*]}\` (router + 1 prefill + 1 decode process, KV over the TCP TransferEngine)"
  echo "- load: \`$bin bench serve --random-input-len $input_len --random-output-len $output_len --num-prompts N --max-concurrency C --seed 0\`"
  echo
} >"$out.md"
for mode in colocated disagg; do
  extra=()
  [[ $mode == disagg ]] && extra=(--disagg)
  "$bin" serve --port 0 "${flags[@]}" "${extra[@]}" >"$work/serve.out" 2>"$work/serve.err" &
  pid=$!
  for _ in $(seq 300); do grep -q 'listening on' "$work/serve.out" && break; sleep 0.1; done
  url=$(grep -o 'http://127.0.0.1:[0-9]*' "$work/serve.out")
  "$bin" bench serve --url "$url" --random-input-len 16 --random-output-len 8 --num-prompts 8 >/dev/null 2>&1  # warm-up
  for c in 1 8; do
    n=$((c * 4 < 16 ? 16 : c * 4))
    echo "## $mode, concurrency $c, $n prompts" >>"$out.md"
    echo '```' >>"$out.md"
    "$bin" bench serve --url "$url" --random-input-len "$input_len" --random-output-len "$output_len" \
      --num-prompts "$n" --max-concurrency "$c" --seed 0 --save-result "${out}_${mode}_c${c}.json" 2>/dev/null | tee -a "$out.md"
    echo '```' >>"$out.md"
  done
  kill $pid; wait $pid || true; pid=
done
echo "wrote $out.md"
