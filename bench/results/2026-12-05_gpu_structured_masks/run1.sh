#!/bin/bash
# Call 1 (thirty-fifth session): structured outputs' token masks as bitmasks
# (mask_logits) -- every GPU test (sampling_cuda_test's MaskLogitsEqualsTheCpu,
# speculative_cuda_test's CudaStructured engine test among them), the serve
# checks (json_schema through the GPU server, with MTP drafts and disaggregated),
# and gpu_bench's sampling section (bitmasks against the sparse entries before).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$OUT/summary.txt
mkdir -p /tmp/new; for f in .device/new/*.xz; do python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $f > /tmp/new/$(basename $f .xz); done; chmod +x /tmp/new/*
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $S
echo "== check serve ($SECONDS s)" >> $S
BIN=/tmp/new PARTS="check serve" OUT=$OUT/all timeout 420 tools/gpu/all_check.sh > $OUT/all_check.log 2>&1; echo "rc $? at $SECONDS s" >> $S
grep -E "exit|PASSED|FAILED" $OUT/all/summary.txt >> $S
mkdir -p /tmp/x && tar xzf $OUT/all/logs.tgz -C /tmp/x && grep -hE "json_schema|structured|DIFFER|equal" /tmp/x/serve.txt >> $S
grep -h -A3 "CudaStructured\|MaskLogits" /tmp/x/check/*_test.log | grep -E "OK|FAILED|Failure" >> $S
echo "== gpu_bench --only sampling ($SECONDS s)" >> $S
timeout $((570 - SECONDS)) /tmp/new/gpu_bench --only sampling --layers 4 > $OUT/sampling.log 2>&1; echo "rc $? at $SECONDS s" >> $S
grep -E "sampling_step|structured_masks" $OUT/sampling.log | cut -c1-400 >> $S
cat $S
