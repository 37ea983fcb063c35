# Shell helpers of the tools/gpu scripts (sourced from the repository root).

# Waits until the router at URL counts WANT healthy instances, one of PIDS is
# gone, or TRIES x 0.2 s have passed; prints the count it last saw.
wait_router_instances() {  # url want tries pids...
  local url=$1 want=$2 tries=$3 healthy=0
  shift 3
  for _ in $(seq 1 "$tries"); do
    healthy=$(curl -sf "$url/metrics" | grep -c '^moeserve:router_instance_healthy.* 1$')
    [[ $healthy -ge $want ]] && break
    for pid in "$@"; do kill -0 "$pid" 2> /dev/null || break 2; done
    sleep 0.2
  done
  echo "$healthy"
}

# One disaggregated case behind a router, loaded by `moeserve bench serve`: a
# router (port 18580), a prefill instance (18581) and a decode instance
# (18582) registering with it, each given its flags as one word-split string;
# waits (WAIT_TRIES x 0.2 s, default 150 s: dummy weights are drawn and warmed
# up) for WANT healthy instances (data-parallel decode ranks count one each),
# then runs bench serve with the remaining arguments (BENCH_TIMEOUT, default
# 200 s), its result in $OUT/NAME.json and logs in $OUT/NAME.*.log. Needs BIN,
# CONFIG and OUT. Fails when the instances did not come up or the bench failed.
run_disaggregated() {  # name, prefill flags, decode flags, want, bench flags...
  local name=$1 prefill_flags=$2 decode_flags=$3 want=$4 healthy status=0 limit
  shift 4
  # The router admits what the instances do (it refuses instances below its limit).
  limit=$(grep -oE -- "--max-model-len [0-9]+" <<< "$prefill_flags" | head -1)
  # shellcheck disable=SC2086  # $limit is empty or two words
  "$BIN/moeserve" router --model "$CONFIG" --port 18580 $limit > "$OUT/$name.router.log" 2>&1 &
  local router=$!
  # shellcheck disable=SC2086  # the flags are word lists
  "$BIN/moeserve" prefill $prefill_flags --host 127.0.0.1 --port 18581 --router http://127.0.0.1:18580 \
    > "$OUT/$name.prefill.log" 2>&1 &
  local prefill=$!
  # shellcheck disable=SC2086
  "$BIN/moeserve" decode $decode_flags --host 127.0.0.1 --port 18582 --router http://127.0.0.1:18580 \
    > "$OUT/$name.decode.log" 2>&1 &
  local decode=$!
  healthy=$(wait_router_instances http://127.0.0.1:18580 "$want" "${WAIT_TRIES:-750}" "$decode" "$prefill" "$router")
  if [[ $healthy -lt $want ]]; then
    echo "$name: did not start ($healthy of $want instances healthy)"
    tail -n 3 "$OUT/$name.router.log" "$OUT/$name.prefill.log" "$OUT/$name.decode.log"
    status=1
  else
    timeout "${BENCH_TIMEOUT:-200}" "$BIN/moeserve" bench serve --url http://127.0.0.1:18580 "$@" \
      --save-result "$OUT/$name.json" > "$OUT/$name.bench.log" 2>&1 || status=1
  fi
  kill -INT $decode $prefill 2> /dev/null
  wait $decode $prefill 2> /dev/null
  kill -INT $router 2> /dev/null
  wait $router 2> /dev/null
  return $status
}
