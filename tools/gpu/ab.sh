#!/usr/bin/env bash
# A/B timing of two builds in one device call: runs the same gpu_bench command
# with the base build and the new one, alternated ROUNDS times (default 3), and
# prints the lines each run reports (the bench rows and the "->" lines of the
# interleaved timings) labelled base / new. Compare a change against main's
# own binary this way, never against a run-time switch inside an experiment
# binary: on 2026-12-04 such a switch's "off" mode was itself 3 points slower
# than main, and a change that looked +3 points gained nothing
# (bench/results/2026-12-04_gpu_fp8_decode_rows_warp.md).
#
# Usage, on the GPU machine from the repository root:
#   bash tools/gpu/ab.sh BASE_DIR NEW_DIR [gpu_bench arguments...]
# e.g. bash tools/gpu/ab.sh .device/base .device/new --only moe_fp8 --moe-tokens 64
# Each directory holds gpu_bench or gpu_bench.gz (stripped and gzipped to
# travel: 4 MB). The base build, made here beside build-gpu:
#   git worktree add --detach /tmp/moe-base main
#   cmake -S /tmp/moe-base -B /tmp/moe-base/build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_STATIC_RUNTIME=ON
#   ninja -C /tmp/moe-base/build-gpu gpu_bench
# Full logs: $OUT/ab.log (default OUT=/tmp/out).
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if (($# < 2)); then
  echo "usage: $0 BASE_DIR NEW_DIR [gpu_bench arguments...]" >&2
  exit 2
fi
base_dir=$1 new_dir=$2
shift 2
OUT=${OUT:-/tmp/out}
ROUNDS=${ROUNDS:-3}
PATTERN=${PATTERN:-'^[a-z_0-9]+ .* ms  floor |-> '}
mkdir -p "$OUT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The binary of build `name` from `dir`, unpacked into $work when gzipped.
binary_of() {
  local name=$1 dir=$2
  if [[ -x "$dir/gpu_bench" ]]; then
    echo "$dir/gpu_bench"
  elif [[ -f "$dir/gpu_bench.gz" ]]; then
    gunzip -c "$dir/gpu_bench.gz" > "$work/$name" && chmod +x "$work/$name" && echo "$work/$name"
  else
    echo "ab.sh: no gpu_bench or gpu_bench.gz in $dir" >&2
    return 1
  fi
}
base=$(binary_of base "$base_dir") || exit 2
new=$(binary_of new "$new_dir") || exit 2

status=0
for ((round = 1; round <= ROUNDS; ++round)); do
  for build in base new; do
    bin=$base
    [[ $build == new ]] && bin=$new
    echo "=== round $round $build: gpu_bench $*" >> "$OUT/ab.log"
    if ! "$bin" "$@" > "$work/run.log" 2>&1; then
      echo "ab.sh: round $round $build failed (log: $OUT/ab.log)" >&2
      status=1
    fi
    cat "$work/run.log" >> "$OUT/ab.log"
    grep -E "$PATTERN" "$work/run.log" | sed "s/^/round $round $build: /"
  done
done
exit $status
