#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for d in old new; do mkdir -p /tmp/$d; for f in .device/$d/*.gz; do gunzip -c $f > /tmp/$d/$(basename $f .gz); done; chmod +x /tmp/$d/*; done
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
S=$OUT/summary.txt
run_test() { local d=$1; shift; echo "=== $d $*" >> $S; timeout 300 /tmp/$d/"$@" --gtest_color=no > /tmp/t.log 2>&1; echo "rc $?" >> $S
  cat /tmp/t.log >> $OUT/tests.log; grep -E "PASSED|FAILED|Failure" /tmp/t.log | head -12 >> $S; }
MOE_PREFILL_GEMM_CLUSTER=2 run_test new ops_cuda_test --gtest_filter='*Fp8*:*Prefill*:*Grouped*'
MOE_PREFILL_GEMM_CLUSTER=1 run_test new ops_cuda_test --gtest_filter='*Fp8*:*Prefill*:*Grouped*'
for r in 1 2 3; do for v in old new; do
  echo "== $v gpu_bench moe_prefill (FP8 one CTA)" >> $S; /tmp/$v/gpu_bench --only moe_prefill > /tmp/cur.log 2>&1; cat /tmp/cur.log >> $OUT/bench.log; grep -E "ours  |cuBLASLt" /tmp/cur.log | cut -c1-120 >> $S
  echo "== $v gpu_bench moe_prefill FP8 pairs" >> $S; MOE_PREFILL_GEMM_CLUSTER=2 /tmp/$v/gpu_bench --only moe_prefill > /tmp/cur.log 2>&1; cat /tmp/cur.log >> $OUT/bench.log; grep -E "ours  |cuBLASLt block" /tmp/cur.log | tail -2 | cut -c1-120 >> $S
done; done
export MOE_TRACE_NO_MMA_RATE=1
for r in 1 2; do for v in old new; do for c in 1 2; do for rows in 375 256 1000; do
  echo "== $v cluster $c rows $rows: $(MOE_PREFILL_GEMM_CLUSTER=$c /tmp/$v/prefill_gemm_trace $rows 2>&1 | grep 'back to back' | sed 's/timed back to back (medians of 21)://')" >> $S
done; done; done; done
run_test new model_cuda_test
cat $S
