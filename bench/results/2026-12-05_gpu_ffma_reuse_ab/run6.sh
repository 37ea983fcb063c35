#!/bin/bash
# Call 6: the FP8 prefill GEMMs in pairs by default (cluster_ctas() = 2; this build): the GPU tests of
# the kernels and the model, gpu_bench's prefill GEMMs, and the one-GPU prefill throughput at 6144 and
# 2048 tokens a step with the default against MOE_PREFILL_GEMM_CLUSTER=1.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$OUT/summary.txt
mkdir -p /tmp/new; for f in .device/new/*.xz; do python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $f > /tmp/new/$(basename $f .xz); done; chmod +x /tmp/new/*
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
for t in ops_cuda_test model_cuda_test; do
  timeout 150 /tmp/new/$t --gtest_color=no > $OUT/$t.log 2>&1; echo "$t rc $?" >> $S
  grep -E "PASSED|FAILED" $OUT/$t.log >> $S
done
timeout 100 /tmp/new/gpu_bench --only moe_prefill > $OUT/bench.log 2>&1
grep -E "^moe_gemms_prefill_fp8|  ours  |cuBLASLt block" $OUT/bench.log | tail -3 | cut -c1-150 >> $S
for t in 6144 2048; do for c in default 1; do
  echo "== $t tokens a step, cluster $c" >> $S
  env $([ $c = 1 ] && echo MOE_PREFILL_GEMM_CLUSTER=1) BIN=/tmp/new FORMATS=fp8 BATCHED_TOKENS=$t PROMPTS=128 OUT=$OUT/t${t}c$c timeout 130 bash tools/gpu/prefill_one_gpu.sh >> $S 2>&1
done; done
cat $S
