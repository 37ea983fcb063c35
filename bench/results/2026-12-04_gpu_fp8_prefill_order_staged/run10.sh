#!/bin/bash
# Call 10: what gate_up's epilogue math is bound by (diagnostic build, results wrong where parts are
# replaced; MOE_TRACE_EPI_DIAG: 1 = no bf16 round trip, 2 = no reciprocal, 4 = no exponential).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/new; python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" .device/new/prefill_gemm_trace_epi.xz > /tmp/new/t; chmod +x /tmp/new/t
S=$OUT/summary.txt
export MOE_TRACE_NO_MMA_RATE=1
for r in 1 2; do for e in 0 1 2 4 6 7; do
  echo "== diag 375 switches $e" >> $S; MOE_TRACE_EPI_DIAG=$e timeout 60 /tmp/new/t 375 > /tmp/tr.log 2>&1
  grep -E "back to back|warpgroup [1]: [0-9]+ cycles per CTA, [0-9.]+ GHz;" /tmp/tr.log | head -2 | cut -c1-330 >> $S
done; done
cat $S
