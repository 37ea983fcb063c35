#!/usr/bin/env bash
# The main job on a fresh Debian 12 machine: installs what is missing, builds,
# and runs moeserve on the bundled tiny model on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
scripts/install_deps.sh
make all
exec build/bin/moeserve generate --model models/tiny-moe --prompt-ids 1,5,9,23 --max-tokens 32 --temperature 0 "$@"
