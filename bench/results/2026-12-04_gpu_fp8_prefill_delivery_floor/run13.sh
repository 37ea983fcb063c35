#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unxz() { python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $1; }
for d in old new; do mkdir -p /tmp/$d; for f in .device/$d/*.xz; do unxz $f > /tmp/$d/$(basename $f .xz); done; chmod +x /tmp/$d/*; done
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
S=$OUT/summary.txt
run_test() { local d=$1; shift; echo "=== $d $*" >> $S; timeout 300 /tmp/$d/"$@" --gtest_color=no > /tmp/t.log 2>&1; echo "rc $?" >> $S
  cat /tmp/t.log >> $OUT/tests.log; grep -E "PASSED|FAILED|Failure" /tmp/t.log | head -12 >> $S; }
run_test new ops_cuda_test
MOE_PREFILL_GEMM_CLUSTER=1 run_test new ops_cuda_test --gtest_filter='*Fp8*:*Prefill*:*Grouped*'
run_test new model_cuda_test
for r in 1 2 3; do for v in old new; do
  echo "== $v gpu_bench moe_prefill" >> $S; /tmp/$v/gpu_bench --only moe_prefill > /tmp/cur.log 2>&1; cat /tmp/cur.log >> $OUT/bench.log
  grep -E "ours  |cuBLAS" /tmp/cur.log | cut -c1-110 >> $S
done; done
cat $S
