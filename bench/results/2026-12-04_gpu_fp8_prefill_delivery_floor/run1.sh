#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for d in old new; do mkdir -p /tmp/$d; for f in .device/$d/*.gz; do gunzip -c $f > /tmp/$d/$(basename $f .gz); done; chmod +x /tmp/$d/*; done
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv >> $S
run_test() { local d=$1; shift; echo "=== $d $*" >> $S; timeout 300 /tmp/$d/"$@" --gtest_color=no > /tmp/t.log 2>&1; echo "rc $?" >> $S
  cat /tmp/t.log >> $OUT/tests.log; grep -E "PASSED|FAILED|Failure" /tmp/t.log | head -12 >> $S; }
run_test new ops_cuda_test --gtest_filter='*Fp8*:*Prefill*'
for v in old new; do echo "== trace $v" >> $S; MOE_TRACE_NO_MMA_RATE=1 /tmp/$v/prefill_gemm_trace 375 >> $S 2>&1; done
for r in 1 2 3; do for v in old new; do echo "== gpu_bench moe_prefill $v" >> $S; /tmp/$v/gpu_bench --only moe_prefill > /tmp/cur.log 2>&1; cat /tmp/cur.log >> $OUT/bench.log; grep -E "prefill_fp8|FP8 prefill" -A4 /tmp/cur.log | grep -E "fp8|ours  |cuBLASLt" >> $S; done; done
run_test new ops_cuda_test
run_test new model_cuda_test
cuobjdump -sass .device/new/gp.o > /tmp/gp.sass 2>&1
awk '/Function : .*prefill_grouped_gemm_kernelILb1ELb1ELi32/{f=1} /Function : /&&!/ILb1ELb1ELi32/{f=0} f' /tmp/gp.sass > $OUT/gateup32.sass
grep -n "STL\|LDL" $OUT/gateup32.sass >> $S
cat $S
