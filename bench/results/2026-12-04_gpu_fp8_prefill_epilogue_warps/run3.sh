#!/bin/bash
# Call 3: the session's final code: every GPU test, the benchmarks with their PyTorch peers, serving and
# the disaggregated run (tools/gpu/all_check.sh), and the phase clocks at 375 rows per expert.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/fin; for f in .device/new/*.xz; do python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $f > /tmp/fin/$(basename $f .xz); done; chmod +x /tmp/fin/*
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $OUT/trace.txt
MOE_TRACE_NO_MMA_RATE=1 timeout 60 /tmp/fin/prefill_gemm_trace 375 >> $OUT/trace.txt 2>&1
BIN=/tmp/fin PARTS="check bench serve disagg" OUT=$OUT tools/gpu/all_check.sh > $OUT/all_check.log 2>&1
grep -E "exit|PASSED|FAILED" $OUT/summary.txt | head -30
grep -E "back to back|epilogue|^  gate_up:|^  down:" $OUT/trace.txt
