#!/usr/bin/env bash
# TransferEngine on a machine with two NVIDIA GPUs: runs the CUDA IPC test
# (peer writes between the GPUs of one process, and a write into a region
# exported by a child process) and the CUDA IPC benchmark against a plain
# cudaMemcpyPeerAsync measured in the same run, then prints a table and checks
# the >= 90% target on transfers of 64 MB and more. Binaries come from
#   cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DMOE_STATIC_RUNTIME=ON
#   cmake --build build-gpu --target transfer_cuda_ipc_test transfer_bench
# Logs go to $OUT (default /tmp/out). Exit status: 0 when the test passed and
# the target was met.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
BIN=${BIN:-build-gpu/bin}
REPEATS=${REPEATS:-5}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
nvidia-smi topo -m > "$OUT/topology.txt" 2>&1 || true
status=0

echo "=== transfer_cuda_ipc_test"
"$BIN/transfer_cuda_ipc_test" --gtest_color=no > "$OUT/transfer_cuda_ipc_test.log" 2>&1 || status=1
grep -E "^\[ +(OK|FAILED|SKIPPED) +\]|Skipped|skipped|PASSED|FAILED" "$OUT/transfer_cuda_ipc_test.log" | grep -v "CudaIpcChild"

echo "=== transfer_bench --cuda (CUDA IPC vs cudaMemcpyPeerAsync, median of $REPEATS)"
"$BIN/transfer_bench" --no-tcp --no-kv --cuda --repeats "$REPEATS" > "$OUT/transfer_bench.log" 2>&1 || status=1
grep -E "^\||CUDA IPC" "$OUT/transfer_bench.log"

echo "=== target: engine >= 90% of cudaMemcpyPeer for sizes >= 64 MB"
awk -F'|' '/ MB \|/ {
  size = $2 + 0; ratio = $6; gsub(/[ %]/, "", ratio);
  if (size >= 64) { checked++; if (ratio + 0 < 90) { bad++; printf "  below target: %s MB at %s%%\n", size, ratio } }
}
END {
  if (checked == 0) { print "  no CUDA IPC rows (fewer than 2 GPUs?)"; exit 1 }
  if (bad > 0) exit 1; print "  met on " checked " sizes"
}' "$OUT/transfer_bench.log" || status=1
echo "=== $([[ $status -eq 0 ]] && echo PASSED || echo FAILED) (logs in $OUT)"
exit $status
