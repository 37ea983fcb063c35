#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for d in t2; do mkdir -p /tmp/$d; for f in .device/$d/*.gz; do gunzip -c $f > /tmp/$d/$(basename $f .gz); done; chmod +x /tmp/$d/*; done
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv >> $S
for rows in 375 1000 256; do echo "== trace $rows (one CTA)" >> $S; MOE_TRACE_NO_MMA_RATE=1 /tmp/t2/prefill_gemm_trace $rows >> $S 2>&1; done
echo "== trace 375 pairs" >> $S; MOE_PREFILL_GEMM_CLUSTER=2 MOE_TRACE_NO_MMA_RATE=1 /tmp/t2/prefill_gemm_trace 375 >> $S 2>&1
echo "== trace 375 again" >> $S; MOE_TRACE_NO_MMA_RATE=1 /tmp/t2/prefill_gemm_trace 375 >> $S 2>&1
echo "== gpu_bench moe_prefill" >> $S; /tmp/t2/gpu_bench --only moe_prefill > $OUT/bench.log 2>&1; grep -E "L2 read|prefill_fp8|cublaslt_fp8|ours  |cuBLASLt block" $OUT/bench.log >> $S
cat $S
