#!/usr/bin/env bash
# End to end on a GPU machine (binaries carried as tools/gpu/check.sh says):
# generate on cuda against cpu, serve the demo model on the GPU and call it,
# and a dummy Qwen3-235B cut to a few layers. Logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
BIN=${BIN:-build-gpu/bin}
mkdir -p "$OUT"
ids=5,77,300,12,9,401,3,250
for device in cpu cuda; do
  echo "=== generate --device $device (golden moe_basic, greedy)"
  "$BIN/moeserve" generate --model tests/data/golden/moe_basic --prompt-ids $ids --prompt-ids 42 --max-tokens 16 \
    --ignore-eos --output json --device $device 2>"$OUT/generate_$device.log" | tee "$OUT/generate_$device.json"
done
echo "=== serve --device cuda (the demo model)"
"$BIN/moeserve" serve --device cuda --port 18555 > "$OUT/serve.out" 2> "$OUT/serve.log" &
server=$!
for _ in $(seq 1 100); do curl -sf localhost:18555/health > /dev/null && break; sleep 0.2; done
curl -s localhost:18555/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"model": "moeserve-demo", "messages": [{"role": "user", "content": "Tell me a fortune."}], "max_tokens": 40, "temperature": 0}'
echo
curl -s localhost:18555/v1/completions -H 'Content-Type: application/json' \
  -d '{"model": "moeserve-demo", "prompt": "The best way to", "max_tokens": 24, "temperature": 0.8, "seed": 1, "stream": false}'
echo
curl -s localhost:18555/metrics | grep -E "^moeserve:(generation_tokens_total|kv_cache_usage_perc)" | head -3
kill -INT $server; wait $server; echo "serve exit: $?"
grep -E "CUDA model|KV cache|config:" "$OUT/serve.log" | head -5
echo "=== dummy Qwen3-235B-A22B, 8 layers, on the GPU"
"$BIN/moeserve" generate --model tests/data/configs/qwen3-235b-a22b.config.json --load-format dummy --num-layers 8 \
  --prompt-ids 1,2,3,4,5,6,7,8 --prompt-ids 9,10 --max-tokens 32 --ignore-eos --device cuda --output json 2>&1 | tail -4
# GPU ranks (docs/parallel.md, "On GPUs"): the demo model on two GPUs against
# one; with one GPU, both ranks on it (--gpus 0,0: time-sliced, a correctness
# check only).
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [[ $gpus -ge 2 ]]; then placement="--gpus 0,1"; else placement="--gpus 0,0"; fi
for layout in "--tp 2" "--ep 2" "--tp 2 --ep 2"; do
  echo "=== serve $layout --device cuda $placement (the demo model) against one GPU"
  # Fixed KV pools (--kv-cache-gb, per rank): processes sharing a GPU must not size theirs from free memory.
  "$BIN/moeserve" serve --device cuda --gpu 0 --kv-cache-gb 2 --port 18557 > /dev/null 2> "$OUT/serve_one.log" &
  single=$!
  for _ in $(seq 1 300); do curl -sf localhost:18557/health > /dev/null && break; kill -0 $single 2>/dev/null || break; sleep 0.2; done
  "$BIN/moeserve" serve --device cuda $layout $placement --kv-cache-gb 2 --port 18556 > "$OUT/serve_ranks.out" 2> "$OUT/serve_ranks.log" &
  server=$!
  for _ in $(seq 1 300); do curl -sf localhost:18556/health > /dev/null && break; kill -0 $server 2>/dev/null || break; sleep 0.2; done
  for prompt in "Tell me a fortune." "The sea is" "A computer once said"; do
    body='{"model": "moeserve-demo", "prompt": "'"$prompt"'", "max_tokens": 24, "temperature": 0, "return_token_ids": true}'
    a=$(curl -s localhost:18556/v1/completions -H 'Content-Type: application/json' -d "$body" | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["token_ids"])')
    b=$(curl -s localhost:18557/v1/completions -H 'Content-Type: application/json' -d "$body" | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["token_ids"])')
    [[ "$a" == "$b" ]] && echo "ranks $layout: equal ($prompt)" || echo "ranks $layout: DIFFER ($prompt): $a vs $b"
  done
  kill -INT $server $single; wait $server; echo "serve $layout exit: $?"; wait $single
  grep -E "GPU rank|GPU ranks ready|share GPUs|error" "$OUT/serve_ranks.log" | head -6
done
