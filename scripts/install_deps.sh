#!/usr/bin/env bash
# Installs what moeserve needs on Debian 12: the build tools and libraries
# (apt-get), and with --test the npm packages the tests use as oracles.
# Safe to rerun: it installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake git pkg-config nlohmann-json3-dev libfmt-dev libspdlog-dev libcli11-dev
          libboost-dev libpcre2-dev libutf8proc-dev libgtest-dev libgmock-dev libbenchmark-dev
          libibverbs-dev  # optional for the build: the ibverbs transport (src/transfer), ~3 MB
          curl ca-certificates)  # the README's and scripts/run.sh's example requests; the Prometheus test
if [[ "${1:-}" == "--test" ]]; then
  packages+=(clang libclang-rt-14-dev prometheus)
  # Node.js for the npm test oracles: Debian's, unless a node and npm are
  # already there (a NodeSource nodejs ships its own npm and conflicts with
  # Debian's npm package).
  if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    packages+=(nodejs npm)
  fi
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install_deps: installing ${missing[*]}"
  sudo_cmd=()
  [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [[ "${1:-}" == "--test" && -f package.json ]]; then
  if [[ ! -d node_modules ]] || ! npm ls --silent >/dev/null 2>&1; then
    echo "install_deps: npm ci (test oracles)"
    npm ci --no-audit --no-fund --loglevel=error
  fi
fi
