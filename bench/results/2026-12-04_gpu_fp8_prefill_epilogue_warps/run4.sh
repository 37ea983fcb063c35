#!/bin/bash
# Call 4: ncu's warp-state statistics and per-instruction stall samples (SASS) of the FP8 prefill
# GEMMs (the first gate_up and down launches of `gpu_bench --only moe_prefill`: bf16 rows out).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/fin; for f in .device/new/gpu_bench.xz; do python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $f > /tmp/fin/$(basename $f .xz); done; chmod +x /tmp/fin/*
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
which ncu > $OUT/ncu_version.txt; ncu --version >> $OUT/ncu_version.txt 2>&1
timeout 400 ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
  --section SourceCounters --section InstructionStats --kernel-name-base mangled -k regex:prefill_grouped_gemm_kernelILb1E --launch-count 2 \
  -o /tmp/prof /tmp/fin/gpu_bench --only moe_prefill > $OUT/ncu_run.log 2>&1
echo "ncu rc $?" >> $OUT/ncu_run.log
ncu -i /tmp/prof.ncu-rep --page details > $OUT/details.txt 2>&1
ncu -i /tmp/prof.ncu-rep --page source --csv --print-source sass > $OUT/source.csv 2>&1
ls -la /tmp/prof.ncu-rep $OUT
tail -3 $OUT/ncu_run.log; head -c 600 $OUT/source.csv
