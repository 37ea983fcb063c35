#!/bin/bash
# Call 3: the same question end to end: one GPU's FP8 prefill throughput (tools/gpu/prefill_one_gpu.sh:
# dummy Qwen3-235B, 8 layers, 2048-token prompts, 128 of them) at 6144 tokens a step (~384 rows per expert) with
# MOE_PREFILL_GEMM_CLUSTER=1 and 2 alternated, two rounds.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$OUT/summary.txt
mkdir -p /tmp/new; for f in .device/new/*.xz; do python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $f > /tmp/new/$(basename $f .xz); done; chmod +x /tmp/new/*
for r in 1 2; do for c in 1 2; do
  echo "== round $r cluster $c" >> $S
  MOE_PREFILL_GEMM_CLUSTER=$c BIN=/tmp/new FORMATS=fp8 BATCHED_TOKENS=6144 PROMPTS=128 OUT=$OUT/r${r}c$c timeout 130 bash tools/gpu/prefill_one_gpu.sh >> $S 2>&1
done; done
cat $S
