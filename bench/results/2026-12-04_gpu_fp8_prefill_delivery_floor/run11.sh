#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/fin; python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" .device/new/gpu_bench.xz > /tmp/fin/gpu_bench; chmod +x /tmp/fin/gpu_bench
S=$OUT/summary.txt
for r in 1 2; do for case in "random 375" "random 256" "even 256" "even 512"; do set -- $case; for c in 1 2; do
  echo "== $1 $2 rows, cluster $c" >> $S
  MOE_BENCH_PREFILL_ROUTING=$1 MOE_BENCH_PREFILL_ROWS=$2 MOE_PREFILL_GEMM_CLUSTER=$c /tmp/fin/gpu_bench --only moe_prefill > /tmp/cur.log 2>&1; cat /tmp/cur.log >> $OUT/bench.log
  grep -A3 "FP8 prefill GEMMs, interleaved" /tmp/cur.log | grep -E "ours  |cuBLASLt block" | cut -c1-110 >> $S
done; done; done
cat $S
