#!/usr/bin/env bash
# The runs issue 7 asks of a machine with two H200s (nvidia-h200-x2), from
# binaries built elsewhere and carried (tools/gpu/check.sh says how; also
# comm_cuda_test, comm_cuda_bench, disagg_cuda_test, parallel_cuda_test).
# Each part fits one device call (10 minutes); PARTS picks them, in order:
#   comm    the communication layer at 2 ranks: tests (all-reduce, fused
#           norm, dispatch/combine with bf16 and FP8 rows, NCCL) and the bench
#           (all-reduce eager and in graphs vs NCCL 4 KB..256 MB, fused vs
#           plain, dispatch + combine at 1/32/128/256 tokens per rank);
#   disagg  prefill on GPU 0 and decode on GPU 1 behind the router (CUDA IPC
#           across GPUs), prefill --tp 2 over both GPUs, decode --dp 2 --ep 2
#           over both GPUs (bf16 golden models and the demo, and the demo in
#           fp8-block), all against generate --device cuda; no MTP runs;
#   prefill a dummy Qwen3-235B-A22B (LAYERS layers) served by --tp 2 --ep 2 and
#           by --ep 2 against one GPU: prefill input tokens/s, decode tokens/s;
#   decode  decode instances behind the router: one GPU against --dp 2 --ep 2,
#           bf16 then fp8-block, output tokens/s at CONCURRENCY and twice that.
# Results under $OUT/<part>/ and one summary in $OUT/summary.md. Never enables
# NVLink multicast (see comm_check.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
PARTS=${PARTS:-comm disagg prefill decode}
mkdir -p "$OUT"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [[ $gpus -lt 2 ]]; then echo "x2_runs: $gpus GPU(s), 2 needed"; exit 1; fi
status=0
{
  echo "# Issue 7, x2 runs ($(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null)): $PARTS"
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
} >> "$OUT/summary.md"
for part in $PARTS; do
  mkdir -p "$OUT/$part"
  echo "=== $part"
  case $part in
    comm)
      OUT="$OUT/comm" timeout 560 bash tools/gpu/comm_check.sh > "$OUT/comm/comm_check.log" 2>&1 || status=1
      { echo; echo "## Communication"; grep -E "PASSED|FAILED" "$OUT/comm/comm_check.log";
        cat "$OUT/comm/comm_bench.md" 2>/dev/null; } >> "$OUT/summary.md" ;;
    disagg)
      OUT="$OUT/disagg" NO_SPECULATIVE=1 timeout 560 bash tools/gpu/disagg_check.sh > /dev/null 2>&1 || status=1
      { echo; echo "## Disaggregated, two GPUs"; grep -vE "^  20" "$OUT/disagg/summary.txt"; } >> "$OUT/summary.md" ;;
    prefill)
      OUT="$OUT/prefill" timeout 560 bash tools/gpu/ranks_bench.sh > "$OUT/prefill/table.md" 2>&1 || status=1
      { echo; echo "## TP/EP instances against one GPU"; cat "$OUT/prefill/table.md"; } >> "$OUT/summary.md" ;;
    decode)
      OUT="$OUT/decode" DECODE_ONLY=1 timeout 280 bash tools/gpu/ranks_bench.sh > "$OUT/decode/bf16.md" 2>&1 || status=1
      OUT="$OUT/decode" DECODE_ONLY=1 MODEL_FLAGS="--quantization fp8-block" timeout 280 \
        bash tools/gpu/ranks_bench.sh > "$OUT/decode/fp8.md" 2>&1 || status=1
      { echo; echo "## DP decode instances against one GPU"; cat "$OUT/decode/bf16.md" "$OUT/decode/fp8.md"; } \
        >> "$OUT/summary.md" ;;
    *) echo "unknown part $part"; status=1 ;;
  esac
done
cat "$OUT/summary.md"
exit $status
