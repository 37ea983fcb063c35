#!/bin/bash
# Call 2: pairs with the stage release passed on by the producer (MOE_PREFILL_PAIR_FORWARD=1, trace build f1)
# against the consumers arriving on both CTAs (f0); tests of the new default build.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unxz() { python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $1; }
mkdir -p /tmp/new; for f in .device/new/*.xz; do unxz $f > /tmp/new/$(basename $f .xz); done; chmod +x /tmp/new/*
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
S=$OUT/summary.txt
run_test() { echo "=== $*" >> $S; timeout 200 /tmp/new/"$@" --gtest_color=no > /tmp/t.log 2>&1; echo "rc $?" >> $S
  cat /tmp/t.log >> $OUT/tests.log; grep -E "PASSED|FAILED|Failure" /tmp/t.log | head -12 >> $S; }
F='--gtest_filter=*Fp8*:*Prefill*:*Grouped*'
run_test ops_cuda_test
MOE_PREFILL_GEMM_CLUSTER=2 run_test ops_cuda_test $F
MOE_PREFILL_GEMM_CLUSTER=2 MOE_PREFILL_STAGED_OUT=0 run_test ops_cuda_test $F
run_test model_cuda_test
export MOE_TRACE_NO_MMA_RATE=1
for r in 1 2; do for rows in 375 1000; do for f in f0 f1; do for c in 1 2; do
  echo "== trace $rows $f cluster $c" >> $S; MOE_PREFILL_STAGED_OUT=0 MOE_PREFILL_GEMM_CLUSTER=$c /tmp/new/prefill_gemm_trace_$f $rows > /tmp/tr.log 2>&1; cat /tmp/tr.log >> $OUT/trace.log
  grep -E "back to back|warpgroup [01]: [0-9]+ cycles per CTA, [0-9.]+ GHz;" /tmp/tr.log | cut -c1-330 >> $S
done; done; done; done
cat $S
