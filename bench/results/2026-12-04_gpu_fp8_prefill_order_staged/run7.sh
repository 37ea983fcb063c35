#!/bin/bash
# Call 7: the committed code (phase clocks with the epilogue and the first-stage wait apart); a diagnostic
# build (MOE_TRACE_EPILOGUE: 16 = the epilogue's math without its stores, 8 = no epilogue; results wrong).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unxz() { python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $1; }
mkdir -p /tmp/new; for f in .device/new/*.xz; do unxz $f > /tmp/new/$(basename $f .xz); done; chmod +x /tmp/new/*
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
S=$OUT/summary.txt
run_test() { echo "=== $*" >> $S; timeout 200 /tmp/new/"$@" --gtest_color=no > /tmp/t.log 2>&1; echo "rc $?" >> $S
  cat /tmp/t.log >> $OUT/tests.log; grep -E "PASSED|FAILED|Failure" /tmp/t.log | head -12 >> $S; }
run_test ops_cuda_test '--gtest_filter=*Fp8*:*Prefill*:*Grouped*'
echo "== committed trace tool, 375 rows" >> $S; /tmp/new/prefill_gemm_trace 375 > $OUT/trace_committed.log 2>&1; cat $OUT/trace_committed.log >> $S
export MOE_TRACE_NO_MMA_RATE=1
for r in 1 2; do for e in 0 16 8; do
  echo "== diag 375 epilogue switches $e" >> $S; MOE_TRACE_EPILOGUE=$e /tmp/new/prefill_gemm_trace_diag 375 > /tmp/tr.log 2>&1; cat /tmp/tr.log >> $OUT/trace.log
  grep -E "back to back|warpgroup [1]: [0-9]+ cycles per CTA, [0-9.]+ GHz;" /tmp/tr.log | cut -c1-360 >> $S
done; done
echo "== gpu_bench moe_prefill" >> $S; /tmp/new/gpu_bench --only moe_prefill > $OUT/bench.log 2>&1; grep -E "L2 read|^moe_gemms_prefill|^cublaslt|ours|cuBLASLt" $OUT/bench.log | cut -c1-170 >> $S
cat $S
