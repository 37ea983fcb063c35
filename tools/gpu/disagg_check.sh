#!/usr/bin/env bash
# Disaggregated serving on NVIDIA GPUs (docs/disagg.md):
# `moeserve prefill --device cuda --gpu 0` and `moeserve decode --device cuda
# --gpu 1` (GPU 0 too on a one-GPU machine) behind `moeserve router`, the KV
# moved by the CUDA IPC transport, for the golden models moe_basic and moe_dense_layer and the demo
# model. Checks (tools/gpu/disagg_check.py):
#   - greedy tokens of every golden prompt, sent one at a time, equal
#     `moeserve generate --device cuda` on one GPU token for token, and
#     transformers' goldens up to the first step whose golden margin is below
#     bf16 noise (0.1, as model_cuda_test);
#   - every prompt twice at once (batched, prefix-cache hits): the goldens rule;
#   - the instances' metrics: KV in device memory, transport cuda_ipc, bytes sent;
#   - moe_basic and the demo model again with an MTP layer, k = 1..4 (not
#     with NO_SPECULATIVE=1): the same greedy tokens, the decode instance
#     drafts, and on the demo's trained layer accepts drafts;
#   - every model again with a two-rank prefill instance (`prefill --tp 2
#     --gpus 0,D`, not with NO_TP=1): heads split over GPU ranks, the leader
#     sends both ranks' KV (moe_dense_layer's one kv head is replicated: only
#     its writer rank's pages go); the same greedy tokens; with an MTP layer
#     (k = 2) the leader also runs it and sends its KV, and the decode drafts;
#   - every model again with a decode instance of two data-parallel GPU ranks
#     (`decode --dp 2 --ep 2 --gpus 0,D`, not with NO_DP=1): each rank its own
#     endpoint at the router, tokens crossing to their experts' rank and
#     back; the same greedy tokens; then the demo quantized to fp8-block the
#     same way (E4M3 rows crossing), against its own one-GPU reference;
# and first runs disagg_cuda_test (the same path in one process, no HTTP).
# Binaries come from
#   cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DMOE_STATIC_RUNTIME=ON
#   cmake --build build-gpu --target moeserve disagg_cuda_test
# Run from anywhere: bash tools/gpu/disagg_check.sh (BIN, OUT, MODELS override;
# DP_FLAGS adds flags to the data-parallel decode instance, e.g. --enforce-eager;
# SPEC_K lists the MTP k values of the one-GPU-decode runs, default "1 2 3 4").
# Logs in $OUT (default /tmp/out, 8 files): summary.txt, disagg_cuda_test.log,
# generate.log, prefill.log, decode.log, router.log, metrics.txt,
# results.jsonl. Exit status 0 when everything passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/gpu/lib.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
BIN=${BIN:-build-gpu/bin}
MODELS=${MODELS:-"tests/data/golden/moe_basic tests/data/golden/moe_dense_layer models/moeserve-demo"}
SOURCE_DIR=${SOURCE_DIR:-/work/main}  # compiled into disagg_cuda_test (its data path): mapped to this checkout
PREFILL_PORT=18601 DECODE_PORT=18602 ROUTER_PORT=18600
mkdir -p "$OUT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -f "$OUT"/{summary.txt,disagg_cuda_test.log,generate.log,prefill.log,decode.log,router.log,metrics.txt,results.jsonl}
if [[ "$(pwd)" != "$SOURCE_DIR" && ! -e "$SOURCE_DIR" ]]; then
  mkdir -p "$(dirname "$SOURCE_DIR")" && ln -s "$(pwd)" "$SOURCE_DIR"
fi
status=0
say() { echo "$*" | tee -a "$OUT/summary.txt"; }

nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
nvidia-smi topo -m 2>/dev/null | head -4 >> "$OUT/summary.txt"
num_gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
# Two GPUs: decode on GPU 1. One: both instances on GPU 0 (CUDA IPC within a
# device), each with a fixed KV pool so neither sizes it from the other's leftovers.
DECODE_GPU=$([[ $num_gpus -ge 2 ]] && echo 1 || echo 0)

say "=== disagg_cuda_test (prefill engine on GPU 0 -> CUDA IPC -> decode engine on GPU $DECODE_GPU, one process)"
if "$BIN/disagg_cuda_test" --gtest_color=no > "$OUT/disagg_cuda_test.log" 2>&1; then
  grep -E "^(moe_|tests|models).*GPU 0 -> GPU|PASSED|SKIPPED \]" "$OUT/disagg_cuda_test.log" | tee -a "$OUT/summary.txt"
  if grep -q "SKIPPED \]" "$OUT/disagg_cuda_test.log"; then
    say "  FAILED: disagg_cuda_test skipped tests on a machine with $num_gpus GPUs"
    status=1
  fi
else
  status=1
  grep -E -A4 "Failure|CHECK failed" "$OUT/disagg_cuda_test.log" | head -40 | tee -a "$OUT/summary.txt"
  grep -E "^\[  FAILED" "$OUT/disagg_cuda_test.log" | tee -a "$OUT/summary.txt"
fi

# Waits until URL/health answers 200 (or the process PID is gone).
wait_healthy() {
  local url=$1 pid=$2
  for _ in $(seq 1 600); do
    curl -sf "$url/health" > /dev/null && return 0
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.2
  done
  return 1
}
stop() {
  for pid in "$@"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "$@"; do wait "$pid" 2>/dev/null; done
}

# One model behind router + prefill + decode, against its reference (plain
# `generate --device cuda`); extra arguments go to both instances and, with a
# speculative config, disagg_check.py also wants the decode instance to draft.
check_disagg() {
  local model=$1 tag=$2
  shift 2
  local name
  name=$(basename "$model")
  say "=== $name$tag: router :$ROUTER_PORT, prefill --device cuda ${PREFILL_PLACEMENT[*]} :$PREFILL_PORT," \
    "decode --device cuda --gpu $DECODE_GPU :$DECODE_PORT $*"
  local common=(--model "$model" --device cuda --kv-cache-gb 4 --host 127.0.0.1 "$@")
  echo "=== $name$tag" | tee -a "$OUT/prefill.log" "$OUT/decode.log" "$OUT/router.log" > /dev/null
  "$BIN/moeserve" prefill "${common[@]}" "${PREFILL_PLACEMENT[@]}" --port $PREFILL_PORT >> "$OUT/prefill.log" 2>&1 &
  local prefill=$!
  "$BIN/moeserve" decode "${common[@]}" --gpu $DECODE_GPU --port $DECODE_PORT >> "$OUT/decode.log" 2>&1 &
  local decode=$!
  if ! wait_healthy "http://127.0.0.1:$PREFILL_PORT" $prefill ||
     ! wait_healthy "http://127.0.0.1:$DECODE_PORT" $decode; then
    say "  FAILED: an instance did not start (prefill.log, decode.log)"
    tail -n 5 "$OUT/prefill.log" "$OUT/decode.log" | tee -a "$OUT/summary.txt"
    stop $prefill $decode
    status=1
    return
  fi
  "$BIN/moeserve" router --model "$model" --port $ROUTER_PORT --prefill "http://127.0.0.1:$PREFILL_PORT" \
    --decode "http://127.0.0.1:$DECODE_PORT" >> "$OUT/router.log" 2>&1 &
  local router=$!
  if ! wait_healthy "http://127.0.0.1:$ROUTER_PORT" $router; then
    say "  FAILED: the router did not become healthy (router.log)"
    stop $router $prefill $decode
    status=1
    return
  fi
  local speculative=()
  [[ "$*" == *--speculative-config* ]] && speculative=(--speculative)
  [[ "$*" == *moeserve-demo-mtp* ]] && speculative+=(--expect-accepted)  # a trained MTP layer
  python3 tools/gpu/disagg_check.py serve --router "http://127.0.0.1:$ROUTER_PORT" \
    --prefill "http://127.0.0.1:$PREFILL_PORT" --decode "http://127.0.0.1:$DECODE_PORT" --model "$model" \
    --reference "$work/reference_$name.json" --out "$OUT/results.jsonl" --metrics "$OUT/metrics.txt" \
    "${speculative[@]}" "${CHECK_ARGS[@]}" | tee -a "$OUT/summary.txt"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  if [[ -z "$tag" && -f "$model/penalties.json" ]]; then  # penalties, logit_bias, min_tokens across the instances
    python3 tools/gpu/logits_check.py "http://127.0.0.1:$ROUTER_PORT" "$model" --disagg | tail -4 | sed 's/^/  /' \
      | tee -a "$OUT/summary.txt"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  fi
  stop $router
  stop $prefill $decode
  # Where each instance put its KV and how it moved, as they logged it (this run's part of the logs).
  for log in "$OUT/prefill.log" "$OUT/decode.log"; do
    awk -v header="=== $name$tag" '$0 == header {on = 1; next} /^=== / {on = 0} on' "$log" \
      | grep -E "prefill: KV of|decode: KV of|CUDA model on device" | sed 's/^/  /' | tee -a "$OUT/summary.txt"
  done
}

# A decode instance of two data-parallel GPU ranks (`decode --dp 2 --ep 2
# --gpus 0,D`): each rank a decode endpoint of its own that registers with
# the router (started first, as the instances announce themselves), their MoE
# layers exchanging tokens over NVLink peer memory; the prefill instance on
# GPU 0. disagg_check.py finds the decode ranks through the router.
check_disagg_dp() {
  local model=$1 name
  shift
  # Further arguments go to disagg_check.py serve (--no-golden, --speculative).
  # DP_MTP=DIR: both instances speculate with that MTP layer, k = 2 (each
  # data-parallel rank drafts for its own requests).
  name=$(basename "$model")
  local spec=() tag="dp"
  if [[ -n ${DP_MTP:-} ]]; then
    spec=(--speculative-config '{"method":"mtp","num_speculative_tokens":2}' --speculative-model "$DP_MTP")
    tag="dp, MTP k=2"
  fi
  say "=== $name (decode --dp 2 --ep 2${DP_MTP:+, MTP k=2}): router :$ROUTER_PORT, prefill --gpu 0 :$PREFILL_PORT," \
    "decode --dp 2 --ep 2 --gpus 0,$DECODE_GPU :$DECODE_PORT"
  local common=(--model "$model" --device cuda --kv-cache-gb 4 --host 127.0.0.1 --router "http://127.0.0.1:$ROUTER_PORT"
                "${spec[@]}")
  echo "=== $name ($tag)" | tee -a "$OUT/prefill.log" "$OUT/decode.log" "$OUT/router.log" > /dev/null
  "$BIN/moeserve" router --model "$model" --port $ROUTER_PORT >> "$OUT/router.log" 2>&1 &
  local router=$!
  "$BIN/moeserve" prefill "${common[@]}" --gpu 0 --port $PREFILL_PORT >> "$OUT/prefill.log" 2>&1 &
  local prefill=$!
  # shellcheck disable=SC2086
  "$BIN/moeserve" decode "${common[@]}" --dp 2 --ep 2 --gpus "0,$DECODE_GPU" --port $DECODE_PORT ${DP_FLAGS:-} \
    >> "$OUT/decode.log" 2>&1 &
  local decode=$!
  local registered
  registered=$(wait_router_instances "http://127.0.0.1:$ROUTER_PORT" 3 600 "$decode" "$prefill")
  if [[ $registered -lt 3 ]]; then
    say "  FAILED: $registered of 3 instances (prefill, two decode ranks) healthy at the router (decode.log)"
    tail -n 8 "$OUT/prefill.log" "$OUT/decode.log" | tee -a "$OUT/summary.txt"
    stop $decode $prefill $router
    status=1
    return
  fi
  python3 tools/gpu/disagg_check.py serve --router "http://127.0.0.1:$ROUTER_PORT" \
    --prefill "http://127.0.0.1:$PREFILL_PORT" --decode router --model "$model" \
    --reference "$work/reference_$name.json" --out "$OUT/results.jsonl" --metrics "$OUT/metrics.txt" "$@" \
    | tee -a "$OUT/summary.txt"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  stop $decode
  stop $prefill $router
  awk -v header="=== $name ($tag)" '$0 == header {on = 1; next} /^=== / {on = 0} on' "$OUT/decode.log" \
    | grep -E "expert exchange ready|data-parallel GPU ranks ready|CUDA model on device" | sed 's/^/  /' \
    | tee -a "$OUT/summary.txt"
}

PREFILL_PLACEMENT=(--gpu 0)  # the prefill instance's GPU(s); the TP check below gives it two ranks
CHECK_ARGS=()  # extra disagg_check.py arguments (the TP check's)
for model in $MODELS; do
  name=$(basename "$model")
  say "=== $name: reference, moeserve generate --device cuda --gpu 0 (one prompt per run)"
  if ! python3 tools/gpu/disagg_check.py reference --bin "$BIN" --model "$model" --gpu 0 \
      --out "$work/reference_$name.json" --log "$OUT/generate.log" | tee -a "$OUT/summary.txt"; then
    status=1
    continue
  fi
  check_disagg "$model" ""
  # With an MTP layer, k = 1..4: the decode instance drafts from the state the
  # prefill instance sends; greedy output stays the reference's. moe_basic has
  # the random golden MTP layer (few drafts accepted), the demo model its
  # trained one (drafts must be accepted).
  mtp=""
  [[ $name == moe_basic ]] && mtp=tests/data/mtp_golden
  [[ $name == moeserve-demo ]] && mtp=models/moeserve-demo-mtp
  if [[ -n $mtp && -z ${NO_SPECULATIVE:-} ]]; then
    for k in ${SPEC_K-1 2 3 4}; do
      check_disagg "$model" " (MTP, k=$k)" --speculative-config "{\"method\":\"mtp\",\"num_speculative_tokens\":$k}" \
        --speculative-model "$mtp"
    done
  fi
  [[ -z ${NO_DP:-} ]] && check_disagg_dp "$model"
  if [[ -n $mtp && -z ${NO_SPECULATIVE:-} && -z ${NO_DP:-} ]]; then
    accepted=()
    [[ $name == moeserve-demo ]] && accepted=(--expect-accepted)
    DP_MTP=$mtp check_disagg_dp "$model" --speculative "${accepted[@]}"
  fi
  # A prefill instance of two GPU ranks (heads split): the leader sends every
  # rank's KV. Its prompt KV differs from one GPU's by rounding (each rank's
  # partial attention and MoE outputs cross the all-reduce in bf16), so only
  # the first 3 tokens must equal the reference, the rest are reported (and
  # the goldens still rule up to their robust margins); parallel_cuda_test
  # checks the ranks' numerics. On 2026-12-01 (eleventh session) one
  # moe_dense_layer prompt left the reference at step 5, between two tokens
  # its output repeats (273 x5 then 179, against 273 x4 then 179).
  if [[ -z ${NO_TP:-} ]]; then
    PREFILL_PLACEMENT=(--tp 2 --gpus "0,$DECODE_GPU")
    CHECK_ARGS=(--match-tokens 3)
    check_disagg "$model" " (prefill --tp 2)"
    # With an MTP layer (k = 2): the leader runs it whole on its GPU and sends
    # its KV (every k/v head) after the ranks' layers; the decode instance drafts.
    if [[ -n $mtp && -z ${NO_SPECULATIVE:-} ]]; then
      check_disagg "$model" " (prefill --tp 2, MTP, k=2)" \
        --speculative-config '{"method":"mtp","num_speculative_tokens":2}' --speculative-model "$mtp"
    fi
    PREFILL_PLACEMENT=(--gpu 0)
    CHECK_ARGS=()
  fi
done
# FP8 experts on the data-parallel decode ranks: the demo model quantized to
# fp8-block (its rows cross between the ranks as E4M3 with their scales), the
# reference being the same quantized model on one GPU.
if [[ -z ${NO_DP:-} ]]; then
  model="$work/moeserve-demo-fp8"
  "$BIN/moeserve" quantize --model models/moeserve-demo --out "$model" --format fp8-block > /dev/null 2>&1
  cp models/moeserve-demo/golden.json "$model/"
  say "=== moeserve-demo-fp8: reference, moeserve generate --device cuda --gpu 0 (one prompt per run)"
  if python3 tools/gpu/disagg_check.py reference --bin "$BIN" --model "$model" --gpu 0 \
      --out "$work/reference_moeserve-demo-fp8.json" --log "$OUT/generate.log" | tee -a "$OUT/summary.txt"; then
    # Every token must equal the reference: the ranks' E4M3 rows, scales and
    # bf16-rounded expert outputs are what one GPU computes (one GPU's down
    # GEMM writes bf16 rows too since 2026-12-01; before, two of the 7 demo
    # prompts left the reference at step 3 and only 3 tokens were required).
    check_disagg_dp "$model" --no-golden
  else
    status=1
  fi
fi
grep -hE "ERROR|error|CHECK failed|Segmentation" "$OUT/prefill.log" "$OUT/decode.log" "$OUT/router.log" | head -10 \
  | sed 's/^/  log: /' | tee -a "$OUT/summary.txt"
say "=== $([[ $status -eq 0 ]] && echo PASSED || echo FAILED) (logs in $OUT)"
exit $status
