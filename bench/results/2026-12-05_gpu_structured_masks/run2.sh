#!/bin/bash
# Call 2 (thirty-fifth session): patterns, formats and guided_regex on the GPU
# server (the regex automaton, d0acb27..6386f2f) -- speculative_cuda_test
# (f04f26c) and `serve --device cuda` on the demo model, with and without MTP
# drafts: greedy and sampled outputs checked by Python's re and json.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$OUT/summary.txt
mkdir -p /tmp/new; for f in .device/new2/*.xz; do python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $f > /tmp/new/$(basename $f .xz); done; chmod +x /tmp/new/*
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
nvidia-smi --query-gpu=name --format=csv,noheader > $S
timeout 200 /tmp/new/speculative_cuda_test --gtest_color=no > $OUT/speculative_cuda_test.log 2>&1; echo "speculative_cuda_test rc $?" >> $S
grep -E "PASSED|FAILED|OK \] CudaStructured" $OUT/speculative_cuda_test.log >> $S
for spec in "" "--speculative-config {\"method\":\"mtp\",\"num_speculative_tokens\":2} --speculative-model models/moeserve-demo-mtp"; do
  /tmp/new/moeserve serve --device cuda --kv-cache-gb 2 --port 18570 $spec > /dev/null 2> $OUT/serve.log &
  server=$!
  for _ in $(seq 1 150); do curl -sf localhost:18570/health > /dev/null && break; sleep 0.2; done
  python3 - "${spec:+MTP k=2}" >> $S 2>&1 <<'PY'
import json, re, sys, urllib.request
label = sys.argv[1] or "plain"
def post(body):
    req = urllib.request.Request("http://localhost:18570/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=120))
regex = r"(yes|no), [0-9]{1,3} (apples|pears)\."
schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
          "when": {"type": "string", "format": "date-time"}, "ip": {"type": "string", "format": "ipv4"}},
          "required": ["code", "when", "ip"]}
iso = re.compile(r"^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d+)?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)$")
ipv4 = re.compile(r"^((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)$")
ok = bad = 0
for body in ({"guided_regex": regex, "temperature": 0}, {"guided_regex": regex, "temperature": 1, "seed": 4, "n": 8}):
    for c in post({"model": "moeserve-demo", "prompt": "The answer is", "max_tokens": 40, **body})["choices"]:
        good = c["finish_reason"] == "stop" and re.fullmatch(regex, c["text"]) is not None
        ok += good; bad += not good
for body in ({"temperature": 0}, {"temperature": 1, "seed": 4, "n": 8}):
    for c in post({"model": "moeserve-demo", "prompt": "Record:", "max_tokens": 200, "response_format":
                   {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}, **body})["choices"]:
        if c["finish_reason"] != "stop":
            continue
        v = json.loads(c["text"])
        good = re.fullmatch(r"[A-Z]{2}-\d{3}", v["code"]) and iso.match(v["when"]) and ipv4.match(v["ip"])
        ok += bool(good); bad += not good
print(f"{label}: {ok} outputs valid, {bad} not")
PY
  kill -INT $server; wait $server; echo "serve ($spec) exit $?" >> $S
done
cat $S
