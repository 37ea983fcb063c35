#!/bin/bash
# Call 6: the promotion FFMAs with the scale operand kept in the reuse cache throughout (ffma_reuse.py;
# KEEP 0: every FFMA, 8: all but every eighth) against ptxas' alternation: the FP8 tests on the patched
# ops_cuda_test, then gpu_bench's interleaved FP8 prefill timing, binaries alternated.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=bench/results/2026-12-04_gpu_fp8_prefill_epilogue_warps
mkdir -p /tmp/fin; for f in .device/new/*.xz; do python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $f > /tmp/fin/$(basename $f .xz); done; chmod +x /tmp/fin/*
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
S=$OUT/summary.txt
cuobjdump -sass /tmp/fin/gpu_bench > /tmp/gb.sass 2>/dev/null
for k in 0 8; do
  for b in gpu_bench ops_cuda_test; do
    python3 $R/ffma_reuse.py /tmp/gb.sass /tmp/fin/$b /tmp/fin/${b}_r$k $k prefill_grouped_gemm_kernelILb1E >> $OUT/patch.log 2>&1
    chmod +x /tmp/fin/${b}_r$k
  done
done
tail -2 $OUT/patch.log >> $S
cuobjdump -sass /tmp/fin/gpu_bench_r0 2>/dev/null | grep -m6 "FFMA R1[89]" >> $OUT/patch.log
for k in 0 8; do
  echo "=== ops_cuda_test_r$k" >> $S
  timeout 150 /tmp/fin/ops_cuda_test_r$k --gtest_color=no '--gtest_filter=*Fp8*:*Prefill*' > /tmp/t.log 2>&1; echo "rc $?" >> $S
  grep -E "PASSED|FAILED|Failure" /tmp/t.log | head -6 >> $S
done
for r in 1 2; do for b in gpu_bench gpu_bench_r0 gpu_bench_r8; do
  echo "== $b" >> $S; timeout 100 /tmp/fin/$b --only moe_prefill > /tmp/cur.log 2>&1; cat /tmp/cur.log >> $OUT/bench.log
  grep -E "^moe_gemms_prefill_fp8|  ours  |cuBLASLt block" /tmp/cur.log | tail -3 | cut -c1-150 >> $S
done; done
cat $S
