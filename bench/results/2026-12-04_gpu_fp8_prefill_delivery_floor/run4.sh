#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for d in fin; do mkdir -p /tmp/$d; for f in .device/$d/*.gz; do gunzip -c $f > /tmp/$d/$(basename $f .gz); done; chmod +x /tmp/$d/*; done
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
S=$OUT/trace.txt
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv >> $S
echo "== trace 375" >> $S; MOE_TRACE_NO_MMA_RATE=1 /tmp/fin/prefill_gemm_trace 375 >> $S 2>&1
BIN=/tmp/fin PARTS="check" OUT=$OUT tools/gpu/all_check.sh > $OUT/all_check.log 2>&1
BIN=/tmp/fin PARTS="bench" BENCH_ONLY=moe_prefill,moe_fp8 PEERS=0 OUT=$OUT tools/gpu/all_check.sh > $OUT/bench_part.log 2>&1
grep -E "delivery alone\)|^  gate_up:|^  down:|back to back" $S
grep -E "exit|PASSED|FAILED|Skipped|SKIPPED" $OUT/summary.txt | head -30
grep -E "moe_.*fp8|ours  |cuBLASLt block|copy bandwidth|L2 read" $OUT/*.log | cut -c1-200 | head -30
