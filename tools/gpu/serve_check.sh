#!/usr/bin/env bash
# End to end on a GPU machine (binaries carried as tools/gpu/check.sh says):
# generate on cuda against cpu, serve the demo model on the GPU and call it,
# a dummy Qwen3-235B cut to a few layers, then the demo model served as GPU
# ranks (--tp/--ep) and as `serve --disagg --device cuda`, each against one
# GPU (on a one-GPU machine the ranks or instances share it). Logs in $OUT.
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
echo "=== penalties, logit_bias, min_tokens, prompt logprobs on the GPU (golden moe_basic against transformers); sampling filters at their limits"
"$BIN/moeserve" serve --device cuda --model tests/data/golden/moe_basic --max-model-len 256 --kv-cache-gb 1 \
  --port 18556 > /dev/null 2> "$OUT/serve_penalties.log" &
server=$!
for _ in $(seq 1 150); do curl -sf localhost:18556/health > /dev/null && break; sleep 0.2; done
python3 tools/gpu/logits_check.py http://localhost:18556 tests/data/golden/moe_basic | tee "$OUT/logits_check.txt" | tail -12
python3 tools/gpu/sampling_limits.py http://localhost:18556 tests/data/golden/moe_basic | tail -6
kill -INT $server; wait $server; echo "serve exit: $?"
echo "=== dummy Qwen3-235B-A22B, 8 layers, on the GPU"
"$BIN/moeserve" generate --model tests/data/configs/qwen3-235b-a22b.config.json --load-format dummy --num-layers 8 \
  --prompt-ids 1,2,3,4,5,6,7,8 --prompt-ids 9,10 --max-tokens 32 --ignore-eos --device cuda --output json 2>&1 | tail -4
# Waits for a server on PORT (pid PID) to answer /health; 1 if it exited first.
wait_up() {
  for _ in $(seq 1 300); do curl -sf "localhost:$1/health" > /dev/null && return 0; kill -0 "$2" 2>/dev/null || return 1; sleep 0.2; done
  return 1
}

# serve's GPU default --max-model-len is the model's (40960 for Qwen3-235B):
# 6000- and 40000-token prompts are served; then a pool sized from memory too small for
# one such sequence is refused at startup, naming the flags.
echo "=== serve, dummy Qwen3-235B-A22B (4 layers), default --max-model-len: 6000- and 40000-token prompts"
qwen=tests/data/configs/qwen3-235b-a22b.config.json
"$BIN/moeserve" serve --device cuda --model $qwen --load-format dummy --num-layers 4 --port 18559 \
  > /dev/null 2> "$OUT/serve_long.log" &
server=$!
if wait_up 18559 $server; then
  grep -oE "max_model_len=[0-9]+" "$OUT/serve_long.log" | head -1
  "$BIN/moeserve" bench serve --url http://127.0.0.1:18559 --random-input-len 6000 --random-output-len 8 \
    --num-prompts 4 --max-concurrency 2 --random-vocab-hi 150000 --save-result "$OUT/serve_long.json" > /dev/null 2>&1
  "$BIN/moeserve" bench serve --url http://127.0.0.1:18559 --random-input-len 40000 --random-output-len 8 \
    --num-prompts 2 --max-concurrency 2 --random-vocab-hi 150000 --save-result "$OUT/serve_longest.json" > /dev/null 2>&1
  python3 - "$OUT/serve_long.json" "$OUT/serve_longest.json" <<'PY' || echo "long prompts: no result"
import json, sys
for path, n in zip(sys.argv[1:], (4, 2)):
    r = json.load(open(path))
    print(f"{r['total_input_tokens'] // max(r['completed'], 1)}-token prompts: {r['completed']} of {n} completed, "
          f"mean TTFT {r['mean_ttft_ms']:.0f} ms" + (f"; first error: {r['errors'][0]}" if r["errors"] else ""))
PY
else
  echo "the dummy server did not start (serve_long.log)"
fi
kill -INT $server; wait $server; echo "serve (dummy, default max_model_len) exit: $?"
in_use=$(grep -oE "warm-up pass of [0-9]+ tokens: [0-9.]+ GB" "$OUT/serve_long.log" | grep -oE "[0-9.]+ GB" | cut -d' ' -f1)
total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)
if [[ -n "$in_use" && -n "$total" ]]; then  # 0.15 GB past the warm-up: ~18k tokens of 4 layers' KV
  util=$(python3 -c "print(round(($in_use + 0.15) * 1e9 / ($total * 1048576), 4))")
  "$BIN/moeserve" serve --device cuda --model $qwen --load-format dummy --num-layers 4 --port 18559 \
    --gpu-memory-utilization "$util" > /dev/null 2> "$OUT/serve_small_pool.log"
  echo "serve with --gpu-memory-utilization $util: exit $? ($(grep -oE "the KV cache holds.*" "$OUT/serve_small_pool.log" | head -1))"
fi
# Greedy token ids of three prompts (MAX_TOKENS each, default 24; EXTRA: more
# request fields) from the servers on ports A and B, compared.
compare() {
  local label=$1 a_port=$2 b_port=$3 max_tokens=${4:-24} extra=${5:-}
  for prompt in "Tell me a fortune." "The sea is" "A computer once said"; do
    body='{"model": "moeserve-demo", "prompt": "'"$prompt"'", "max_tokens": '$max_tokens', "temperature": 0, "return_token_ids": true'"${extra:+, $extra}"'}'
    a=$(curl -s localhost:$a_port/v1/completions -H 'Content-Type: application/json' -d "$body" | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["token_ids"])')
    b=$(curl -s localhost:$b_port/v1/completions -H 'Content-Type: application/json' -d "$body" | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["token_ids"])')
    [[ -n "$a" && "$a" == "$b" ]] && echo "$label: equal ($prompt)" || echo "$label: DIFFER ($prompt): $a vs $b"
  done
}
# Logprobs (2 alternatives) of the same prompts from the servers on ports A
# and B: the same tokens and top tokens, values within 0.02 (the two servers'
# batches differ in shape, so their bf16 sums may round differently).
compare_logprobs() {
  local label=$1 a_port=$2 b_port=$3
  for prompt in "Tell me a fortune." "The sea is"; do
    body='{"model": "moeserve-demo", "prompt": "'"$prompt"'", "max_tokens": 24, "temperature": 0, "logprobs": 2, "ignore_eos": true}'
    curl -s localhost:$a_port/v1/completions -H 'Content-Type: application/json' -d "$body" > "$OUT/lp_a.json"
    curl -s localhost:$b_port/v1/completions -H 'Content-Type: application/json' -d "$body" > "$OUT/lp_b.json"
    python3 - "$OUT/lp_a.json" "$OUT/lp_b.json" "$label: %s ($prompt)" <<'PY'
import json, sys
try:
    a, b = (json.load(open(f))["choices"][0]["logprobs"] for f in sys.argv[1:3])
    same = a["tokens"] == b["tokens"] and len(a["tokens"]) == 24 and all(
        abs(x - y) < 0.02 for x, y in zip(a["token_logprobs"], b["token_logprobs"])) and all(
        sorted(x) == sorted(y) and all(abs(x[t] - y[t]) < 0.02 for t in x)
        for x, y in zip(a["top_logprobs"], b["top_logprobs"]))
    print(sys.argv[3] % ("equal" if same else "DIFFER"))
except Exception as e:
    print(sys.argv[3] % f"DIFFER ({e})")
PY
  done
}

# Structured outputs (token masks applied on the GPU): a json_schema every
# completion of the server on PORT must parse into, at temperature 0.8.
schema='"response_format": {"type": "json_schema", "json_schema": {"name": "verdict", "schema": {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer"}, "note": {"type": "string", "maxLength": 12}}, "required": ["answer", "score", "note"]}}}'
structured_check() {
  local label=$1 port=$2
  body='{"model": "moeserve-demo", "prompt": "Tell me a fortune.", "max_tokens": 64, "temperature": 0.8, "seed": 3, "n": 8, '"$schema"'}'
  curl -s localhost:$port/v1/completions -H 'Content-Type: application/json' -d "$body" > "$OUT/structured_$port.json"
  python3 - "$OUT/structured_$port.json" "$label" <<'PY'
import json, sys
try:
    choices = json.load(open(sys.argv[1]))["choices"]
    ok = 0
    for c in choices:
        if c["finish_reason"] != "stop":
            continue
        v = json.loads(c["text"])
        assert v["answer"] in ("yes", "no") and isinstance(v["score"], int) and len(v["note"]) <= 12, c["text"]
        ok += 1
    print(f"{sys.argv[2]}, json_schema sampled: {ok} of {len(choices)} choices valid and finished; first: {choices[0]['text']!r}")
except Exception as e:
    print(f"{sys.argv[2]}, json_schema sampled: FAILED ({e!r})")
PY
}

# The single-GPU server every check below compares with. Fixed KV pools
# (--kv-cache-gb, per process or rank): processes sharing a GPU must not size
# theirs from free memory.
"$BIN/moeserve" serve --device cuda --gpu 0 --kv-cache-gb 2 --port 18557 > /dev/null 2> "$OUT/serve_one.log" &
single=$!
wait_up 18557 $single || echo "the single-GPU server did not start (serve_one.log)"
structured_check "one GPU" 18557

# A KV pool too small for the batch: sequences are preempted and recomputed
# on the GPU, and 48 concurrent greedy requests still equal the roomy server's.
echo "=== serve --device cuda with a KV pool of ~1000 tokens under 48 concurrent requests (preemption)"
"$BIN/moeserve" serve --device cuda --gpu 0 --kv-cache-gb 0.004 --max-model-len 256 --port 18560 \
  > /dev/null 2> "$OUT/serve_preempt.log" &
server=$!
if wait_up 18560 $server; then
  python3 tools/gpu/concurrent_compare.py http://localhost:18560 http://localhost:18557
else
  echo "the small-pool server did not start (serve_preempt.log)"
fi
kill -INT $server; wait $server; echo "serve (small pool) exit: $?"

# MTP speculative decoding on the GPU (the demo's trained MTP layer, k = 2):
# greedy outputs, plain and with penalties / logit_bias (each verified row
# adjusted as the plain step after its drafts), equal the plain server's.
echo "=== serve --speculative-config (MTP, k=2) against plain decoding"
"$BIN/moeserve" serve --device cuda --gpu 0 --kv-cache-gb 2 --port 18558 \
  --speculative-config '{"method":"mtp","num_speculative_tokens":2}' --speculative-model models/moeserve-demo-mtp \
  > /dev/null 2> "$OUT/serve_spec.log" &
server=$!
if wait_up 18558 $server; then
  compare "MTP k=2" 18558 18557 48
  compare "MTP k=2, penalties" 18558 18557 48 '"presence_penalty": 1.5, "repetition_penalty": 1.3, "logit_bias": {"397": -100}'
  compare_logprobs "MTP k=2, logprobs" 18558 18557
  compare "MTP k=2, json_schema" 18558 18557 48 "$schema"
  structured_check "MTP k=2" 18558
  curl -s localhost:18558/metrics | grep -E "^moeserve:spec_decode_num_(draft|accepted)_tokens_total" | head -2
else
  echo "the speculative server did not start (serve_spec.log)"
fi
kill -INT $server; wait $server; echo "serve --speculative-config exit: $?"

# GPU ranks (docs/parallel.md, "On GPUs"): the demo model on two GPUs against
# one; with one GPU, both ranks on it (--gpus 0,0: time-sliced, a correctness
# check only).
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [[ $gpus -ge 2 ]]; then placement="--gpus 0,1"; else placement="--gpus 0,0"; fi
for layout in "--tp 2" "--ep 2" "--tp 2 --ep 2"; do
  echo "=== serve $layout --device cuda $placement (the demo model) against one GPU"
  "$BIN/moeserve" serve --device cuda $layout $placement --kv-cache-gb 2 --port 18556 > "$OUT/serve_ranks.out" 2> "$OUT/serve_ranks.log" &
  server=$!
  wait_up 18556 $server || echo "serve $layout did not start"
  compare "ranks $layout" 18556 18557
  kill -INT $server; wait $server; echo "serve $layout exit: $?"
  grep -E "GPU rank|GPU ranks ready|share GPUs|error" "$OUT/serve_ranks.log" | head -6
done

# GPU ranks with MTP drafts (k = 2): the leader runs the MTP layer whole on
# its GPU from the replicated hidden states; greedy outputs equal those of the
# same ranks decoding plainly (plain and with penalties), and drafts are
# accepted. (Against the single GPU the ranks' own bf16 sums may flip a
# low-margin token: 2026-12-02, "A computer once said" with penalties parts at
# token 41 of 48, with or without drafts.)
for layout in "--tp 2" "--ep 2"; do
  echo "=== serve $layout --device cuda $placement --speculative-config (MTP, k=2) against the same ranks without"
  "$BIN/moeserve" serve --device cuda $layout $placement --kv-cache-gb 2 --port 18559 \
    > /dev/null 2> "$OUT/serve_ranks_plain.log" &
  plain=$!
  "$BIN/moeserve" serve --device cuda $layout $placement --kv-cache-gb 2 --port 18556 \
    --speculative-config '{"method":"mtp","num_speculative_tokens":2}' --speculative-model models/moeserve-demo-mtp \
    > "$OUT/serve_ranks_spec.out" 2> "$OUT/serve_ranks_spec.log" &
  server=$!
  if wait_up 18559 $plain && wait_up 18556 $server; then
    compare "ranks $layout, MTP k=2" 18556 18559 48
    compare "ranks $layout, MTP k=2, penalties" 18556 18559 48 '"presence_penalty": 1.5, "repetition_penalty": 1.3'
    curl -s localhost:18556/metrics | grep -E "^moeserve:spec_decode_num_(draft|accepted)_tokens_total" | head -2
  else
    echo "serve $layout with or without MTP did not start (serve_ranks_spec.log, serve_ranks_plain.log)"
  fi
  kill -INT $server $plain; wait $server; echo "serve $layout with MTP exit: $?"; wait $plain
  grep -E "MTP|speculative|error" "$OUT/serve_ranks_spec.log" | head -4
done

# kill -9 of a GPU rank inside a step: the follower stalls inside its 20th
# step (MOESERVE_TEST_STALL_STEP, after its first layer), so the leader waits
# in that step's collective; then the kill. The leader's watchdog ends the
# collectives' waits: the request fails with an error within a second or two
# (not the kernels' ~10 s trap), and /health stops answering 200.
echo "=== kill -9 of GPU rank 1 of serve --tp 2 $placement inside a step"
MOESERVE_TEST_STALL_STEP=20 "$BIN/moeserve" serve --device cuda --tp 2 $placement --kv-cache-gb 2 --port 18556 \
  > /dev/null 2> "$OUT/serve_kill.log" &
server=$!
if wait_up 18556 $server; then
  follower=$(grep -oE "started rank 1 of 2 \(pid [0-9]+\)" "$OUT/serve_kill.log" | grep -oE "[0-9]+\)$" | tr -d ')')
  body='{"model": "moeserve-demo", "prompt": "The sea is", "max_tokens": 200, "ignore_eos": true, "temperature": 0}'
  curl -s -m 60 localhost:18556/v1/completions -H 'Content-Type: application/json' -d "$body" > "$OUT/kill_response.json" &
  request=$!
  for _ in $(seq 1 100); do grep -q "stalling inside step" "$OUT/serve_kill.log" && break; sleep 0.1; done
  sleep 0.5  # the leader is now inside the step's collective, waiting for rank 1
  killed=$(date +%s.%N)
  kill -9 "$follower"
  wait $request
  ended=$(date +%s.%N)
  echo "request ended $(python3 -c "print(f'{$ended - $killed:.2f}')") s after the kill: $(head -c 300 "$OUT/kill_response.json")"
  echo "health after the kill: HTTP $(curl -s -o /dev/null -w '%{http_code}' -m 5 localhost:18556/health)"
  grep -E "stalling|GPU rank 1 .*(killed|exited)|abandoned| E " "$OUT/serve_kill.log" | head -5
fi
kill -INT $server 2>/dev/null; wait $server; echo "serve exit after the kill: $?"

# FP8 experts over EP ranks: the demo model quantized to fp8-block, served by
# two ranks (each holding half the experts) against one GPU holding them all,
# 16 tokens per prompt: the ranks' bf16 all-reduce payload moves the residual
# by bf16 ulps, which FP8 activation quantization can turn into a flipped near
# tie later on (seen once at token 19 of 24 on 2026-12-01).

fp8=$(mktemp -d)
"$BIN/moeserve" quantize --model models/moeserve-demo --out "$fp8/demo-fp8" --format fp8-block > /dev/null 2>&1
echo "=== serve --ep 2 --device cuda $placement (the demo model in fp8-block) against one GPU"
"$BIN/moeserve" serve --model "$fp8/demo-fp8" --served-model-name moeserve-demo --device cuda --gpu 0 --kv-cache-gb 2 \
  --port 18559 > /dev/null 2> "$OUT/serve_fp8_one.log" &
fp8_single=$!
"$BIN/moeserve" serve --model "$fp8/demo-fp8" --served-model-name moeserve-demo --device cuda --ep 2 $placement \
  --kv-cache-gb 2 --port 18556 > /dev/null 2> "$OUT/serve_fp8_ranks.log" &
server=$!
wait_up 18559 $fp8_single && wait_up 18556 $server || echo "an fp8 server did not start (serve_fp8_*.log)"
compare "fp8 ranks --ep 2" 18556 18559 16
kill -INT $server $fp8_single; wait $server; echo "serve fp8 --ep 2 exit: $?"; wait $fp8_single
grep -E "GPU ranks ready|FP8|fp8|error" "$OUT/serve_fp8_ranks.log" | head -4
rm -rf "$fp8"

# serve --disagg on GPUs (docs/disagg.md): router + prefill + decode instances,
# the KV moved by CUDA IPC, against one GPU.
echo "=== serve --disagg --device cuda $placement (the demo model) against one GPU"
"$BIN/moeserve" serve --disagg --device cuda $placement --kv-cache-gb 2 --port 18558 > "$OUT/serve_disagg.out" 2> "$OUT/serve_disagg.log" &
server=$!
wait_up 18558 $server || echo "serve --disagg did not start"
compare "disagg" 18558 18557
compare "disagg, json_schema" 18558 18557 48 "$schema"
structured_check "disagg" 18558
kill -INT $server; wait $server; echo "serve --disagg exit: $?"
grep -E "cluster:|KV of|error" "$OUT/serve_disagg.log" | head -6
kill -INT $single; wait $single
