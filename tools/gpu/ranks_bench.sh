#!/usr/bin/env bash
# GPU ranks against one GPU (issue: several GPUs; docs/parallel.md "On GPUs"):
# a dummy Qwen3-235B-A22B cut to LAYERS layers, served on one GPU and as one
# instance over WORLD GPUs (each LAYOUT in turn), loaded by `moeserve bench
# serve`: prefill (PREFILL_LEN-token prompts, 1 output token) and decode
# (short prompts, DECODE_LEN output tokens at CONCURRENCY requests in flight).
# Prints one table; results JSON and logs in $OUT. Binaries carried as
# tools/gpu/check.sh says. On x4/x8 machines: WORLD=4 LAYOUTS="--tp 4 --ep 4".
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
BIN=${BIN:-build-gpu/bin}
LAYERS=${LAYERS:-8}
WORLD=${WORLD:-2}
LAYOUTS=${LAYOUTS:-"--tp 2 --ep 2|--ep 2"}
PREFILL_LEN=${PREFILL_LEN:-2048}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-$((PREFILL_LEN > 3968 ? PREFILL_LEN + 128 : 4096))}
DECODE_LEN=${DECODE_LEN:-64}
CONCURRENCY=${CONCURRENCY:-64}
CONFIG=tests/data/configs/qwen3-235b-a22b.config.json
mkdir -p "$OUT"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [[ $gpus -lt $WORLD ]]; then echo "ranks_bench: $gpus GPU(s), $WORLD needed"; exit 0; fi

run_case() {  # name, serve flags...
  local name=$1; shift
  "$BIN/moeserve" serve --device cuda --model "$CONFIG" --load-format dummy --num-layers "$LAYERS" \
    --max-num-seqs 256 --max-num-batched-tokens 4096 --max-model-len "$MAX_MODEL_LEN" --port 18570 "$@" \
    > "$OUT/$name.out" 2> "$OUT/$name.log" &
  local server=$!
  for _ in $(seq 1 900); do curl -sf localhost:18570/health > /dev/null && break; sleep 0.2; done
  if ! curl -sf localhost:18570/health > /dev/null; then echo "$name: did not start"; tail -5 "$OUT/$name.log"; kill $server; return; fi
  "$BIN/moeserve" bench serve --url http://127.0.0.1:18570 --random-input-len "$PREFILL_LEN" --random-output-len 1 \
    --num-prompts 32 --max-concurrency 8 --random-vocab-hi 150000 --save-result "$OUT/$name.prefill.json" > /dev/null 2>&1
  "$BIN/moeserve" bench serve --url http://127.0.0.1:18570 --random-input-len 128 --random-output-len "$DECODE_LEN" \
    --num-prompts $((CONCURRENCY * 2)) --max-concurrency "$CONCURRENCY" --random-vocab-hi 150000 \
    --save-result "$OUT/$name.decode.json" > /dev/null 2>&1
  kill -INT $server; wait $server
  python3 - "$name" "$OUT/$name.prefill.json" "$OUT/$name.decode.json" <<'PY'
import json, sys
name, prefill, decode = sys.argv[1:4]
def get(path, key):
    try:
        r = json.load(open(path))
        return r['total_input_tokens'] / r['duration'] if key == 'input_throughput' else r.get(key, float('nan'))
    except Exception:
        return float('nan')
print(f"| {name} | {get(prefill, 'input_throughput'):.0f} | {get(prefill, 'mean_ttft_ms'):.1f} | "
      f"{get(decode, 'output_throughput'):.0f} | {get(decode, 'mean_tpot_ms'):.2f} |")
PY
}

echo "dummy Qwen3-235B-A22B, $LAYERS layers (bf16 unless a layout says --quantization); prefill $PREFILL_LEN-token prompts; decode at $CONCURRENCY in flight"
echo "| instance | prefill input tok/s | mean TTFT ms | decode output tok/s | mean TPOT ms |"
echo "|---|---|---|---|---|"
run_case one_gpu
IFS='|' read -ra layouts <<< "$LAYOUTS"
for layout in "${layouts[@]}"; do
  # shellcheck disable=SC2086
  run_case "ranks_$(echo $layout | tr -d ' -')" $layout
done
