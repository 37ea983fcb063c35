#!/bin/bash
# Call 2: the FP8 producer's scales copied by warps 0-1 (two rows a thread; warps 2-3 idle) against all
# four warps (one row a thread, decc2da's prefill_gemm_trace_old): FP8/prefill tests, traced cycles
# alternated (three rounds, one CTA; one round pairs), gpu_bench interleaved against cuBLASLt.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unxz() { python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $1; }
mkdir -p /tmp/new; for f in .device/new/*.xz; do unxz $f > /tmp/new/$(basename $f .xz); done; chmod +x /tmp/new/*
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv >> $S
run_test() { echo "=== $*" >> $S; timeout 250 /tmp/new/"$@" --gtest_color=no > /tmp/t.log 2>&1; echo "rc $?" >> $S
  cat /tmp/t.log >> $OUT/tests.log; grep -E "PASSED|FAILED|Failure" /tmp/t.log | head -12 >> $S; }
run_test ops_cuda_test '--gtest_filter=*Fp8*:*Prefill*:*Grouped*'
if grep -q -E "FAILED|rc [^0]" $S; then cat $S; exit 1; fi
MOE_PREFILL_GEMM_CLUSTER=2 run_test ops_cuda_test '--gtest_filter=*Fp8*:*Prefill*:*Grouped*'
export MOE_TRACE_NO_MMA_RATE=1
for r in 1 2 3; do for v in prefill_gemm_trace_old prefill_gemm_trace; do
  echo "== $v" >> $S; timeout 60 /tmp/new/$v 375 > /tmp/tr.log 2>&1; cat /tmp/tr.log >> $OUT/trace.log
  grep -E "back to back|warpgroup [1]: [0-9]+ cycles per CTA, [0-9.]+ GHz;" /tmp/tr.log | head -3 | cut -c1-330 >> $S
done; done
for v in prefill_gemm_trace_old prefill_gemm_trace; do
  echo "== pairs $v" >> $S; MOE_PREFILL_GEMM_CLUSTER=2 timeout 60 /tmp/new/$v 375 > /tmp/tr.log 2>&1; cat /tmp/tr.log >> $OUT/trace.log
  grep -E "back to back|warpgroup [1]: [0-9]+ cycles per CTA, [0-9.]+ GHz;" /tmp/tr.log | head -3 | cut -c1-330 >> $S
done
for r in 1 2; do
  echo "== gpu_bench" >> $S; timeout 150 /tmp/new/gpu_bench --only moe_prefill > /tmp/cur.log 2>&1; cat /tmp/cur.log >> $OUT/bench.log
  grep -E "^moe_gemms_prefill_fp8|ours|cuBLASLt block" /tmp/cur.log | tail -5 | cut -c1-140 >> $S
done
run_test ops_cuda_test
run_test model_cuda_test
cat $S
