#!/bin/bash
# Call 4: as call 3 at 4096 tokens a step (~256 rows per expert), two rounds, and a third round at 6144.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$OUT/summary.txt
mkdir -p /tmp/new; for f in .device/new/*.xz; do python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $f > /tmp/new/$(basename $f .xz); done; chmod +x /tmp/new/*
for t in 4096 4096 6144; do for c in 1 2; do
  echo "== $t tokens a step, cluster $c" >> $S
  MOE_PREFILL_GEMM_CLUSTER=$c BIN=/tmp/new FORMATS=fp8 BATCHED_TOKENS=$t PROMPTS=128 OUT=$OUT/t${t}c$c timeout 130 bash tools/gpu/prefill_one_gpu.sh >> $S 2>&1
done; done
cat $S
