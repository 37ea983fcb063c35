#!/usr/bin/env bash
# The communication layer on a machine with two NVIDIA GPUs (nvidia-h200-x2;
# on x4/x8 machines RANKS="2 4" or "2 4 8" also times 4 and 8 ranks):
# runs comm_cuda_test (all-reduce one-shot/two-shot/auto vs the CPU sum,
# fused all-reduce + residual + RMSNorm vs the CPU reference, dispatch then
# combine vs the reference weighted sum, NCCL vs ours), then comm_cuda_bench
# (our all-reduce eager and in CUDA graphs vs NCCL from 4 KB to 256 MB, fused
# vs plain at hidden 4096, dispatch+combine at 1/32/128/256 tokens per rank),
# and writes the table to $OUT/comm_bench.md (+ .jsonl, logs, device.txt).
#
# Binaries come from a build made elsewhere and carried here:
#   cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DMOE_STATIC_RUNTIME=ON
#   cmake --build build-gpu --target comm_cuda_test comm_cuda_bench
# or, with BUILD=1, are built here into build-comm-gpu (needs nvcc, cmake and
# the Debian packages of DESIGN section 7).
#
# SAFETY: multicast stays off. The variables below make our NVLS path refuse
# to start and keep NCCL off NVLS; nothing here creates a multicast object.
#
# NCCL is loaded with dlopen: when libnccl.so.2 is not on the library path,
# PyTorch's copy (the nvidia-nccl wheel) is used if python3 can find it.
# Exit status: 0 when the tests passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
BIN=${BIN:-build-gpu/bin}
SOURCE_DIR=${SOURCE_DIR:-/work/main}
mkdir -p "$OUT"
if [[ "${BUILD:-0}" == 1 ]]; then
  cmake -S . -B build-comm-gpu -DCMAKE_BUILD_TYPE=Release > "$OUT/cmake.log" 2>&1 &&
    cmake --build build-comm-gpu -j "$(nproc)" --target comm_cuda_test comm_cuda_bench >> "$OUT/cmake.log" 2>&1 ||
    { echo "build failed, see $OUT/cmake.log"; tail -20 "$OUT/cmake.log"; exit 1; }
  BIN=build-comm-gpu/bin
fi
# Tests find tests/data through the source path compiled into them.
if [[ "$(pwd)" != "$SOURCE_DIR" && ! -e "$SOURCE_DIR" ]]; then
  mkdir -p "$(dirname "$SOURCE_DIR")" && ln -s "$(pwd)" "$SOURCE_DIR"
fi
if ! ldconfig -p 2>/dev/null | grep -q libnccl.so.2; then
  nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
  [[ -n "$nccl_dir" ]] && export LD_LIBRARY_PATH="$nccl_dir:${LD_LIBRARY_PATH:-}"
fi
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true

status=0
echo "=== comm_cuda_test"
timeout 600 "$BIN/comm_cuda_test" --gtest_color=no 2>&1 | tee "$OUT/comm_cuda_test.log" | grep -vE "^\[ (RUN|      OK) \]"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
grep -q "SKIPPED" "$OUT/comm_cuda_test.log" && { echo "tests skipped (fewer than 2 GPUs?)"; status=1; }

# RANKS="2 4" (x4) or "2 4 8" (x8): the bench at each rank count the machine has GPUs for.
: > "$OUT/comm_bench.md"
: > "$OUT/comm_bench.jsonl"
num_gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
for ranks in ${RANKS:-2}; do
  if [[ $ranks -gt $num_gpus ]]; then echo "comm_cuda_bench --ranks $ranks: skipped, $num_gpus GPU(s)"; continue; fi
  echo "=== comm_cuda_bench --ranks $ranks"
  timeout 900 "$BIN/comm_cuda_bench" --ranks "$ranks" --json "$OUT/comm_bench_$ranks.jsonl" --max-mb "${MAX_MB:-256}" \
    >> "$OUT/comm_bench.md" 2>> "$OUT/comm_bench.log"
  echo "bench exit: $?"
  cat "$OUT/comm_bench_$ranks.jsonl" >> "$OUT/comm_bench.jsonl" 2>/dev/null
done
cat "$OUT/comm_bench.md"
tail -5 "$OUT/comm_bench.log"
{
  echo
  echo "Targets (issue 7): <= 5 us up to 256 KB in a graph; >= 330 GB/s at 64 MB;"
  echo "fused within 10% of plain at hidden 4096; dispatch <= 20 us, combine <= 25 us at 128 tokens."
  echo "Date $(date -u +%FT%TZ), $(head -1 "$OUT/device.txt")"
} | tee -a "$OUT/comm_bench.md"
exit $status
