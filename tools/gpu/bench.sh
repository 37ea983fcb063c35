#!/usr/bin/env bash
# GPU benchmarks and their PyTorch peers in one call (see tools/gpu/check.sh
# for how the binaries are built elsewhere and carried). Results: $OUT/*.jsonl.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
BIN=${BIN:-build-gpu/bin}
mkdir -p "$OUT"
"$BIN/gpu_bench" --json "$OUT/gpu_bench.jsonl" --layers "${LAYERS:-4}" ${BENCH_ONLY:+--only "$BENCH_ONLY"} 2>&1 | tee "$OUT/gpu_bench.log"
# PEERS=0: ours only (sections whose peers are not in this run's table).
[[ ${PEERS:-1} == 0 ]] || python3 bench/gpu/peer_bench.py "$OUT/peer_bench.jsonl" 2>&1 | tee "$OUT/peer_bench.log"
