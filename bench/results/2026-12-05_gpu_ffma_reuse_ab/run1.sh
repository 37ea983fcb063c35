#!/bin/bash
# Call 1 (thirty-third session): main's binaries through every GPU test (the ffma_reuse build step's
# rewritten kernels had never run on a GPU), then two A/Bs of gpu_bench alternated three rounds:
# main against -DMOE_FFMA_REUSE=OFF (FP8 prefill), and main against the rewrite extended to the FP8
# decode GEMM (MOE_FFMA_REUSE_KERNELS + fp8_grouped_gemm_kernel; its FP8 tests first), then the
# benchmarks, serving and the disaggregated run (tools/gpu/all_check.sh) with the time left.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$OUT/summary.txt
for d in new off dec; do mkdir -p /tmp/$d; for f in .device/$d/*.xz; do python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $f > /tmp/$d/$(basename $f .xz); done; chmod +x /tmp/$d/*; done
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $S
echo "== check" >> $S
BIN=/tmp/new PARTS="check" OUT=$OUT/check tools/gpu/all_check.sh > $OUT/check.log 2>&1; echo "rc $?" >> $S
grep -E "exit|PASSED|FAILED" $OUT/check/summary.txt >> $S
echo "== prefill A/B: base = MOE_FFMA_REUSE=OFF, new = main ($SECONDS s)" >> $S
OUT=$OUT/ab_prefill timeout 200 bash tools/gpu/ab.sh /tmp/off /tmp/new --only moe_prefill 2>&1 | grep -E "moe_gemms_prefill_fp8|  ours  |cuBLASLt block" | cut -c1-160 >> $S
echo "== decode kernel rewritten: ops tests ($SECONDS s)" >> $S
timeout 120 /tmp/dec/ops_cuda_test --gtest_color=no > $OUT/dec_ops.log 2>&1; echo "rc $?" >> $S
grep -E "PASSED|FAILED|Failure" $OUT/dec_ops.log | head -6 >> $S
echo "== decode A/B: base = main, new = + fp8_grouped_gemm_kernel ($SECONDS s)" >> $S
OUT=$OUT/ab_decode timeout 150 bash tools/gpu/ab.sh /tmp/new /tmp/dec --only moe_fp8 >> $S 2>&1
echo "== all_check bench serve disagg ($SECONDS s)" >> $S
BIN=/tmp/new PARTS="bench serve disagg" OUT=$OUT/all timeout $((560 - SECONDS)) tools/gpu/all_check.sh > $OUT/all_check.log 2>&1; echo "rc $? at $SECONDS s" >> $S
cat $S
