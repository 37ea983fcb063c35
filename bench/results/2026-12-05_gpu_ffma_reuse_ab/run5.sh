#!/bin/bash
# Call 5: as call 3 at 1024 and 2048 tokens a step (~64 and ~128 rows per expert), two rounds each.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$OUT/summary.txt
mkdir -p /tmp/new; for f in .device/new/*.xz; do python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $f > /tmp/new/$(basename $f .xz); done; chmod +x /tmp/new/*
for t in 1024 2048 1024 2048; do for c in 1 2; do
  echo "== $t tokens a step, cluster $c" >> $S
  MOE_PREFILL_GEMM_CLUSTER=$c BIN=/tmp/new FORMATS=fp8 BATCHED_TOKENS=$t PROMPTS=128 OUT=$OUT/t${t}c$c timeout 130 bash tools/gpu/prefill_one_gpu.sh >> $S 2>&1
done; done
cat $S
