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
