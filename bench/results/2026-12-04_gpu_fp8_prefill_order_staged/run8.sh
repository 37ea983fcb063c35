#!/bin/bash
# Call 8: down's bf16 rows through a 2 KB shared-memory part per warp (stmatrix, read back, whole-line stores;
# four stages kept) against the quad-transposed stores from registers (MOE_PREFILL_STAGED_OUT=0).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unxz() { python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $1; }
mkdir -p /tmp/new; for f in .device/new/*.xz; do unxz $f > /tmp/new/$(basename $f .xz); done; chmod +x /tmp/new/*
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
S=$OUT/summary.txt
run_test() { echo "=== $*" >> $S; timeout 200 /tmp/new/"$@" --gtest_color=no > /tmp/t.log 2>&1; echo "rc $?" >> $S
  cat /tmp/t.log >> $OUT/tests.log; grep -E "PASSED|FAILED|Failure" /tmp/t.log | head -12 >> $S; }
F='--gtest_filter=*Fp8*:*Prefill*:*Grouped*'
run_test ops_cuda_test $F
if grep -q FAILED $S; then cat $S; exit 1; fi
MOE_PREFILL_GEMM_CLUSTER=2 run_test ops_cuda_test $F
export MOE_TRACE_NO_MMA_RATE=1
for r in 1 2; do for v in 0 1; do
  echo "== trace 375 staged $v" >> $S; MOE_PREFILL_STAGED_OUT=$v /tmp/new/prefill_gemm_trace 375 > /tmp/tr.log 2>&1; cat /tmp/tr.log >> $OUT/trace.log
  grep -E "back to back|warpgroup [1]: [0-9]+ cycles per CTA, [0-9.]+ GHz;" /tmp/tr.log | cut -c1-360 >> $S
done; done
for r in 1 2; do
  echo "== gpu_bench" >> $S; /tmp/new/gpu_bench --only moe_prefill > /tmp/cur.log 2>&1; cat /tmp/cur.log >> $OUT/bench.log
  grep -E "^moe_gemms_prefill_fp8|ours|cuBLASLt block" /tmp/cur.log | tail -5 | cut -c1-140 >> $S
done
echo "== gpu_bench random 375" >> $S; MOE_BENCH_PREFILL_ROUTING=random /tmp/new/gpu_bench --only moe_prefill > /tmp/cur.log 2>&1; cat /tmp/cur.log >> $OUT/bench.log
grep -E "ours|cuBLASLt block" /tmp/cur.log | tail -4 | cut -c1-140 >> $S
run_test model_cuda_test
cat $S
