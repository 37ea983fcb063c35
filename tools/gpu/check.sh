#!/usr/bin/env bash
# Runs the GPU tests (and, with --bench, the GPU benchmarks) on a machine with
# an NVIDIA GPU, from binaries built elsewhere with
#   cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DMOE_STATIC_RUNTIME=ON
#   cmake --build build-gpu --target ops_cuda_test model_cuda_test dtype_cuda_test sampling_cuda_test speculative_cuda_test parallel_cuda_test comm_cuda_test gpu_bench
# (static libstdc++ and header-only fmt, so only the CUDA libraries are needed
# where it runs). Tests find tests/data through the source path compiled into
# them; SOURCE_DIR maps it to this checkout. Logs go to $OUT (default /tmp/out).
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
BIN=${BIN:-build-gpu/bin}
SOURCE_DIR=${SOURCE_DIR:-/work/main}
mkdir -p "$OUT"
if [[ "$(pwd)" != "$SOURCE_DIR" && ! -e "$SOURCE_DIR" ]]; then
  mkdir -p "$(dirname "$SOURCE_DIR")" && ln -s "$(pwd)" "$SOURCE_DIR"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
status=0
for t in dtype_cuda_test ops_cuda_test sampling_cuda_test model_cuda_test speculative_cuda_test parallel_cuda_test comm_cuda_test; do
  echo "=== $t"
  "$BIN/$t" --gtest_color=no 2>&1 | tee "$OUT/$t.log" | grep -vE "^\[ (RUN|      OK) \]" || true
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
done
echo "=== summary"
grep -hE "PASSED|FAILED|max relative|margin" "$OUT"/*_test.log
exit $status
