#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for d in t3; do mkdir -p /tmp/$d; for f in .device/$d/*.gz; do gunzip -c $f > /tmp/$d/$(basename $f .gz); done; chmod +x /tmp/$d/*; done
S=$OUT/summary.txt
export MOE_TRACE_NO_MMA_RATE=1
for pf in 0 4 8 16; do echo "== trace 375 prefetch $pf" >> $S; MOE_PREFILL_GEMM_PREFETCH=$pf /tmp/t3/prefill_gemm_trace 375 > $OUT/trace_$pf.txt 2>&1; grep -E "back to back|between items|^  gate_up:|^  down:" $OUT/trace_$pf.txt | sed 's/issue half 0.*between/between/' >> $S; done
echo "== trace 375 pairs prefetch 8" >> $S; MOE_PREFILL_GEMM_CLUSTER=2 MOE_PREFILL_GEMM_PREFETCH=8 /tmp/t3/prefill_gemm_trace 375 > $OUT/trace_pairs8.txt 2>&1; grep -E "back to back|^  gate_up:|^  down:" $OUT/trace_pairs8.txt >> $S
echo "== trace 256 prefetch 8" >> $S; MOE_PREFILL_GEMM_PREFETCH=8 /tmp/t3/prefill_gemm_trace 256 > $OUT/trace_256_8.txt 2>&1; grep -E "back to back|^  gate_up:|^  down:" $OUT/trace_256_8.txt >> $S
for r in 1 2; do for pf in 0 8 4; do echo "== gpu_bench moe_prefill prefetch $pf" >> $S; MOE_PREFILL_GEMM_PREFETCH=$pf /tmp/t3/gpu_bench --only moe_prefill > /tmp/cur.log 2>&1; cat /tmp/cur.log >> $OUT/bench.log; grep -E "prefill_fp8|ours  |cuBLASLt block" /tmp/cur.log | cut -c1-140 >> $S; done; done
cat $S
