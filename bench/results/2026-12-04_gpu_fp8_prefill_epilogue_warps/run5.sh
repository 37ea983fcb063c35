#!/bin/bash
# Call 5: the FP8 prefill kernel's promotion FFMAs in SASS (cuobjdump), to see their operand-reuse flags.
mkdir -p /tmp/fin; python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" .device/new/gpu_bench.xz > /tmp/fin/gpu_bench
F=_ZN3moe3ops4cuda56_GLOBAL__N__932d6bc2_23_grouped_gemm_prefill_cu_d91b3a0b27prefill_grouped_gemm_kernelILb1ELb1ELi32ELi1EEEv14CUtensorMap_stS4_S4_NS2_11PrefillArgsE
cuobjdump -sass -fun $F /tmp/fin/gpu_bench > $OUT/gate_up.sass 2>&1
wc -l $OUT/gate_up.sass; grep -c "FFMA" $OUT/gate_up.sass; grep -c "FFMA.*reuse" $OUT/gate_up.sass
grep -n -m1 -B2 -A40 "WARPGROUP.DEPBAR.LE gsb0, 0x0" $OUT/gate_up.sass | grep -E "FFMA|DEPBAR" | head -40
