#!/usr/bin/env bash
# The runs issue 9 asks of a machine with 8 H200s (nvidia-h200-x8), from
# binaries built elsewhere and carried (tools/gpu/check.sh says how; also
# comm_cuda_test and comm_cuda_bench). PARTS picks them, in order (each fits
# one device call):
#   comm    the communication layer at 2, 4 and 8 ranks: all-reduce and
#           dispatch/combine, ours against NCCL (comm_check.sh, RANKS="2 4 8");
#   decode  a DP=8, EP=8 decode instance of the whole dummy Qwen3-235B-A22B
#           (LAYERS, default 94) behind the router, its prompts prefilled by
#           an EP=8 prefill instance on the same 8 GPUs: 2k-token prompts,
#           OUTPUT_LEN output tokens, at each of BATCHES requests per rank in
#           flight: output tokens/s per GPU and mean TPOT;
#   split   a prefill instance on GPUs 0-3 and a DP=4, EP=4 decode instance on
#           GPUs 4-7 behind the router (KV over CUDA IPC), under `moeserve
#           bench serve`: TTFT, TPOT, throughput.
# MODEL_FLAGS (default "--quantization fp8-block") go to every instance.
# Memory decides what runs: per GPU the decode instance holds 1/8 of the
# experts plus the whole attention, embedding and lm_head (bf16: ~73 GB, FP8:
# ~38 GB), and a 2k-token sequence's KV over 94 layers is ~0.44 GB per rank.
# With the prefill instance on the same GPUs (PREFILL_SHARE of the memory,
# default 0.3; DECODE_SHARE 0.62), FP8 leaves room for ~100 sequences per
# rank and bf16 for only a few: the larger batches then queue in the server,
# which the table shows as a lower completed count per second, and the
# decode log states the KV capacity. Prefill is EP-only for FP8 (tensor
# parallelism over quantized projections is refused); with MODEL_FLAGS=""
# the prefill instances get --tp as well.
# ONE_GPU=1: a dry run of the same flags and plumbing with every rank on
# GPU 0 (LAYERS default 2, fixed KV pools): nothing it measures is a speed.
# Results under $OUT/<part>/ and one summary in $OUT/summary.md. Never
# enables NVLink multicast (see comm_check.sh).
# Not yet run on 8 GPUs: no 8-GPU machine has been lent (written 2026-12-01).
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/gpu/lib.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT_ROOT=${OUT:-/tmp/out}
BIN=${BIN:-build-gpu/bin}
CONFIG=tests/data/configs/qwen3-235b-a22b.config.json
PARTS=${PARTS:-comm decode split}
MODEL_FLAGS=${MODEL_FLAGS---quantization fp8-block}
OUTPUT_LEN=${OUTPUT_LEN:-256}
BATCHES=${BATCHES:-32 64 128 256}
PREFILL_SHARE=${PREFILL_SHARE:-0.3}
DECODE_SHARE=${DECODE_SHARE:-0.62}
if [[ -n ${ONE_GPU:-} ]]; then
  LAYERS=${LAYERS:-2}
  BATCHES=${BATCHES_ONE_GPU:-4}
  PREFILL_TOKENS=${PREFILL_TOKENS:-2048}  # 16 processes share the GPU's memory
  gpus8=0,0,0,0,0,0,0,0 gpus_low=0,0,0,0 gpus_high=0,0,0,0
  prefill_memory="--kv-cache-gb 1" decode_memory="--kv-cache-gb 1"
else
  LAYERS=${LAYERS:-94}
  gpus8=0,1,2,3,4,5,6,7 gpus_low=0,1,2,3 gpus_high=4,5,6,7
  prefill_memory="--gpu-memory-utilization $PREFILL_SHARE" decode_memory="--gpu-memory-utilization $DECODE_SHARE"
  if [[ $(nvidia-smi -L 2> /dev/null | wc -l) -lt 8 ]]; then echo "x8_runs: fewer than 8 GPUs (ONE_GPU=1 for a dry run)"; exit 1; fi
fi
tp() { [[ -z $MODEL_FLAGS ]] && echo "--tp $1"; }  # bf16 prefill instances also split the attention heads
# Decode instances step at most max-num-seqs tokens per rank; a larger token
# budget would only size their buffers (the expert exchange's grow with it
# times the ranks: 12 GB per rank at 8192 tokens and 8 ranks).
common="--device cuda --model $CONFIG --load-format dummy --num-layers $LAYERS $MODEL_FLAGS
        --max-num-seqs 256 --max-model-len $((2048 + OUTPUT_LEN + 64))"
prefill_common="$common --max-num-batched-tokens ${PREFILL_TOKENS:-8192}"
decode_common="$common --max-num-batched-tokens 512"
mkdir -p "$OUT_ROOT"
{
  echo "# Issue 9, x8 runs ($(date -u +%FT%TZ), $(git rev-parse --short HEAD 2> /dev/null)): $PARTS${ONE_GPU:+ (ONE_GPU dry run)}"
  echo "dummy Qwen3-235B-A22B, $LAYERS layers, ${MODEL_FLAGS:-bf16}; 2048-token prompts, $OUTPUT_LEN output tokens"
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
} >> "$OUT_ROOT/summary.md"

# Prints a table row from a bench result: per-GPU output rate over `gpus` GPUs.
row() {  # name, batch per rank, gpus, result json
  python3 - "$@" << 'PY'
import json, sys
name, batch, gpus, path = sys.argv[1:5]
try:
    r = json.load(open(path))
    print(f"| {name} | {batch} | {r['output_throughput'] / int(gpus):.0f} | {r['mean_tpot_ms']:.2f} | "
          f"{r['mean_ttft_ms']:.0f} | {r['completed']} |")
except Exception as e:
    print(f"| {name} | {batch} | failed: {e} | | | |")
PY
}

status=0
for part in $PARTS; do
  OUT="$OUT_ROOT/$part"
  mkdir -p "$OUT"
  echo "=== $part"
  case $part in
    comm)
      if [[ -n ${ONE_GPU:-} ]]; then echo "comm: needs 8 GPUs" >> "$OUT_ROOT/summary.md"; continue; fi
      OUT="$OUT" RANKS="2 4 8" timeout 560 bash tools/gpu/comm_check.sh > "$OUT/comm_check.log" 2>&1 || status=1
      { echo; echo "## Communication at 2, 4, 8 ranks"; grep -E "PASSED|FAILED" "$OUT/comm_check.log";
        cat "$OUT/comm_bench.md" 2> /dev/null; } >> "$OUT_ROOT/summary.md" ;;
    decode)
      {
        echo; echo "## DP=8 EP=8 decode instance (prefill: EP=8 on the same GPUs)"
        echo "| case | requests per rank | output tok/s per GPU | mean TPOT ms | mean TTFT ms | completed |"
        echo "|---|---|---|---|---|---|"
      } >> "$OUT_ROOT/summary.md"
      for batch in $BATCHES; do
        concurrency=$((8 * batch))
        # shellcheck disable=SC2046  # tp prints nothing or two words
        if run_disaggregated "dp8_b$batch" "$prefill_common $(tp 8) --ep 8 --gpus $gpus8 $prefill_memory" \
          "$decode_common --dp 8 --ep 8 --gpus $gpus8 $decode_memory" 9 \
          --random-input-len 2048 --random-output-len "$OUTPUT_LEN" --num-prompts "$concurrency" \
          --max-concurrency "$concurrency" --random-vocab-hi 150000; then :; else status=1; fi
        row "dp8_b$batch" "$batch" 8 "$OUT/dp8_b$batch.json" >> "$OUT_ROOT/summary.md"
        grep -h "KV cache" "$OUT/dp8_b$batch.decode.log" | head -1 >> "$OUT/kv_capacity.txt"
      done
      { echo; echo "KV capacity (rank 0's log line, per case):"; cat "$OUT/kv_capacity.txt" 2> /dev/null; } \
        >> "$OUT_ROOT/summary.md" ;;
    split)
      {
        echo; echo "## 4 + 4: prefill on GPUs 0-3, DP=4 EP=4 decode on GPUs 4-7 (CUDA IPC)"
        echo "| case | requests per decode rank | output tok/s per GPU (all 8) | mean TPOT ms | mean TTFT ms | completed |"
        echo "|---|---|---|---|---|---|"
      } >> "$OUT_ROOT/summary.md"
      split_memory="--gpu-memory-utilization 0.9"
      [[ -n ${ONE_GPU:-} ]] && split_memory="--kv-cache-gb 1"
      for batch in $BATCHES; do
        concurrency=$((4 * batch))
        # shellcheck disable=SC2046
        if run_disaggregated "split_b$batch" "$prefill_common $(tp 4) --ep 4 --gpus $gpus_low $split_memory" \
          "$decode_common --dp 4 --ep 4 --gpus $gpus_high $split_memory" 5 \
          --random-input-len 2048 --random-output-len "$OUTPUT_LEN" --num-prompts $((concurrency * 2)) \
          --max-concurrency "$concurrency" --random-vocab-hi 150000; then :; else status=1; fi
        row "split_b$batch" "$batch" 8 "$OUT/split_b$batch.json" >> "$OUT_ROOT/summary.md"
      done ;;
    *) echo "unknown part $part"; status=1 ;;
  esac
done
cat "$OUT_ROOT/summary.md"
exit $status
