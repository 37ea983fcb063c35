#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for d in old new; do mkdir -p /tmp/$d; for f in .device/$d/gpu_bench.gz; do gunzip -c $f > /tmp/$d/$(basename $f .gz); done; chmod +x /tmp/$d/*; done
S=$OUT/summary.txt
for r in 1 2 3; do for v in old new; do
  echo "== $v gpu_bench moe_fp8" >> $S; /tmp/$v/gpu_bench --only moe_fp8 > /tmp/cur.log 2>&1; cat /tmp/cur.log >> $OUT/bench.log; grep -E "^moe_experts_decode_fp8|gate_up \+ down  |->" /tmp/cur.log | cut -c1-100 >> $S
done; done
cat $S
