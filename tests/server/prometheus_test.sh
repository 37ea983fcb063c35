#!/usr/bin/env bash
# A real Prometheus (Debian package `prometheus`) scrapes moeserve's /metrics;
# its query API must return our series with the values the traffic produced.
# Both processes are started here and killed on exit.
set -euo pipefail
BIN=${MOESERVE_BIN:-$(dirname "$0")/../../build/bin/moeserve}
PROMETHEUS=${PROMETHEUS_BIN:-prometheus}
command -v "$PROMETHEUS" >/dev/null || { echo "prometheus_test: $PROMETHEUS not installed"; exit 1; }
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

"$BIN" serve --port 0 --max-model-len 256 >"$work/serve.out" 2>"$work/serve.err" &
pids+=($!)
for _ in $(seq 100); do grep -q 'listening on' "$work/serve.out" && break; sleep 0.1; done
url=$(grep -o 'http://127.0.0.1:[0-9]*' "$work/serve.out")
port=${url##*:}
for i in 1 2 3; do
  curl -sf "$url/v1/completions" -d '{"prompt": "The", "max_tokens": 5, "ignore_eos": true}' >/dev/null
done

prom_port=$(node -e "const s=require('net').createServer().listen(0,'127.0.0.1',()=>{console.log(s.address().port);s.close()})")
cat >"$work/prometheus.yml" <<YML
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: moeserve
    static_configs:
      - targets: ['127.0.0.1:${port}']
YML
"$PROMETHEUS" --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address="127.0.0.1:${prom_port}" >"$work/prom.log" 2>&1 &
pids+=($!)

query() { curl -sf "http://127.0.0.1:${prom_port}/api/v1/query" --data-urlencode "query=$1"; }
for _ in $(seq 150); do
  if out=$(query 'moeserve:generation_tokens_total') && echo "$out" | grep -q '"value":\[[0-9.]*,"15"\]'; then
    echo "prometheus_test: generation_tokens_total = 15 scraped"
    hist=$(query 'moeserve:time_to_first_token_seconds_count')
    echo "$hist" | grep -q '"value":\[[0-9.]*,"3"\]' || { echo "bad histogram: $hist"; exit 1; }
    up=$(query 'up{job="moeserve"}')
    echo "$up" | grep -q '"value":\[[0-9.]*,"1"\]' || { echo "target not up: $up"; exit 1; }
    kv=$(query 'moeserve:kv_cache_usage_perc')
    echo "$kv" | grep -q 'model_name":"moeserve-demo"' || { echo "no kv gauge: $kv"; exit 1; }
    echo "prometheus_test: passed"
    exit 0
  fi
  sleep 0.2
done
echo "prometheus_test: no series after 30 s; last answer: ${out:-none}"
tail -20 "$work/prom.log"
exit 1
