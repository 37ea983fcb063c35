#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for d in s28; do mkdir -p /tmp/$d; for f in .device/$d/*.gz; do gunzip -c $f > /tmp/$d/$(basename $f .gz); done; chmod +x /tmp/$d/*; done
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,clocks.sm --format=csv >> $S
B=/tmp/s28
echo "== plain 375" >> $S; $B/prefill_gemm_plain 375 >> $S 2>&1
echo "== trace 375" >> $S; $B/prefill_gemm_trace 375 >> $S 2>&1
echo "== plain 375 again" >> $S; $B/prefill_gemm_plain 375 2>&1 | grep timed >> $S
echo "== trace 256" >> $S; $B/prefill_gemm_trace 256 2>&1 | grep -v mma_rate -A0 | head -12 >> $S
echo "== gpu_bench moe_prefill" >> $S; $B/gpu_bench --only moe_prefill > $OUT/bench.log 2>&1; grep -E "prefill|-> " $OUT/bench.log >> $S
cat $S
