#!/bin/bash
# Call 11: gate_up's E4M3 epilogue rounding its SiLU values to bf16 two per conversion (new) against one
# (old); FP8 tests, model tests, traced cycles alternated.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/new; for f in .device/new/*.xz; do python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $f > /tmp/new/$(basename $f .xz); done; chmod +x /tmp/new/*
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
S=$OUT/summary.txt
run_test() { echo "=== $*" >> $S; timeout 150 /tmp/new/"$@" --gtest_color=no > /tmp/t.log 2>&1; echo "rc $?" >> $S
  cat /tmp/t.log >> $OUT/tests.log; grep -E "PASSED|FAILED|Failure" /tmp/t.log | head -12 >> $S; }
run_test ops_cuda_test '--gtest_filter=*Fp8*:*Prefill*:*Grouped*'
run_test model_cuda_test
export MOE_TRACE_NO_MMA_RATE=1
for r in 1 2; do for v in prefill_gemm_trace_old prefill_gemm_trace; do
  echo "== $v" >> $S; timeout 60 /tmp/new/$v 375 > /tmp/tr.log 2>&1
  grep -E "back to back|warpgroup [1]: [0-9]+ cycles per CTA, [0-9.]+ GHz;" /tmp/tr.log | head -2 | cut -c1-330 >> $S
done; done
cat $S
