#!/usr/bin/env bash
# The whole test suite on a fresh Debian 12 machine: installs what is missing,
# builds (Release, CUDA files compiled when nvcc exists), runs every CPU test,
# then the CPU tests again under AddressSanitizer + UndefinedBehaviorSanitizer,
# then short libFuzzer runs of the safetensors header parser, the tokenizer and the
# chat-template engine.
# GPU tests (ctest label "gpu") skip themselves without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"

scripts/install_deps.sh --test

echo "=== Release build and tests"
make all
(cd build && ctest --output-on-failure -j "$(nproc)")

echo "=== ASan + UBSan build and tests"
make asan-test

if [[ -f fuzz/CMakeLists.txt ]]; then
  echo "=== libFuzzer: safetensors header parser (${MOE_FUZZ_SECONDS:-45} s)"
  make fuzz
  mkdir -p build-fuzz/corpus
  build-fuzz/bin/safetensors_fuzz -max_total_time="${MOE_FUZZ_SECONDS:-45}" -print_final_stats=1 \
    build-fuzz/corpus fuzz/corpus
  for target in tokenizer_fuzz chat_template_fuzz structured_fuzz; do
    echo "=== libFuzzer: ${target} (${MOE_TOKENIZER_FUZZ_SECONDS:-20} s)"
    mkdir -p "build-fuzz/corpus_${target}"
    seeds=()  # checked-in seed inputs (fuzz/corpus_<target>), read only
    [[ -d "fuzz/corpus_${target}" ]] && seeds=("fuzz/corpus_${target}")
    "build-fuzz/bin/${target}" -max_total_time="${MOE_TOKENIZER_FUZZ_SECONDS:-20}" -print_final_stats=1 \
      -max_len=4096 "build-fuzz/corpus_${target}" "${seeds[@]}"
  done
fi
echo "=== all tests passed"
