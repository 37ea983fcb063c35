#!/bin/bash
# Call 3: the consumers' wait for an item's first stage timed apart from the epilogue; staged down
# (alignment fixed) and L2 prefetch of the next item's first weight stages (MOE_PREFILL_PREFETCH_NEXT).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unxz() { python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $1; }
mkdir -p /tmp/new; for f in .device/new/*.xz; do unxz $f > /tmp/new/$(basename $f .xz); done; chmod +x /tmp/new/*
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
S=$OUT/summary.txt
run_test() { echo "=== $*" >> $S; timeout 200 /tmp/new/"$@" --gtest_color=no > /tmp/t.log 2>&1; echo "rc $?" >> $S
  cat /tmp/t.log >> $OUT/tests.log; grep -E "PASSED|FAILED|Failure" /tmp/t.log | head -12 >> $S; }
F='--gtest_filter=*Fp8*:*Prefill*:*Grouped*'
run_test ops_cuda_test $F
MOE_PREFILL_PREFETCH_NEXT=2,6 run_test ops_cuda_test $F
export MOE_TRACE_NO_MMA_RATE=1
variant() { case $1 in base) echo "MOE_PREFILL_STAGED_OUT=0";; staged) echo "MOE_PREFILL_STAGED_OUT=1";;
  pf26) echo "MOE_PREFILL_STAGED_OUT=0 MOE_PREFILL_PREFETCH_NEXT=2,6";; pf14) echo "MOE_PREFILL_STAGED_OUT=0 MOE_PREFILL_PREFETCH_NEXT=1,4";;
  pf410) echo "MOE_PREFILL_STAGED_OUT=0 MOE_PREFILL_PREFETCH_NEXT=4,10";; spf26) echo "MOE_PREFILL_STAGED_OUT=1 MOE_PREFILL_PREFETCH_NEXT=2,6";; esac; }
for r in 1 2; do for v in base staged pf26 pf14 pf410 spf26; do
  echo "== trace 375 $v" >> $S; env $(variant $v) /tmp/new/prefill_gemm_trace 375 > /tmp/tr.log 2>&1; cat /tmp/tr.log >> $OUT/trace.log
  grep -E "back to back|warpgroup [01]: [0-9]+ cycles per CTA, [0-9.]+ GHz;" /tmp/tr.log | cut -c1-360 >> $S
done; done
run_test model_cuda_test
cat $S
