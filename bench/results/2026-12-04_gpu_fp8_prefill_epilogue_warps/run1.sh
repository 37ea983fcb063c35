#!/bin/bash
# Call 1: the FP8 prefill epilogue by the producer warpgroup's warps 2-3 from the item's last stage
# (the handoff, default) against the consumers' own epilogue (MOE_PREFILL_HANDOFF=0): tests, traced
# cycles alternated (one CTA, pairs), gpu_bench interleaved (even and random routing), model tests.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unxz() { python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $1; }
mkdir -p /tmp/new; for f in .device/new/*.xz; do unxz $f > /tmp/new/$(basename $f .xz); done; chmod +x /tmp/new/*
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv >> $S
run_test() { echo "=== $*" >> $S; timeout 200 /tmp/new/"$@" --gtest_color=no > /tmp/t.log 2>&1; echo "rc $?" >> $S
  cat /tmp/t.log >> $OUT/tests.log; grep -E "PASSED|FAILED|Failure" /tmp/t.log | head -12 >> $S; }
F='--gtest_filter=*Fp8*:*Prefill*:*Grouped*'
run_test ops_cuda_test $F
if grep -q -E "FAILED|rc [^0]" $S; then cat $S; exit 1; fi
MOE_PREFILL_GEMM_CLUSTER=2 run_test ops_cuda_test $F
export MOE_TRACE_NO_MMA_RATE=1
for r in 1 2; do for v in 0 1; do
  echo "== trace 375 handoff $v" >> $S; MOE_PREFILL_HANDOFF=$v timeout 60 /tmp/new/prefill_gemm_trace 375 > /tmp/tr.log 2>&1; cat /tmp/tr.log >> $OUT/trace.log
  grep -E "back to back|warpgroup [01]: [0-9]+ cycles per CTA, [0-9.]+ GHz;" /tmp/tr.log | head -5 | cut -c1-360 >> $S
done; done
for v in 0 1; do
  echo "== trace 375 pairs handoff $v" >> $S; MOE_PREFILL_GEMM_CLUSTER=2 MOE_PREFILL_HANDOFF=$v timeout 60 /tmp/new/prefill_gemm_trace 375 > /tmp/tr.log 2>&1; cat /tmp/tr.log >> $OUT/trace.log
  grep -E "back to back|warpgroup [1]: [0-9]+ cycles per CTA, [0-9.]+ GHz;" /tmp/tr.log | head -3 | cut -c1-360 >> $S
done
for r in 1 2; do
  echo "== gpu_bench" >> $S; timeout 150 /tmp/new/gpu_bench --only moe_prefill > /tmp/cur.log 2>&1; cat /tmp/cur.log >> $OUT/bench.log
  grep -E "^moe_gemms_prefill_fp8|ours|cuBLASLt block" /tmp/cur.log | tail -6 | cut -c1-140 >> $S
done
echo "== gpu_bench random 375" >> $S; MOE_BENCH_PREFILL_ROUTING=random timeout 150 /tmp/new/gpu_bench --only moe_prefill > /tmp/cur.log 2>&1; cat /tmp/cur.log >> $OUT/bench.log
grep -E "ours|cuBLASLt block" /tmp/cur.log | tail -5 | cut -c1-140 >> $S
run_test model_cuda_test
cat $S
