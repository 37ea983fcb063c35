#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for d in fin; do mkdir -p /tmp/$d; for f in .device/$d/*.gz; do gunzip -c $f > /tmp/$d/$(basename $f .gz); done; chmod +x /tmp/$d/*; done
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
S=$OUT/trace.txt
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv >> $S
echo "== trace 375 (one CTA per item, the default)" >> $S; /tmp/fin/prefill_gemm_trace 375 >> $S 2>&1
echo "== trace 375, pairs (MOE_PREFILL_GEMM_CLUSTER=2)" >> $S; MOE_PREFILL_GEMM_CLUSTER=2 /tmp/fin/prefill_gemm_trace 375 2>&1 | grep -v "^  [a-zA-Z0-9 (),']*%.*TFLOP" >> $S
echo "== trace 256" >> $S; /tmp/fin/prefill_gemm_trace 256 2>&1 | grep -v "^  [a-zA-Z0-9 (),']*%.*TFLOP" >> $S
BIN=/tmp/fin PARTS="check bench" OUT=$OUT tools/gpu/all_check.sh > /dev/null 2>&1
cat $S | head -80
grep -E "exit|PASSED|FAILED" $OUT/summary.txt | head -30
