#!/bin/bash
# Call 6: is down's epilogue the CTAs storing all at once? CTAs started late by (c % k) x d cycles
# (trace build, MOE_TRACE_STAGGER=d,k), registers-to-global stores and TMA tensor stores.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unxz() { python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $1; }
mkdir -p /tmp/new; for f in .device/new/*.xz; do unxz $f > /tmp/new/$(basename $f .xz); done; chmod +x /tmp/new/*
S=$OUT/summary.txt
export MOE_TRACE_NO_MMA_RATE=1
for r in 1 2; do for v in "0 0,0" "0 4700,4" "0 9450,2" "1 0,0" "1 4700,4"; do set -- $v
  echo "== trace 375 staged $1 stagger $2" >> $S; MOE_PREFILL_STAGED_OUT=$1 MOE_TRACE_STAGGER=$2 /tmp/new/prefill_gemm_trace 375 > /tmp/tr.log 2>&1; cat /tmp/tr.log >> $OUT/trace.log
  grep -E "back to back|warpgroup [1]: [0-9]+ cycles per CTA, [0-9.]+ GHz;" /tmp/tr.log | cut -c1-360 >> $S
done; done
cat $S
