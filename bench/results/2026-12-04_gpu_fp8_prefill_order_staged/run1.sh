#!/bin/bash
# Call 1: tests of the staged down epilogue and the rows-inner item order, then A/B of both.
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
MOE_PREFILL_GEMM_ORDER=rows run_test ops_cuda_test $F
MOE_PREFILL_STAGED_OUT=0 MOE_PREFILL_GEMM_ORDER=rows run_test ops_cuda_test $F
run_test model_cuda_test
export MOE_TRACE_NO_MMA_RATE=1
# variants: base = the old code paths (four stages, column tiles innermost)
variant() { case $1 in base) echo "MOE_PREFILL_STAGED_OUT=0";; staged) echo "MOE_PREFILL_STAGED_OUT=1";;
  rows) echo "MOE_PREFILL_STAGED_OUT=0 MOE_PREFILL_GEMM_ORDER=rows";; both) echo "MOE_PREFILL_GEMM_ORDER=rows";; esac; }
for r in 1 2; do for v in base staged rows both; do
  echo "== trace 375 $v" >> $S; env $(variant $v) /tmp/new/prefill_gemm_trace 375 > /tmp/tr.log 2>&1; cat /tmp/tr.log >> $OUT/trace.log
  grep -E "back to back|: [0-9.]+ ms, .*TB/s" /tmp/tr.log | cut -c1-240 >> $S
done; done
for r in 1 2; do for v in base both; do
  echo "== gpu_bench $v" >> $S; env $(variant $v) /tmp/new/gpu_bench --only moe_prefill > /tmp/cur.log 2>&1; cat /tmp/cur.log >> $OUT/bench.log
  grep -E "^moe_gemms_prefill_fp8|ours  |cuBLASLt block" /tmp/cur.log | tail -3 | cut -c1-140 >> $S
done; done
cat $S
