#!/usr/bin/env bash
# Prefill throughput of one GPU: a dummy Qwen3-235B-A22B cut to LAYERS layers
# (default 8) served by `moeserve serve --device cuda`, in each of FORMATS
# (default "bf16 fp8": bf16, then fp8-block experts and attention
# projections), loaded by `moeserve bench serve` with PROMPTS prompts of
# PREFILL_LEN tokens (1 output token each) at 8 in flight, BATCHED_TOKENS
# (default 4096) tokens per step at most. Prints input tokens
# per second and mean TTFT per case; the bench results JSON and the server
# logs go to $OUT. The reference the GPU-rank layouts (ranks_bench.sh) and
# later kernels are compared with. Binaries: BIN (default build-gpu/bin), built
# as tools/gpu/check.sh says.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
BIN=${BIN:-build-gpu/bin}
LAYERS=${LAYERS:-8}
PREFILL_LEN=${PREFILL_LEN:-2048}
PROMPTS=${PROMPTS:-32}
FORMATS=${FORMATS:-bf16 fp8}
BATCHED_TOKENS=${BATCHED_TOKENS:-4096}
CONFIG=tests/data/configs/qwen3-235b-a22b.config.json
mkdir -p "$OUT"
for name in $FORMATS; do
  case $name in
    bf16) quant="" ;;
    fp8) quant="--quantization fp8-block" ;;
    *) echo "FORMATS: unknown format '$name' (bf16, fp8)" >&2; exit 2 ;;
  esac
  # shellcheck disable=SC2086  # $quant is empty or two words
  "$BIN/moeserve" serve --device cuda --model "$CONFIG" --load-format dummy --num-layers "$LAYERS" $quant \
    --max-num-seqs 256 --max-num-batched-tokens "$BATCHED_TOKENS" --max-model-len $((PREFILL_LEN + 128 > 4096 ? PREFILL_LEN + 128 : 4096)) \
    --port 18570 > "$OUT/$name.out" 2> "$OUT/$name.log" &
  server=$!
  for _ in $(seq 1 600); do
    curl -sf localhost:18570/health > /dev/null && break
    kill -0 $server 2> /dev/null || break
    sleep 0.25
  done
  if ! curl -sf localhost:18570/health > /dev/null; then
    echo "$name: the server did not start"
    tail -5 "$OUT/$name.log"
    kill $server 2> /dev/null
    continue
  fi
  timeout 300 "$BIN/moeserve" bench serve --url http://127.0.0.1:18570 --random-input-len "$PREFILL_LEN" \
    --random-output-len 1 --num-prompts "$PROMPTS" --max-concurrency 8 --random-vocab-hi 150000 \
    --save-result "$OUT/$name.prefill.json" > "$OUT/$name.bench.txt" 2>&1
  kill -INT $server
  wait $server
  python3 - "$name" "$OUT/$name.prefill.json" <<'PY'
import json, sys
name, path = sys.argv[1:3]
try:
    r = json.load(open(path))
    print(f"{name}: {r['total_input_tokens'] / r['duration']:.0f} input tokens/s, mean TTFT {r['mean_ttft_ms']:.1f} ms")
except Exception as e:
    print(f"{name}: no result ({e})")
PY
done
