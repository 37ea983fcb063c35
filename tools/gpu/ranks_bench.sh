#!/usr/bin/env bash
# GPU ranks against one GPU (issue: several GPUs; docs/parallel.md "On GPUs"):
# a dummy Qwen3-235B-A22B cut to LAYERS layers, served on one GPU and as one
# instance over WORLD GPUs (each LAYOUT in turn), loaded by `moeserve bench
# serve`: prefill (PREFILL_LEN-token prompts, 1 output token) and decode
# (short prompts, DECODE_LEN output tokens at CONCURRENCY requests in flight).
# Prints one table; results JSON and logs in $OUT. Binaries carried as
# tools/gpu/check.sh says. On x4/x8 machines: WORLD=4 LAYOUTS="--tp 4 --ep 4".
# DECODE_ONLY=1: decode instances instead (one GPU against --dp WORLD --ep
# WORLD, behind the router with a prefill instance on GPU 0); MODEL_FLAGS
# (e.g. "--quantization fp8-block") go to every instance.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/gpu/lib.sh
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
# ONE_GPU=1 (DECODE_ONLY runs): every instance on GPU 0 with a fixed KV pool,
# a functional dry run of the scripts and the ranks on a one-GPU machine
# (its throughput means nothing: the processes time-slice the GPU).
if [[ -z ${ONE_GPU:-} && $gpus -lt $WORLD ]]; then echo "ranks_bench: $gpus GPU(s), $WORLD needed"; exit 0; fi

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

# A decode instance behind the router (prefill instance on GPU 0): one GPU
# (GPU 1) against data-parallel ranks (--dp WORLD --ep WORLD over GPUs
# 0..WORLD-1, experts split, each rank its own endpoint), loaded with short
# prompts so decode dominates. Prints one table row.
run_decode_case() {  # name, concurrency, decode flags...
  local name=$1 concurrency=$2
  shift 2
  local common="--device cuda --model $CONFIG --load-format dummy --num-layers $LAYERS ${MODEL_FLAGS:-}
                --max-num-seqs 256 --max-num-batched-tokens 4096 --max-model-len $MAX_MODEL_LEN"
  local memory="--gpu-memory-utilization 0.45"
  [[ -n ${ONE_GPU:-} ]] && memory="--kv-cache-gb 4"
  if run_disaggregated "$name" "$common --gpu 0 $memory" "$common $memory $*" $(($# > 2 ? WORLD + 1 : 2)) \
    --random-input-len 128 --random-output-len "$DECODE_LEN" --num-prompts $((concurrency * 2)) \
    --max-concurrency "$concurrency" --random-vocab-hi 150000; then
    python3 - "$name" "$concurrency" "$OUT/$name.json" <<'PY'
import json, sys
name, concurrency, path = sys.argv[1:4]
r = json.load(open(path))
print(f"| {name} | {concurrency} | {r['output_throughput']:.0f} | {r['mean_tpot_ms']:.2f} | {r['completed']} |")
PY
  else
    echo "| $name | $concurrency | failed (logs: $OUT/$name.*.log) | | |"
  fi
}

if [[ -n ${DECODE_ONLY:-} ]]; then
  echo "decode instances, dummy Qwen3-235B-A22B, $LAYERS layers ${MODEL_FLAGS:-bf16}; 128-token prompts, $DECODE_LEN output tokens"
  echo "| decode instance | concurrency | output tok/s | mean TPOT ms | completed |"
  echo "|---|---|---|---|---|"
  single_gpu=1 dp_gpus=$(seq -s, 0 $((WORLD - 1)))
  [[ -n ${ONE_GPU:-} ]] && single_gpu=0 dp_gpus=$(printf '0%.0s,' $(seq 1 "$WORLD") | sed 's/,$//')
  for c in $CONCURRENCY $((CONCURRENCY * WORLD)); do
    run_decode_case "decode_one_gpu_c$c" "$c" --gpu "$single_gpu"
    run_decode_case "decode_dp${WORLD}_c$c" "$c" --dp "$WORLD" --ep "$WORLD" --gpus "$dp_gpus"
  done
  exit 0
fi

echo "dummy Qwen3-235B-A22B, $LAYERS layers (bf16 unless a layout says --quantization); prefill $PREFILL_LEN-token prompts; decode at $CONCURRENCY in flight"
echo "| instance | prefill input tok/s | mean TTFT ms | decode output tok/s | mean TPOT ms |"
echo "|---|---|---|---|---|"
run_case one_gpu
IFS='|' read -ra layouts <<< "$LAYOUTS"
for layout in "${layouts[@]}"; do
  # shellcheck disable=SC2086
  run_case "ranks_$(echo $layout | tr -d ' -')" $layout
done
