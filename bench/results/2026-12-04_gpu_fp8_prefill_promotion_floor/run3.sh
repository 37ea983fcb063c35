#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for d in s28; do mkdir -p /tmp/$d; for f in .device/$d/*.gz; do gunzip -c $f > /tmp/$d/$(basename $f .gz); done; chmod +x /tmp/$d/*; done
S=$OUT/summary.txt
B=/tmp/s28
cuobjdump -sass $B/prefill_gemm_plain > /tmp/plain.sass 2>&1
awk '/Function :/{name=$3} /HGMMA/{c[name]++} /FFMA/{f[name]++} END{for (n in c) print c[n], f[n], n}' /tmp/plain.sass | grep -i mma_rate >> $S
grep -n "Function : .*mma_rate_kernelILi0E" -A400 /tmp/plain.sass | grep -E "HGMMA|WARPGROUP|FFMA|BAR|DEPBAR" | head -60 > $OUT/sass_variant0.txt
echo "== plain 375" >> $S; $B/prefill_gemm_plain 375 >> $S 2>&1
echo "== plain 375 again" >> $S; $B/prefill_gemm_plain 375 >> $S 2>&1
cat $S
