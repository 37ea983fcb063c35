#!/usr/bin/env bash
# The runs issue 9 asks of a machine with 4 H200s (nvidia-h200-x4), in one
# device call, from binaries built elsewhere and carried (tools/gpu/check.sh
# says how; comm_cuda_test and comm_cuda_bench too):
#   1. the communication layer at 2 and 4 ranks: all-reduce (ours and NCCL,
#      eager and in CUDA graphs, 4 KB to 256 MB), fused all-reduce + RMSNorm,
#      dispatch/combine (tools/gpu/comm_check.sh with RANKS="2 4");
#   2. a TP=4, EP=4 instance of dummy Qwen3-235B-A22B (LAYERS layers, bf16)
#      against one GPU: prefill input tokens/s for 2k, 6k and 16k-token
#      prompts, and decode (tools/gpu/ranks_bench.sh, WORLD=4). FP8 is EP-only
#      for now (TP over quantized projections is refused), so its row runs
#      --ep 4.
# Results under $OUT: comm/ (comm_bench.md, .jsonl) and ranks_<len>.md; the
# summary in $OUT/summary.md. Never enables NVLink multicast (see comm_check.sh).
# Not yet run: no 4-GPU machine has been lent (written 2026-12-01).
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/comm"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [[ $gpus -lt 4 ]]; then echo "x4_runs: $gpus GPU(s), 4 needed"; exit 1; fi
status=0
{
  echo "# Issue 9, x4 runs ($(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null))"
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
} > "$OUT/summary.md"

echo "=== comm at 2 and 4 ranks"
OUT="$OUT/comm" RANKS="2 4" timeout 900 bash tools/gpu/comm_check.sh > "$OUT/comm/comm_check.log" 2>&1 || status=1
{ echo; echo "## Communication"; cat "$OUT/comm/comm_bench.md" 2>/dev/null; } >> "$OUT/summary.md"

for len in 2048 6144 16384; do
  echo "=== TP=4 EP=4 against one GPU, $len-token prompts"
  OUT="$OUT/ranks_$len" WORLD=4 LAYOUTS="--tp 4 --ep 4|--ep 4 --quantization fp8-block" PREFILL_LEN=$len \
    timeout 900 bash tools/gpu/ranks_bench.sh > "$OUT/ranks_$len.md" 2>&1 || status=1
  { echo; echo "## Prefill $len tokens"; cat "$OUT/ranks_$len.md"; } >> "$OUT/summary.md"
done
cat "$OUT/summary.md"
exit $status
