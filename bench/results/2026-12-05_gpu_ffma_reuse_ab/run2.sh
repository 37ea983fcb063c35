#!/bin/bash
# Call 2: with the promotion FFMAs' reuse bits in (main's binary), do 2-CTA clusters (pairs) now beat
# one CTA per item for the FP8 prefill GEMMs at 375 rows per expert? (The thirtieth session measured the
# consumers, not the data, as the limit of pairs.) MOE_PREFILL_GEMM_CLUSTER=1 / 2 alternated, four rounds.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$OUT/summary.txt
mkdir -p /tmp/new; python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" .device/new/gpu_bench.xz > /tmp/new/gpu_bench; chmod +x /tmp/new/gpu_bench
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $S
for r in 1 2 3 4; do for c in 1 2; do
  echo "== round $r cluster $c" >> $S
  MOE_PREFILL_GEMM_CLUSTER=$c timeout 100 /tmp/new/gpu_bench --only moe_prefill > /tmp/cur.log 2>&1
  cat /tmp/cur.log >> $OUT/bench.log
  grep -E "^moe_gemms_prefill_fp8|  ours  |cuBLASLt block" /tmp/cur.log | tail -3 | cut -c1-150 >> $S
done; done
cat $S
