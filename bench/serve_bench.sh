#!/usr/bin/env bash
# Serving throughput and latency of the demo model on the CPU at concurrency
# 1, 8 and 32 (`moeserve bench serve`, random token-id prompts, ignore_eos).
# Writes bench/results/<date>_serve_cpu.md and one JSON per concurrency.
# Usage: bench/serve_bench.sh [BUILD_DIR] [INPUT_LEN] [OUTPUT_LEN]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
input_len=${2:-128}
output_len=${3:-64}
bin="$build/bin/moeserve"
date=$(date -u +%Y-%m-%d)
out="bench/results/${date}_serve_cpu"
mkdir -p bench/results
work=$(mktemp -d)
"$bin" serve --port 0 --max-num-seqs 64 >"$work/serve.out" 2>"$work/serve.err" &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 100); do grep -q 'listening on' "$work/serve.out" && break; sleep 0.1; done
url=$(grep -o 'http://127.0.0.1:[0-9]*' "$work/serve.out")
"$bin" bench serve --url "$url" --random-input-len 16 --random-output-len 8 --num-prompts 8 >/dev/null 2>&1  # warm-up
{
  echo "# Serving benchmark: demo model on the CPU ($date)"
  echo
  echo "- commit: $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (+ uncommitted changes)')"
  echo "- machine: $(nproc) vCPU, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), shared with other work"
  echo "- server: \`$bin serve --max-num-seqs 64\` (models/moeserve-demo, 6.6 M parameters, bf16 weights, f32 KV)"
  echo "- load: \`$bin bench serve --random-input-len $input_len --random-output-len $output_len --num-prompts N --max-concurrency C --seed 0\`"
  echo
} >"$out.md"
for c in 1 8 32; do
  n=$((c * 4 < 16 ? 16 : c * 4))
  echo "## concurrency $c, $n prompts" >>"$out.md"
  echo '```' >>"$out.md"
  "$bin" bench serve --url "$url" --random-input-len "$input_len" --random-output-len "$output_len" \
    --num-prompts "$n" --max-concurrency "$c" --seed 0 --save-result "${out}_c${c}.json" 2>/dev/null | tee -a "$out.md"
  echo '```' >>"$out.md"
done
echo "wrote $out.md"
